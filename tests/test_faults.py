"""Issue 22, the units: NVMe faults on a small tmpfs (full drive, lost write, truncated file, no file
left), stale-directory removal by owner marker, cleanups on error exits and signals, the checkpoint
resume choice (incomplete/corrupt newest tag, foreign model), and the inputs that were silent or raw."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from ds_longctx.patching.checks import check_against
from ds_longctx.config import ConfigError, check_train_batch_size, load_ds_config, parse
from launch_utils import ROOT, TINY_CPU
from tiny_models import tiny_config

from ds_longctx.train import args as train_args
from ds_longctx.train import job as train_job
from ds_longctx.models import loading
from ds_longctx.train import loop as train_loop
from ds_longctx.job import checkpoint  # noqa: E402


def _tiny(**changes):
    cfg = json.load(open(TINY_CPU))
    cfg.update(changes)
    return cfg


# ---------------------------------------------------------------- NVMe ------------------------------------------
def _aio_available():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a 4 MiB tmpfs here ({p.stderr.strip() or p.returncode}): needs root/CAP_SYS_ADMIN")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.skipif(not _aio_available(), reason="DeepSpeed's async_io op needs libaio-dev")
def test_nvme_drive_full_at_a_forward_names_nvme_path(small_tmpfs):
    """A drive that fills up at a forward (no reservation before step 1: a Trainer run, a longer batch than
    planned): the patched model's forward raises the ConfigError naming nvme_path with the fix in config terms
    (apply_memory_stack translates the target's NVMeError around its writes)."""
    from tiny_models import build, memory_stack

    model = build(tiny_config(heads=16, kv_heads=4, head_dim=64, layers=1))  # 4 MiB per layer input at 1024
    lc = parse({"long_context": {"activation_checkpointing": {"enabled": True, "offload": "nvme", "keep_on_device": 0,
                                                              "nvme_path": small_tmpfs, "pin_memory": False}}})
    handle = memory_stack(model, lc)
    try:
        ids = torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(0))
        model.train()
        with pytest.raises(ConfigError, match=r"^long_context\.activation_checkpointing\.nvme_path: '.*tmpfs' is too "
                           r"full for this rank's layer inputs: .* \(No space left on device\)\. Fix: .*raise "
                           r"keep_on_device, or use offload='cpu'$"):
            model(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    assert os.listdir(small_tmpfs) == []


@pytest.mark.skipif(not _aio_available(), reason="DeepSpeed's async_io op needs libaio-dev")
def test_nvme_full_drive_lost_write_and_truncation_are_clear_errors(small_tmpfs):
    from ds_longctx.memory import naming_nvme_keys
    from ds_longctx.memory.nvme import NVMeError, NVMeTarget, reserve_on_every_rank

    t = NVMeTarget(small_tmpfs, ring=2, pin_memory=False)
    assert sorted(os.listdir(t.dir)) == ["layer_inputs.bin", "owner.json"]
    # the plan does not fit: path, bytes needed and free, before any write (the op's error names no config key;
    # naming_nvme_keys, what train.py runs it under, names nvme_path and the fix in config terms)
    with pytest.raises(NVMeError, match=r"^'.*tmpfs' is too full for this rank's layer inputs: 67108864 "
                       r"bytes \(64.0 MiB\) needed in .*layer_inputs.bin .* free\. Fix: free space"):
        reserve_on_every_rank(t, 64 << 20)
    with pytest.raises(ConfigError, match=r"^long_context\.activation_checkpointing\.nvme_path: '.*tmpfs' is too "
                       r"full .* free\. Fix: free space on that drive, point nvme_path at a larger drive, raise "
                       r"keep_on_device, or use offload='cpu'$"):
        with naming_nvme_keys():
            reserve_on_every_rank(t, 64 << 20)
    x = torch.randn(256, 1024)  # 1 MiB per layer input
    slots = []
    with pytest.raises(NVMeError, match=r"too full .* free \(No space left on device\)"):
        for i in range(8):  # the 4th does not fit: refused before the write (DeepSpeed's aio drops ENOSPC)
            s, job = t.to_host(x * i)
            t.wait(job)
            slots.append(s)
    assert len(slots) == 3
    y, job = t.to_device(slots[2], "cpu")
    t.wait(job)
    assert torch.equal(y, x * 2)
    # a write the drive lost: other bytes where the layer input was written -> error, not stale data
    with open(t.file, "r+b") as f:
        f.seek(slots[1].offset)
        f.write(b"\0" * 16)
    y, job = t.to_device(slots[1], "cpu")
    with pytest.raises(RuntimeError, match="differ from those written there .* the activations would be stale"):
        t.wait(job)
    t.close()
    t = NVMeTarget(small_tmpfs, ring=2, pin_memory=False)
    s, job = t.to_host(x)
    t.wait(job)
    os.truncate(t.file, 4096)  # DeepSpeed's pread would abort the process (native assert)
    y, job = t.to_device(s, "cpu")
    with pytest.raises(RuntimeError, match=r"holds 4096 bytes, short of the 1048576 bytes at offset 0"):
        t.wait(job)
    t.close()
    assert os.listdir(small_tmpfs) == []


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_activation_dirs_removed_only_when_ours_and_dead(tmp_path):
    import socket

    from ds_longctx.memory.nvme import MARKER, remove_stale_dirs
    from ds_longctx.dist.runtime import proc_start_time

    me = {"host": socket.gethostname(), "uid": os.getuid()}
    parent = os.getppid()
    owners = {"dead": dict(me, pid=_dead_pid(), start_time="1"),
              "alive": dict(me, pid=parent, start_time=proc_start_time(parent)),
              "reused_pid": dict(me, pid=parent, start_time="1"),  # same pid, another process: stale
              "other_host": dict(me, host="elsewhere", pid=_dead_pid(), start_time="1"),
              "other_user": dict(me, uid=os.getuid() + 1, pid=_dead_pid(), start_time="1")}
    for name, owner in owners.items():
        d = tmp_path / f"ds_longctx_act_rank0_{name}"
        d.mkdir()
        (d / MARKER).write_text(json.dumps(owner))
        (d / "layer_inputs.bin").write_bytes(b"x")
    (tmp_path / "ds_longctx_act_rank1_nomarker").mkdir()
    (tmp_path / "unrelated").mkdir()
    removed = remove_stale_dirs(str(tmp_path))
    assert sorted(os.path.basename(r) for r in removed) == ["ds_longctx_act_rank0_dead",
                                                          "ds_longctx_act_rank0_reused_pid"]
    assert sorted(os.listdir(tmp_path)) == ["ds_longctx_act_rank0_alive", "ds_longctx_act_rank0_other_host",
                                            "ds_longctx_act_rank0_other_user", "ds_longctx_act_rank1_nomarker",
                                            "unrelated"]


# ------------------------------------------------ cleanups on every exit path -------------------------------------
_CLEANUP_SCRIPT = """
import os, sys, time, ds_longctx
from ds_longctx.dist.runtime import on_exit
path = sys.argv[1]
open(path, "w").close()
on_exit(lambda: os.remove(path))
def main(mode):
    if mode == "error":
        raise RuntimeError("boom")
    print("ready", flush=True)
    time.sleep(60)
ds_longctx.run(main, sys.argv[2])
"""


def _default_signals():
    """In the child before exec: the termination signals at their defaults. A shell runs a background job (pytest
    started with &) with SIGINT ignored, and an ignored signal stays ignored across fork and exec: the child would
    then ignore the SIGINT this test sends (ds_longctx.dist.runtime keeps an ignored signal ignored, as nohup asks)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.distributed  # starts processes
def test_cleanups_run_on_error_exit_and_on_sigterm(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, RANK="0")
    f = tmp_path / "scratch"
    p = subprocess.run([sys.executable, "-c", _CLEANUP_SCRIPT, str(f), "error"], env=env, capture_output=True,
                       text=True, timeout=60, preexec_fn=_default_signals)
    assert p.returncode == 1 and "[rank 0] RuntimeError: boom" in p.stderr and not f.exists(), p.stderr
    for sig in (signal.SIGTERM, signal.SIGINT):
        p = subprocess.Popen([sys.executable, "-c", _CLEANUP_SCRIPT, str(f), "wait"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_signals)
        try:
            assert p.stdout.readline() == "ready\n"
            assert f.exists()
            p.send_signal(sig)
            out, err = p.communicate(timeout=30)
        finally:
            if p.poll() is None:  # a failed step (or the timeout) leaves no child behind
                p.kill()
                p.communicate()
        assert p.returncode == 128 + sig, (sig, p.returncode, err)
        assert f"[rank 0] ds_longctx: received {signal.Signals(sig).name}: ending this rank" in err, err
        assert not f.exists()


# ---------------------------------------------------------- checkpoints --------------------------------------------
def _fake_checkpoint(root, tag, step, facts=None, latest=True):
    """What train.py --save writes, with small real torch files."""
    d = root / tag
    d.mkdir(parents=True)
    torch.save({"w": torch.ones(4)}, d / "mp_rank_00_model_states.pt")
    torch.save({"m": torch.zeros(64)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    rec = {"step": step, "model": facts or {}, "files": checkpoint.tag_files(str(d))}
    (d / checkpoint.RECORD_FILE).write_text(json.dumps(rec))
    if latest:
        (root / "latest").write_text(tag)
    return d


def test_resume_uses_the_newest_complete_tag_and_names_each_problem(tmp_path):
    _fake_checkpoint(tmp_path, "step2", 2)
    assert checkpoint.find_resume_tag(str(tmp_path))[0::2] == ("step2", None)
    new = _fake_checkpoint(tmp_path, "step4", 4)
    model = new / "mp_rank_00_model_states.pt"
    good = model.read_bytes()
    cases = [
        (lambda: model.write_bytes(good[:100]), f"{str(model)!r} has 100 bytes, {len(good)} were saved (truncated"),
        (lambda: model.write_bytes(os.urandom(len(good))), f"{str(model)!r} is not a readable torch checkpoint file"),
        (lambda: (new / checkpoint.RECORD_FILE).write_text("{not json"),
         f"{str(new / checkpoint.RECORD_FILE)!r} is not a valid layout record (Expecting property name"),
        (lambda: (new / checkpoint.RECORD_FILE).unlink(), f"{str(new / checkpoint.RECORD_FILE)!r} is missing (the save did not"),
        (lambda: (tmp_path / "latest").write_text("step9"), f"tag directory {str(tmp_path / 'step9')!r} does not exist"),
        (lambda: (tmp_path / "latest").unlink(), "there is no 'latest' file"),
    ]
    for damage, problem in cases:
        damage()
        tag, record, note = checkpoint.find_resume_tag(str(tmp_path))
        assert tag == "step2" and record["step"] == 2, problem
        assert note.startswith("--resume: ") and problem in note, (problem, note)
        assert note.endswith(f"resuming from {str(tmp_path / 'step2')!r} (step 2), the newest complete checkpoint")
    (tmp_path / "step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("step2")
    with pytest.raises(ConfigError, match=r"--resume: checkpoint 'step2' in .*: .*optim_states.pt' has 0 bytes, .* "
                       "and no other complete checkpoint is there"):
        checkpoint.find_resume_tag(str(tmp_path))


# -------------------------------------------------------------- inputs ----------------------------------------------
def test_config_file_inputs(tmp_path):
    dup = tmp_path / "dup.json"
    dup.write_text('{"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 1}')
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size: appears more than once in .*dup.json"):
        load_ds_config(str(dup))
    with pytest.raises(ConfigError, match=r"^config: '.*' is a directory"):
        load_ds_config(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^long_context: is null\. Fix: give an object: \{\} for the defaults"):
        parse(_tiny(long_context=None))


def test_config_bounds_against_model_and_world():
    mc = tiny_config(layers=2)
    lc = parse(_tiny(long_context={"activation_checkpointing": {"enabled": True, "offload": "cpu",
                                                                 "keep_on_device": 3}}))
    with pytest.raises(ConfigError, match="keep_on_device: 3 is more than the model's 2 decoder layers"):
        check_against(lc, mc, 2)
    for name in ("tiled_mlp", "tiled_loss"):
        lc = parse(_tiny(long_context={"sequence_length": 64, name: {"enabled": True, "shards": 100000}}))
        with pytest.raises(ConfigError, match=rf"{name}.shards: 100000 is more than the 32 rows it splits"):
            check_against(lc, mc, 2)
        check_against(parse(_tiny(long_context={"sequence_length": 64, name: {"enabled": True, "shards": 32}})), mc, 2)
    with pytest.raises(ConfigError, match=r"^train_batch_size: 4 is not train_micro_batch_size_per_gpu 1 x "
                       r"gradient_accumulation_steps 1 x data-parallel size 1 \(world 2 / sequence_parallel_size 2\)"
                       r" = 1"):
        check_train_batch_size({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 1}, 2, 2)
    check_train_batch_size({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1}, 4, 2)


def _args(*argv):
    return train_args.parse_args(["--deepspeed_config", TINY_CPU, *argv])


def test_cli_inputs(tmp_path):
    from ds_longctx.data import TokenFileDataset

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"--data .*latin1.jsonl line 2: is not UTF-8 \(byte 0xe9 at column 14"):
        TokenFileDataset(str(bad), None, 8)
    txt = tmp_path / "latin1.txt"
    txt.write_bytes(b"a\nb\n\xff\n")
    with pytest.raises(ConfigError, match=r"--data .*latin1.txt line 3: is not UTF-8 \(byte 0xff at column 1"):
        TokenFileDataset(str(txt), None, 8)
    lc = parse(_tiny())
    for flag in ("--tokenizer", "--model"):
        with pytest.raises(ConfigError, match=rf"^{flag}: local path '/no/such/model' does not exist"):
            train_args.validate_args(_args(flag, "/no/such/model"), lc)
    train_args.validate_args(_args("--model", "org/name"), lc)  # a hub id is left to transformers
    for body, msg in ((dict(hidden_size=8), 'has no "model_type"'),
                      (dict(model_type="no_such_arch"), "has model_type 'no_such_arch', which this transformers"),
                      ("[1]", "holds a JSON list")):
        p = tmp_path / "m.json"
        p.write_text(body if isinstance(body, str) else json.dumps(body))
        with pytest.raises(ConfigError, match="^--model-config: .*m.json " + msg.replace("(", r"\(")):
            loading.load_model_config(str(p))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if not os.access(str(ro), os.W_OK):  # root writes everywhere
        lc = parse(_tiny(long_context=dict(_tiny()["long_context"], profile={"enabled": True,
                                                                            "output_dir": str(ro / "p")})))
        with pytest.raises(ConfigError, match="^long_context.profile.output_dir: .* is not writable"):
            train_args.validate_args(_args(), lc)
    notdir = tmp_path / "file"
    notdir.write_text("")
    lc = parse(_tiny(long_context=dict(_tiny()["long_context"], profile={"enabled": True,
                                                                        "output_dir": str(notdir / "p")})))
    with pytest.raises(ConfigError, match="^long_context.profile.output_dir: .* is not a directory"):
        train_args.validate_args(_args(), lc)
    mc = tiny_config()  # max_position_embeddings 4096
    train_args.check_max_position(_args("--seq-len", "4096"), mc, 4096)
    with pytest.raises(ConfigError, match=r"^--seq-len: 8192 is above the model's max_position_embeddings 4096\. "
                       r"Fix: .*--allow-beyond-max-position"):
        train_args.check_max_position(_args("--seq-len", "8192"), mc, 8192)
    train_args.check_max_position(_args("--seq-len", "8192", "--allow-beyond-max-position"), mc, 8192)


@pytest.mark.distributed  # a python subprocess (offline hub environment; the marker: CLI subprocesses)
def test_hub_ids_offline_name_the_id_and_the_fix(tmp_path):
    """--model / --tokenizer with a hub id the hub cannot give (HF_HUB_OFFLINE=1 here; the same OSError comes
    for an unreachable hub, a gated repo, a missing id): one ConfigError naming the id and the fixes, not
    transformers' raw OSError."""
    data = tmp_path / "d.txt"
    data.write_text("hello world\n")
    script = f"""
import sys, types
from ds_longctx.train import args as train_args
from ds_longctx.train import job as train_job
from ds_longctx.models import loading
from ds_longctx.train import loop as train_loop
from ds_longctx.errors import ConfigError
for argv in (["--model", "meta-llama/Llama-3.1-8B"], ["--model", "no-such-org/no-such-model"]):
    try:
        train_loop.main(["--deepspeed_config", {TINY_CPU!r}] + argv)
    except ConfigError as e:
        print("ERR", e)
args = types.SimpleNamespace(data={str(data)!r}, tokenizer="no-such-org/no-such-tokenizer", model=None,
                             concat_documents=False, seed=0, data_column="text")
try:
    train_job.build_dataset(args, types.SimpleNamespace(vocab_size=64), 8, train_job.load_tokenizer(args))
except ConfigError as e:
    print("ERR", e)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    errs = [line for line in p.stdout.splitlines() if line.startswith("ERR ")]
    assert len(errs) == 3, p.stdout[-2000:] + p.stderr[-3000:]
    for line, (flag, name) in zip(errs, (("--model", "meta-llama/Llama-3.1-8B"), ("--model", "no-such-org/no-such-model"),
                                         ("--tokenizer", "no-such-org/no-such-tokenizer"))):
        assert line.startswith(f"ERR {flag}: {name!r} is not a local directory"), line
        assert "HF_HUB_OFFLINE is set" in line and "gated" in line and "huggingface-cli login" in line, line
        assert "HF_HOME" in line and ("--model-config path/to/config.json" in line) == (flag == "--model"), line
    assert "--tokenizer <local tokenizer directory>" in errs[2]


def test_shards_bounded_by_the_trained_length():
    # --seq-len 64 on SP 2 gives 32 rows: 100 shards pass the config's sequence_length (512: 256 rows) but not this
    lc = parse(_tiny(long_context=dict(_tiny()["long_context"], tiled_mlp={"enabled": True, "shards": 100})))
    with pytest.raises(ConfigError, match=r"^long_context.tiled_mlp.shards: 100 is more than the 32 rows it splits "
                       r"\(sequence length 64 "):
        train_args.validate_args(_args("--seq-len", "64"), lc)
    train_args.validate_args(_args("--seq-len", "256"), lc)


@pytest.mark.distributed
def test_train_batch_size_inconsistent_is_refused_before_the_model(tmp_path):
    """train.py: an inconsistent train_batch_size was DeepSpeed's raw assertion from model_init (transformers
    parses the ds_config there); now check_train_batch_size's ConfigError comes first, naming the key."""
    cfg = json.load(open(TINY_CPU))
    cfg.update(sequence_parallel_size=1, train_batch_size=3, train_micro_batch_size_per_gpu=1,
               gradient_accumulation_steps=1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    script = f"""
import sys
from ds_longctx.train import args as train_args
from ds_longctx.train import job as train_job
from ds_longctx.models import loading
from ds_longctx.train import loop as train_loop
from ds_longctx.errors import ConfigError
try:
    train_loop.main(["--deepspeed_config", {str(path)!r}, "--steps", "1"])
except ConfigError as e:
    print("ERR", e)
"""
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "ERR train_batch_size: 3 is not" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
