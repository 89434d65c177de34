"""Issue 22's scripted rerun: every fault and bad input of the issue (and the older ones), launched as a user
launches train.py (the deepspeed launcher and mpirun, 2 ranks, CPU), each outcome classified automatically.

    python bench/fault_rerun.py                          # every case, both launchers
    python bench/fault_rerun.py --launcher mpirun --group inputs,nvme
    python bench/fault_rerun.py --only ck_truncated_model,kill_save_r0_after_record

Outcome of a case (the first that applies):
  hang        the launch did not end within its timeout (its process group is then killed)
  orphan      a process of the case (its cmdline names the case's own directory) still runs 15 s after the
              launcher ended (killed by pid afterwards)
  files-left  a file is left in the case's nvme_path (after a kill -9: after the next run's start-up removal,
              memory/nvme.remove_stale_dirs, which is what a new NVMeTarget runs first)
  raw         a traceback, a native abort (Assertion, terminate called, SIGABRT) or an error line without
              ds_longctx's "KEY: problem. Fix: fix" form
  silent      the run succeeded (or resumed from a checkpoint it should not have) without the expected message
  wrong       an error, but not the expected one (or not on every rank)
  clear       the expected outcome: for a bad input, "[rank r] ds_longctx: error: KEY: ... Fix: ..." with the
              expected text on every rank; for a signal, every rank gone within seconds with its message; for a
              damaged checkpoint, the resume names the file and resumes the newest complete tag

Writes bench/results/fault_rerun.json (command, machine, date, per case per launcher) and prints the table.
Run time: ~25-40 s per launch on 2 busy cores (the launch's start dominates); --launcher/--group/--only
select a part.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from launch_utils import TINY_CPU, TRAIN, _env, mpirun_command  # noqa: E402
from dist_utils import free_port  # noqa: E402

BASE = "/tmp/ds_longctx_fault_rerun"
TIMEOUT_S = 240
ORPHAN_GRACE_S = 15
TINY = json.load(open(TINY_CPU))
TINY_MODEL = json.load(open(os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")))
FAST = ("--seq-len", "64", "--eval-samples", "0")


# ------------------------------------------------------------------ launching -------------------------------------
def launcher_cmd(launcher, argv, port):
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
                *argv]
    return mpirun_command(2, argv)


def start(launcher, argv, env_extra=None, cmd=None):
    """Start the launch in its own session; a thread drains its output as a terminal would (a full pipe
    would stall the job: a rank blocked writing its last line is not a hang of the job)."""
    import threading

    port = free_port()
    env = dict(_env(), MASTER_PORT=str(port), **(env_extra or {}))
    cmd = cmd or launcher_cmd(launcher, argv, port)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", start_new_session=True)
    p.cmd = cmd
    p.chunks = []
    p.reader = threading.Thread(target=lambda: p.chunks.extend(iter(p.stdout.readline, "")), daemon=True)
    p.reader.start()
    return p


def finish(p, timeout):
    """(returncode or None on a hang, output)."""
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        rc = None
    p.reader.join(timeout=10)  # the output ends when the last process holding the pipe is gone
    return rc, "".join(p.chunks)


def case_pids(marker):
    """Live processes (not zombies) whose command line contains ``marker`` (the case's own directory)."""
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        pid = int(d[6:])
        if pid == os.getpid():
            continue
        try:
            with open(f"{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(pid)
    return out


def rank_pids(marker):
    """{rank: pid} of the case's train.py ranks (RANK or OMPI_COMM_WORLD_RANK in their environment)."""
    ranks = {}
    for pid in case_pids(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if not any(c.endswith(b"train.py") for c in cmd) or any(
                b"deepspeed.launcher" in c or c.endswith((b"/deepspeed", b"mpirun", b"prterun", b"bash")) for c in cmd[:4]):
            continue
        r = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"RANK")
        if r is not None:
            ranks[int(r)] = pid
    return ranks


def orphans_after(marker):
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while time.monotonic() < deadline:
        left = case_pids(marker)
        if not left:
            return []
        time.sleep(0.5)
    left = case_pids(marker)
    for pid in left:  # processes this script started: end them by pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


# ------------------------------------------------------------------ classifying -----------------------------------
RAW_MARKS = ("Traceback (most recent call last)", "Assertion", "terminate called", "Segmentation fault",
             "core dumped", "Fatal Python error")


def error_lines(out):
    return [ln for ln in out.splitlines() if "ds_longctx: error:" in ln]


def classify_error(rc, out, expect, ranks=(0, 1)):
    """A bad input: one clear error naming the key and fix, with ``expect`` in it, on every rank."""
    if rc is None:
        return "hang", "no end within the timeout"
    if any(m in out for m in RAW_MARKS):
        mark = next(m for m in RAW_MARKS if m in out)
        return "raw", f"output holds {mark!r}"
    if rc == 0:
        return "silent", "exit 0"
    lines = error_lines(out)
    if not lines:
        return "raw", f"exit {rc} without a ds_longctx error line: {out.strip().splitlines()[-1:]!r}"
    if not all(". Fix: " in ln for ln in lines):
        return "raw", "an error line without its fix"
    hit = {r for r in ranks for ln in lines if ln.startswith(f"[rank {r}] ") and expect in ln}
    if not hit:
        return "wrong", f"expected {expect!r}, got {lines[0][:200]!r}"
    if hit != set(ranks):
        return "wrong", f"on ranks {sorted(hit)} only"
    return "clear", lines[0][:300]


@dataclass
class Case:
    name: str
    group: str
    run: Callable  # (case_dir, launcher) -> dict(outcome=..., detail=..., ...)
    note: str = ""
    launchers: tuple = ("deepspeed", "mpirun")


CASES: List[Case] = []


def case(name, group, note="", launchers=("deepspeed", "mpirun")):
    def deco(fn):
        CASES.append(Case(name, group, fn, note, launchers))
        return fn
    return deco


def write_config(d, name="ds.json", raw=None, **changes):
    path = os.path.join(d, name)
    if raw is not None:
        text = raw
    else:
        cfg = json.loads(json.dumps(TINY))
        for k, v in changes.items():
            if k == "lc":
                for kk, vv in v.items():
                    if isinstance(vv, dict) and isinstance(cfg["long_context"].get(kk), dict):
                        cfg["long_context"][kk].update(vv)
                    else:
                        cfg["long_context"][kk] = vv
            else:
                cfg[k] = v
        text = json.dumps(cfg)
    with open(path, "w") as f:
        f.write(text)
    return path


def train_argv(config, *args):
    return [TRAIN, "--deepspeed_config", config, "--no-progress", *args]


def run_error(d, launcher, argv, expect, env_extra=None, nvme=None):
    p = start(launcher, argv, env_extra)
    t0 = time.monotonic()
    rc, out = finish(p, TIMEOUT_S)
    wall = time.monotonic() - t0
    orphans = orphans_after(d)
    outcome, detail = classify_error(rc, out, expect)
    res = dict(rc=rc, wall_s=round(wall, 1))
    if nvme is not None:
        res["files_left"] = _listing(nvme)
        if res["files_left"] and outcome in ("clear", "wrong"):
            outcome, detail = "files-left", f"{res['files_left']}"
    if orphans:
        outcome, detail = "orphan", f"pids {orphans} still ran {ORPHAN_GRACE_S} s after the launcher ended"
    res.update(outcome=outcome, detail=detail, tail=out[-1500:] if outcome != "clear" else "")
    return res


def _umount_under(d):
    """Unmount the tmpfs mounts a case made under its directory."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for m in sorted((m for m in mounts if m.startswith(d + os.sep)), reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


def _listing(path):
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def error_case(name, expect, group="inputs", note="", setup: Optional[Callable] = None):
    """A bad input: ``setup(d)`` returns the train.py argv (after --deepspeed_config ... --no-progress is not
    added: the setup gives the whole argv)."""
    def fn(d, launcher):
        argv = setup(d)
        env_extra = None
        if isinstance(argv, tuple):
            argv, env_extra = argv
        return run_error(d, launcher, argv, expect, env_extra)
    CASES.append(Case(name, group, fn, note))


def _tokenizer(d, n=100):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = os.path.join(d, f"tok{n}")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(path)
    return path


def _file(d, name, data):
    path = os.path.join(d, name)
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return path


def _model_config(d, name="model.json", **changes):
    return _file(d, name, json.dumps(dict(TINY_MODEL, **changes)))


WORDS = " ".join(f"w{i % 50}" for i in range(400))

# ---- the new inputs (silent, raw, hang-like before) ------------------------------------------------------
error_case("long_context_null", "long_context: is null",
           setup=lambda d: train_argv(write_config(d, long_context=None), "--steps", "1", *FAST))
error_case("duplicate_json_key", "sequence_parallel_size: appears more than once",
           setup=lambda d: train_argv(write_config(d, raw=json.dumps(TINY)[:-1] + ', "sequence_parallel_size": 1}'),
                                      "--steps", "1", *FAST))
error_case("keep_on_device_gt_layers", "keep_on_device: 3 is more than the model's 2 decoder layers",
           setup=lambda d: train_argv(write_config(d, lc={"activation_checkpointing": {"keep_on_device": 3}}),
                                      "--steps", "1", *FAST))
error_case("seq_len_gt_max_position", "--seq-len: 128 is above the model's max_position_embeddings 64",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", "--seq-len", "128", "--eval-samples", "0",
                                      "--model-config", _model_config(d, max_position_embeddings=64)))
error_case("data_not_utf8", "is not UTF-8",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--data",
                                      _file(d, "latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
                                      "--tokenizer", _tokenizer(d)))
error_case("tokenizer_path_missing", "--tokenizer: local path '/no/such/tokenizer' does not exist",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--data",
                                      _file(d, "d.jsonl", json.dumps({"text": WORDS}) + "\n"),
                                      "--tokenizer", "/no/such/tokenizer"))
error_case("model_path_missing", "--model: local path '/no/such/model' does not exist",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--model", "/no/such/model"))
error_case("model_type_unknown", "has model_type 'no_such_arch', which this transformers does not know",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--model-config",
                                      _model_config(d, model_type="no_such_arch")))
error_case("model_type_missing", 'has no "model_type"',
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--model-config",
                                      _file(d, "m.json", json.dumps({k: v for k, v in TINY_MODEL.items()
                                                                    if k != "model_type"}))))
error_case("model_config_not_json", "is not valid JSON",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--model-config",
                                      _file(d, "m.json", '{"model_type": llama')))
error_case("config_path_is_dir", "is a directory",
           setup=lambda d: train_argv(d, "--steps", "1", *FAST))


def _ro_profile(d):
    mnt = os.path.join(d, "ro")
    os.makedirs(mnt)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", mnt], capture_output=True, text=True)
    if p.returncode != 0:  # not root: a plain read-only directory does it
        os.chmod(mnt, 0o500)
    return train_argv(write_config(d, lc={"profile": {"enabled": True, "output_dir": os.path.join(mnt, "prof")}}),
                      "--steps", "2", *FAST)


error_case("profile_output_dir_readonly", "long_context.profile.output_dir:", setup=_ro_profile,
           note="a read-only tmpfs (root writes through a 0500 directory)")
error_case("train_batch_size_inconsistent", "train_batch_size: 6 is not train_micro_batch_size_per_gpu",
           setup=lambda d: train_argv(write_config(d, train_batch_size=6), "--steps", "1", *FAST))
error_case("tiled_mlp_shards_100000", "tiled_mlp.shards: 100000 is more than the",
           setup=lambda d: train_argv(write_config(d, lc={"tiled_mlp": {"shards": 100000}}), "--steps", "1", *FAST))
error_case("tiled_loss_shards_100000", "tiled_loss.shards: 100000 is more than the",
           setup=lambda d: train_argv(write_config(d, lc={"tiled_loss": {"shards": 100000}}), "--steps", "1", *FAST))

# ---- the older ones (tests/test_reliability.py, tests/test_launch.py) --------------------------------------------
error_case("old_steps_negative", "--steps: must be >= 1, got -5",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "-5", "--seq-len", "64"))
error_case("old_seq_len_zero", "--seq-len: must be >= 1, got 0",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", "--seq-len", "0"))
error_case("old_seq_len_not_divisible", "--seq-len: 63 is not divisible by sequence_parallel_size=2",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", "--seq-len", "63"))
error_case("old_copy_odd_length", "--seq-len: the copy task needs an even length >= 4, got 7",
           setup=lambda d: train_argv(write_config(d, sequence_parallel_size=1, long_context={}), "--steps", "1",
                                      "--seq-len", "7"))
error_case("old_metrics_dir_missing", "--metrics: directory",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--metrics", os.path.join(d, "no", "m.jsonl")))
error_case("old_model_config_missing", "--model-config:",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--model-config", os.path.join(d, "no.json")))
error_case("old_resume_empty_dir", "holds no checkpoint (no 'latest' file)",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--resume", d))
error_case("old_top_level_typo", "long_contex: unknown top-level key, a near miss of 'long_context'",
           setup=lambda d: train_argv(write_config(d, long_contex={}), "--steps", "1", *FAST))
error_case("old_micro_batch_zero", "train_micro_batch_size_per_gpu: must be a positive integer, got 0",
           setup=lambda d: train_argv(write_config(d, train_micro_batch_size_per_gpu=0), "--steps", "1", *FAST))
error_case("old_jsonl_no_text", "line 2: has no string \"text\" field",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--data",
                                      _file(d, "n.jsonl", json.dumps({"text": WORDS}) + "\n"
                                            + json.dumps({"content": WORDS}) + "\n"), "--tokenizer", _tokenizer(d, 60)))
error_case("old_tokenizer_beyond_vocab", "has 100 tokens and produced id 99 from",
           setup=lambda d: train_argv(TINY_CPU, "--steps", "1", *FAST, "--data",
                                      _file(d, "b.jsonl", json.dumps({"text": " ".join(f"w{i}" for i in range(100))})
                                            + "\n"), "--tokenizer", _tokenizer(d, 100)))
error_case("old_world_not_multiple_of_sp", "sequence_parallel_size: 4 does not divide the world size 2",
           setup=lambda d: train_argv(write_config(d, sequence_parallel_size=4), "--steps", "1", *FAST))


# ---- non-finite loss, with NVMe offload: the error exit's cleanup -------------------------------------------------
def _aio():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def nvme_config(d, nvme, **changes):
    return write_config(d, lc={"activation_checkpointing": {"offload": "nvme", "nvme_path": nvme}}, **changes)


@case("lr_nan_nvme_error_exit", "nvme", note="\"lr\": NaN with NVMe offload: the error names the step; the error "
      "exit removes the activation files")
def _lr_nan(d, launcher):
    nvme = os.path.join(d, "nvme")
    os.makedirs(nvme)
    opt = dict(TINY["optimizer"], params=dict(TINY["optimizer"]["params"], lr=float("nan")))
    return run_error(d, launcher, train_argv(nvme_config(d, nvme, optimizer=opt), "--steps", "5", *FAST),
                     "the loss is nan (last finite loss", nvme=nvme)


@case("nvme_drive_too_small", "nvme", note="nvme_path on a 4 MiB tmpfs, 2 MiB per rank needed")
def _nvme_full(d, launcher):
    mnt = os.path.join(d, "tmpfs")
    os.makedirs(mnt)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], capture_output=True, text=True)
    if p.returncode:
        return dict(outcome="skipped", detail=f"cannot mount a tmpfs: {p.stderr.strip()}")
    try:
        res = run_error(d, launcher, train_argv(nvme_config(d, mnt), "--steps", "1", "--seq-len", "2048",
                                                "--eval-samples", "0"),
                        "is too full for this rank's layer inputs: 2097152 bytes (2.0 MiB) needed", nvme=mnt)
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    return res


# ---- signals, kills, orphans -------------------------------------------------------------------------------------
def _wait_training(p, metrics, nvme=None, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return False
        if os.path.exists(metrics) and open(metrics).read().count("\n") >= 2 and \
                (nvme is None or len(os.listdir(nvme)) >= 2):
            return True
        time.sleep(0.5)
    return False


def signal_case(name, target, sig, note="", cmd_for=None, launchers=("deepspeed", "mpirun")):
    """Train (NVMe offload), then send ``sig`` to ``target`` ('launcher', or a rank number); the job must end
    within seconds, every rank with its message (SIGTERM/SIGINT) or ended by its launcher (kill -9), no process
    left, no file left in nvme_path (after a kill -9: after the next run's start-up removal)."""
    def fn(d, launcher):
        nvme = os.path.join(d, "nvme")
        os.makedirs(nvme)
        metrics = os.path.join(d, "m.jsonl")
        argv = train_argv(nvme_config(d, nvme), "--steps", "100000", *FAST, "--metrics", metrics)
        cmd = cmd_for(launcher, argv) if cmd_for else None
        p = start(launcher, argv, cmd=cmd)
        if not _wait_training(p, metrics, nvme):
            rc, out = finish(p, 5)
            return dict(outcome="wrong", detail="did not start training", rc=rc, tail=out[-2000:])
        ranks = rank_pids(d)
        pid = p.pid if target == "launcher" else ranks.get(target)
        if pid is None:
            finish(p, 1)
            return dict(outcome="wrong", detail=f"rank {target} not found ({ranks})")
        t0 = time.monotonic()
        os.kill(pid, sig)
        # the job has ended when no process of the case is left (the launcher itself may exit first)
        while time.monotonic() - t0 < 60 and (p.poll() is None or case_pids(d)):
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        rc, out = finish(p, 5)
        orphans = orphans_after(d)
        left_now = _listing(nvme)
        res = dict(rc=rc, ranks_gone_s=round(gone_s, 2), files_left_at_exit=left_now)
        if sig == signal.SIGKILL:  # the killed rank ran no cleanup: the next run's start removes its directory
            from ds_longctx.memory.nvme import remove_stale_dirs

            res["removed_by_next_start"] = [os.path.basename(x) for x in remove_stale_dirs(nvme)]
        res["files_left"] = _listing(nvme)
        if gone_s >= 60:
            outcome, detail = "hang", f"processes still there {gone_s:.0f} s after the signal"
        elif orphans:
            outcome, detail = "orphan", f"pids {orphans}"
        elif res["files_left"]:
            outcome, detail = "files-left", str(res["files_left"])
        elif any(m in out for m in RAW_MARKS[1:]):
            outcome, detail = "raw", next(m for m in RAW_MARKS[1:] if m in out)
        elif gone_s > 15:
            outcome, detail = "hang", f"the job took {gone_s:.1f} s to end"
        else:
            said = [r for r in (0, 1) if re.search(rf"\[rank {r}\] ds_longctx: (received|the launcher process)", out)]
            outcome = "clear"
            detail = f"every process gone in {gone_s:.2f} s; ranks that printed why: {said}"
            if sig in (signal.SIGTERM, signal.SIGINT) and target != "launcher" and target not in said:
                outcome, detail = "wrong", f"rank {target} did not say it received {signal.Signals(sig).name}"
        res.update(outcome=outcome, detail=detail, tail=out[-2000:] if outcome != "clear" else "")
        return res
    CASES.append(Case(name, "signals", fn, note, launchers))


signal_case("sigterm_to_launcher_alone", "launcher", signal.SIGTERM,
            note="SIGTERM to the deepspeed runner / mpirun only (a scheduler or a wrapper's Ctrl-C)")
signal_case("sigint_to_launcher_alone", "launcher", signal.SIGINT)
signal_case("sigterm_to_rank1", 1, signal.SIGTERM)
signal_case("sigint_to_rank0", 0, signal.SIGINT)
signal_case("kill9_rank1", 1, signal.SIGKILL, note="the surviving rank removes its files; the next start the "
            "killed one's")
signal_case("kill9_rank0", 0, signal.SIGKILL)


def _script_cmd(launcher, argv):
    script = "single_node.sh" if launcher == "deepspeed" else "mpi.sh"
    return ["bash", os.path.join(ROOT, "launch", script), *argv[1:]]  # the scripts add train.py themselves


for _sig in (signal.SIGTERM, signal.SIGINT):
    signal_case(f"launch_script_{_sig.name.lower()}", "launcher", _sig, cmd_for=_script_cmd,
                note="launch/single_node.sh (deepspeed) or launch/mpi.sh (mpirun): the signal to the script's pid "
                "(exec: the launcher's)")


# ---- checkpoints ---------------------------------------------------------------------------------------------------
CK_BASE = os.path.join(BASE, "_ck_base")


_BASES_MADE = set()


def base_checkpoint(launcher):
    """step2 and step3 (a resumed run's save), saved once per launcher and per rerun (never one left by an earlier
    rerun: its record may come from other code) and copied by each case."""
    d = f"{CK_BASE}_{launcher}"
    if launcher in _BASES_MADE:
        return os.path.join(d, "ck")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    ck = os.path.join(d, "ck")
    for args in (("--steps", "2"), ("--steps", "3", "--resume", ck)):
        rc, out = finish(start(launcher, train_argv(TINY_CPU, *FAST, "--save", ck, *args)), TIMEOUT_S)
        if rc != 0:
            raise RuntimeError(f"the base checkpoint's save failed ({rc}): {out[-3000:]}")
    _BASES_MADE.add(launcher)
    return ck


def _copy_ck(d, launcher, tags=("step2", "step3")):
    src = base_checkpoint(launcher)
    ck = os.path.join(d, "ck")
    os.makedirs(ck)
    for t in tags:
        shutil.copytree(os.path.join(src, t), os.path.join(ck, t))
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write(tags[-1])
    return ck


def run_resume(d, launcher, ck, expect_step, expect_note=None, env_extra=None):
    """--resume ck to step 5: clear when it resumes step ``expect_step`` (the first metrics record is
    expect_step + 1) and, when given, warns with ``expect_note`` (the file and the problem)."""
    metrics = os.path.join(d, "resumed.jsonl")
    p = start(launcher, train_argv(TINY_CPU, *FAST, "--steps", "5", "--resume", ck, "--metrics", metrics), env_extra)
    rc, out = finish(p, TIMEOUT_S)
    orphans = orphans_after(d)
    first = None
    if os.path.exists(metrics):
        lines = open(metrics).read().splitlines()
        first = json.loads(lines[0])["step"] if lines else None
    res = dict(rc=rc, first_step=first)
    if rc is None:
        outcome, detail = "hang", "resume did not end"
    elif orphans:
        outcome, detail = "orphan", f"pids {orphans}"
    elif any(m in out for m in RAW_MARKS):
        outcome, detail = "raw", next(m for m in RAW_MARKS if m in out)
    elif rc != 0:
        outcome, detail = "wrong", f"resume failed: {(error_lines(out) or out.splitlines()[-1:])[0][:300]}"
    elif first != expect_step + 1:
        outcome, detail = "silent", f"resumed at step {first}, expected {expect_step + 1}"
    elif expect_note and expect_note not in out:
        outcome, detail = "silent", f"no warning naming {expect_note!r}"
    else:
        warn = [ln for ln in out.splitlines() if "--resume:" in ln]
        outcome, detail = "clear", (warn[0][:400] if warn else f"resumed step {expect_step}, no warning needed")
    res.update(outcome=outcome, detail=detail, tail=out[-2000:] if outcome != "clear" else "")
    return res


def ck_case(name, damage, expect_step, expect_note, note=""):
    def fn(d, launcher):
        ck = _copy_ck(d, launcher)
        expect = damage(ck)
        return run_resume(d, launcher, ck, expect_step, expect_note.format(ck=ck, **(expect or {})))
    CASES.append(Case(name, "checkpoints", fn, note))


def _truncate(path, n=100):
    with open(path, "r+b") as f:
        f.truncate(n)


def _model_file(ck, tag="step3"):
    return sorted(glob.glob(os.path.join(ck, tag, "*model_states.pt")))[0]


def _optim_file(ck, tag="step3"):
    return sorted(glob.glob(os.path.join(ck, tag, "*optim_states.pt")))[0]


ck_case("ck_latest_names_missing_tag", lambda ck: _file(ck, "latest", "step9") and None, 3,
        "tag directory '{ck}/step9' does not exist")
ck_case("ck_truncated_model_file", lambda ck: (_truncate(_model_file(ck)), {"f": _model_file(ck)})[1], 2,
        "'{f}' has 100 bytes")
ck_case("ck_random_bytes_optim_file",
        lambda ck: (_file(ck, _optim_file(ck), os.urandom(os.path.getsize(_optim_file(ck)))),
                    {"f": _optim_file(ck)})[1], 2, "'{f}' is not a readable torch checkpoint file")
ck_case("ck_corrupt_layout_json", lambda ck: _file(ck, os.path.join(ck, "step3", "ds_longctx_layout.json"),
                                                   "{not json") and None, 2,
        "'{ck}/step3/ds_longctx_layout.json' is not a valid layout record")
ck_case("ck_layout_missing_latest_moved",
        lambda ck: os.remove(os.path.join(ck, "step3", "ds_longctx_layout.json")), 2,
        "'{ck}/step3/ds_longctx_layout.json' is missing",
        note="the issue's kill between 'latest' and the record (the old order)")


def ck_error_case(name, setup_args, expect, tags=("step2", "step3"), damage=None):
    def fn(d, launcher):
        ck = _copy_ck(d, launcher, tags)
        if damage:
            damage(ck)
        return run_error(d, launcher, train_argv(TINY_CPU, *FAST, "--steps", "5", "--resume", ck,
                                                 *setup_args(d)), expect)
    CASES.append(Case(name, "checkpoints", fn))


ck_error_case("ck_other_model_3_layers", lambda d: ("--model-config", _model_config(d, num_hidden_layers=3)),
              "holds a different model: layers 2 in the checkpoint vs 3 now")
ck_error_case("ck_other_model_same_shapes", lambda d: ("--model-config", _model_config(
    d, num_attention_heads=2, num_key_value_heads=2, head_dim=32)),
    "holds a different model: heads 4 in the checkpoint vs 2 now")
ck_error_case("ck_only_tag_truncated", lambda d: (), "and no other complete checkpoint is there", tags=("step2",),
              damage=lambda ck: _truncate(_model_file(ck, "step2")))
ck_error_case("ck_other_seq_len", lambda d: ("--seq-len", "128"),
              "cannot continue this run: seq_len 64 in the checkpoint vs 128 now")
ck_error_case("ck_other_zero_stage", lambda d: (
    "--deepspeed_config", write_config(d, zero_optimization={"stage": 2})),
    "cannot continue this run: ZeRO stage 3 in the checkpoint vs 2 now")


# ---- kill -9 during the save, at each point -----------------------------------------------------------------------
def kill_save_case(rank, point, launchers=("deepspeed", "mpirun")):
    """From a complete step2 (latest), a run to step 3 saves step3 and SIGKILLs ``rank`` at ``point``
    (train.py's test hook); then --resume must load step3 if the save completed (its 'latest' moved), else
    step2, naming the file when 'latest' names the incomplete tag."""
    def fn(d, launcher):
        ck = _copy_ck(d, launcher, ("step2",))
        p = start(launcher, train_argv(TINY_CPU, *FAST, "--steps", "3", "--resume", ck, "--save", ck),
                  {"DS_LONGCTX_TEST_KILL_AT": f"{rank}:{point}"})
        rc, out = finish(p, TIMEOUT_S)
        orphans = orphans_after(d)
        if rc is None or orphans:
            return dict(outcome="hang" if rc is None else "orphan", detail="the killed save", rc=rc,
                        tail=out[-2000:])
        if rc == 0:
            return dict(outcome="wrong", detail=f"the kill point {rank}:{point} was never reached", rc=rc)
        if f"[rank {rank}] ds_longctx test hook: SIGKILL at {point}" not in out:
            return dict(outcome="wrong", detail="the save did not end by the SIGKILL of the hook", rc=rc,
                        tail=out[-2500:])
        if any(m in out for m in RAW_MARKS):
            return dict(outcome="raw", detail="the surviving rank: " + next(m for m in RAW_MARKS if m in out),
                        rc=rc, tail=out[-2500:])
        latest = open(os.path.join(ck, "latest")).read()
        complete = latest == "step3"
        res = run_resume(d, launcher, ck, 3 if complete else 2)
        res.update(killed_rc=rc, latest_after_kill=latest,
                   step3_files=sorted(os.listdir(os.path.join(ck, "step3"))) if os.path.isdir(
                       os.path.join(ck, "step3")) else None)
        return res
    CASES.append(Case(f"kill_save_r{rank}_{point}", "kill_save", fn,
                      f"kill -9 of rank {rank} at '{point}' of train.py's save", launchers))


# DeepSpeed (ZeRO-3) writes 2 files per rank: its model states and its optimizer partition
# (every point under the deepspeed launcher; under mpirun a point of each kind, to keep the rerun's time down)
MPI_KILL_POINTS = {(0, "after_file1"), (0, "after_record"), (1, "after_file2")}
for _point in ("before_file1", "after_file1", "before_file2", "after_file2", "after_files", "before_record",
               "after_record", "after_rename", "after_latest"):
    kill_save_case(0, _point, ("deepspeed", "mpirun") if (0, _point) in MPI_KILL_POINTS else ("deepspeed",))
for _point in ("before_file1", "after_file1", "before_file2", "after_file2", "after_files", "done"):
    kill_save_case(1, _point, ("deepspeed", "mpirun") if (1, _point) in MPI_KILL_POINTS else ("deepspeed",))


# ---- issue 29: a run of days (preemption, a full disk during a save, one run per save directory) -----------------

def _stop_verdict(rc, out, wall, orphans, metrics, ck, wrong, said) -> dict:
    """A preemption case's outcome: hang / orphan / raw trace / wrong (``wrong(rc, out)``, or the last trained step not
    saved as ``latest``, or no "stopped after step N" line) / clear; ``said``: the clear line's words after the step."""
    last = json.loads(open(metrics).read().splitlines()[-1])["step"]
    latest = open(os.path.join(ck, "latest")).read().strip() if os.path.exists(os.path.join(ck, "latest")) else None
    res = dict(rc=rc, exit_s=wall, last_step=last, latest=latest)
    if rc is None or orphans:
        res.update(outcome="hang" if rc is None else "orphan", detail=f"orphans {orphans}", tail=out[-2000:])
    elif any(m in out for m in RAW_MARKS):
        res.update(outcome="raw", detail=next(m for m in RAW_MARKS if m in out), tail=out[-2000:])
    elif wrong(rc, out) or latest != f"step{last}" or f"stopped after step {last} on" not in out:
        res.update(outcome="wrong", detail=f"exit {rc}, latest {latest}, last step {last}", tail=out[-2000:])
    else:
        res.update(outcome="clear", detail=f"saved step {last} {said} {wall} s after the signal".replace(" ,", ","))
    return res

def _preempt_case(name, sig, ranks, note):
    """Training with --save, ``sig`` sent to ``ranks`` ('all': as SLURM's --signal does): every rank finishes the
    same step, saves it, exits 0; 'latest' names that step, nothing left running."""
    def fn(d, launcher):
        ck, metrics = os.path.join(d, "ck"), os.path.join(d, "m.jsonl")
        p = start(launcher, train_argv(TINY_CPU, "--steps", "100000", *FAST, "--save", ck, "--metrics", metrics))
        if not _wait_training(p, metrics):
            rc, out = finish(p, 5)
            return dict(outcome="wrong", detail="training did not start", rc=rc, tail=out[-2000:])
        pids = rank_pids(d)
        for r in (sorted(pids) if ranks == "all" else ranks):
            os.kill(pids[r], sig)
        t0 = time.monotonic()
        rc, out = finish(p, TIMEOUT_S)
        wall = round(time.monotonic() - t0, 1)
        return _stop_verdict(rc, out, wall, orphans_after(d), metrics, ck, lambda rc, out: rc != 0,
                             "and exited 0")
    CASES.append(Case(name, "long_runs", fn, note))


_preempt_case("preempt_usr1_every_rank", signal.SIGUSR1, "all", "SLURM's --signal=USR1@T reaches every rank")
_preempt_case("preempt_sigterm_rank1", signal.SIGTERM, [1], "a preemption SIGTERM reaching one rank only")


@case("disk_full_during_save", "long_runs", note="a 4 MiB tmpfs; rank 1 fills it while saving step 4 "
      "(DS_LONGCTX_TEST_FILL_AT=1:before_file2@4: a real ENOSPC); then --resume")
def _disk_full(d, launcher):
    mnt = os.path.join(d, "tmpfs")
    os.makedirs(mnt)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], capture_output=True, text=True)
    if m.returncode != 0:
        return dict(outcome="skipped", detail=f"cannot mount a tmpfs here: {m.stderr.strip()[:200]}")
    ck = os.path.join(mnt, "ck")
    res = run_error(d, launcher, train_argv(TINY_CPU, "--steps", "6", *FAST, "--save", ck, "--save-every", "2"),
                    "saving step 4 to", env_extra={"DS_LONGCTX_TEST_FILL_AT": "1:before_file2@4"})
    latest = open(os.path.join(ck, "latest")).read().strip()
    left = [e for e in os.listdir(ck) if e.startswith(".tmp-")]
    if res["outcome"] == "clear" and (latest != "step2" or left):
        res.update(outcome="wrong", detail=f"latest {latest}, partial tags {left}")
    if res["outcome"] == "clear":
        os.remove(os.path.join(ck, ".ds_longctx-test-filler"))
        resumed = run_resume(d, launcher, ck, 2)
        if resumed["outcome"] != "clear":
            return dict(resumed, detail="the resume after the full disk: " + resumed["detail"])
    return res


@case("second_run_same_save_dir", "long_runs", note="a second job on the --save directory of a running one")
def _second_run(d, launcher):
    ck, metrics = os.path.join(d, "ck"), os.path.join(d, "m.jsonl")
    first = start(launcher, train_argv(TINY_CPU, "--steps", "100000", *FAST, "--save", ck, "--metrics", metrics))
    try:
        if not _wait_training(first, metrics):
            return dict(outcome="wrong", detail="the first run did not start", tail=finish(first, 5)[1][-2000:])
        res = run_error(os.path.join(d, "second"), launcher,
                        train_argv(TINY_CPU, "--steps", "3", *FAST, "--save", ck), "is in use by another run (host ")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        finish(first, 30)
    orphans_after(d)
    return res


# ---- issue 30: ranks that disagree (MPMD: one command per rank, as two nodes with different files), a frozen
# rank, host memory over the node's budget ------------------------------------------------------------------------
def mpmd_cmd(argvs):
    """mpirun with one app context per rank: ``argvs[r]`` is rank r's python argv."""
    cmd = mpirun_command(1, argvs[0])
    for argv in argvs[1:]:
        cmd += [":", "-np", "1", sys.executable, *argv]
    return cmd


def disagree_case(name, expect, per_rank, note=""):
    """``per_rank(d, r)`` -> rank r's train.py argv; rank 0 and rank 1 differ in one thing."""
    def fn(d, launcher):
        p = start(launcher, None, cmd=mpmd_cmd([per_rank(d, r) for r in (0, 1)]))
        t0 = time.monotonic()
        rc, out = finish(p, TIMEOUT_S)
        res = dict(rc=rc, wall_s=round(time.monotonic() - t0, 1))
        orphans = orphans_after(d)
        outcome, detail = classify_error(rc, out, expect)
        if orphans:
            outcome, detail = "orphan", f"pids {orphans}"
        res.update(outcome=outcome, detail=detail, tail=out[-1500:] if outcome != "clear" else "")
        return res
    CASES.append(Case(name, "fail_fast", fn, note, ("mpirun",)))


def _rank_config(d, r, **changes):
    return write_config(d, name=f"ds{r}.json", **(changes if r == 1 else {}))


disagree_case("disagree_long_context_key", "long_context.tiled_mlp.enabled: differs between the ranks of this job: "
              "true on rank 0 (host ", lambda d, r: train_argv(_rank_config(d, r, lc={"tiled_mlp": {"enabled": False}}),
                                                              "--steps", "1", *FAST),
              note="tiled_mlp on rank 0, off on rank 1 (was: silence until DeepSpeed's timeout)")
disagree_case("disagree_deepspeed_key", "zero_optimization.stage: differs between the ranks of this job: 3 on rank 0",
              lambda d, r: train_argv(_rank_config(d, r, zero_optimization={"stage": 2}), "--steps", "1", *FAST))
disagree_case("disagree_learning_rate", "optimizer.params.lr: differs between the ranks of this job: 0.003 on rank 0",
              lambda d, r: train_argv(_rank_config(d, r, optimizer=dict(TINY["optimizer"], params=dict(
                  TINY["optimizer"]["params"], lr=0.001))), "--steps", "1", *FAST),
              note="was: trained silently, the metrics naming rank 0's lr")
disagree_case("disagree_sp_degree", "sequence_parallel_size: differs between the ranks of this job: 2 on rank 0",
              lambda d, r: train_argv(_rank_config(d, r, sequence_parallel_size=1), "--steps", "1", *FAST))
disagree_case("disagree_heads_per_chunk", "long_context.attention.heads_per_chunk: differs between the ranks",
              lambda d, r: train_argv(_rank_config(d, r, lc={"attention": {"heads_per_chunk": 2}}), "--steps", "1",
                                      *FAST), note="was: gloo::EnforceNotMet native abort")
disagree_case("disagree_cli_seq_len", "--seq-len: differs between the ranks of this job: 64 on rank 0",
              lambda d, r: train_argv(TINY_CPU, "--steps", "1", "--eval-samples", "0", "--seq-len", str(64 * (r + 1))))


def _data_per_rank(d, r):
    tok = os.path.join(d, "tok100")
    if not os.path.exists(tok):
        _tokenizer(d)
    path = os.path.join(d, f"node{r}", "train.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _file(d, path, json.dumps({"text": " ".join(f"w{(i * (r + 1)) % 50}" for i in range(400))}) + "\n")
    return train_argv(TINY_CPU, "--steps", "1", *FAST, "--data", path, "--tokenizer", tok)


disagree_case("disagree_data_file", "data (the data this rank reads): differs between the ranks of this job: ",
              _data_per_rank, note="the same file name on two nodes, other content (was: trained silently)")


def frozen_case(name, target, timeout_s=10, launchers=("deepspeed", "mpirun")):
    """kill -STOP rank ``target`` after step 2 with long_context.watchdog.timeout_s ``timeout_s``: clear when every
    process of the job is gone within the timeout plus 10 s and the live rank printed which rank went silent."""
    def fn(d, launcher):
        metrics = os.path.join(d, "m.jsonl")
        p = start(launcher, train_argv(write_config(d, lc={"watchdog": {"timeout_s": timeout_s}}), "--steps",
                                       "100000", *FAST, "--metrics", metrics))
        if not _wait_training(p, metrics):
            rc, out = finish(p, 5)
            return dict(outcome="wrong", detail="did not start training", rc=rc, tail=out[-2000:])
        ranks = rank_pids(d)
        if target not in ranks:
            finish(p, 1)
            return dict(outcome="wrong", detail=f"rank {target} not found ({ranks})")
        t0 = time.monotonic()
        os.kill(ranks[target], signal.SIGSTOP)
        while time.monotonic() - t0 < 120 and (p.poll() is None or case_pids(d)):
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        rc, out = finish(p, 5)
        orphans = orphans_after(d)
        live = [r for r in (0, 1) if r != target]
        said = [r for r in live if re.search(rf"\[rank {r}\] ds_longctx: error: long_context\.watchdog\.timeout_s: "
                                                 rf"(rank {target} \(host|the job's store)", out)]
        res = dict(rc=rc, gone_s=round(gone_s, 1), timeout_s=timeout_s)
        if orphans:
            outcome, detail = "orphan", f"pids {orphans}"
        elif gone_s >= 120:
            outcome, detail = "hang", f"processes still there {gone_s:.0f} s after the freeze"
        elif any(m in out for m in RAW_MARKS):
            outcome, detail = "raw", next(m for m in RAW_MARKS if m in out)
        elif said != live:
            outcome, detail = "wrong", f"live ranks that named the silent one: {said} of {live}"
        elif gone_s > timeout_s + 10:
            outcome, detail = "hang", f"the job took {gone_s:.1f} s to end (timeout_s {timeout_s})"
        else:
            line = next(ln for ln in out.splitlines() if "long_context.watchdog.timeout_s:" in ln)
            outcome, detail = "clear", f"every process gone {gone_s:.1f} s after the freeze: {line[:260]}"
        res.update(outcome=outcome, detail=detail, tail=out[-2000:] if outcome != "clear" else "")
        return res
    CASES.append(Case(name, "fail_fast", fn, f"kill -STOP rank {target} after step 2, timeout_s {timeout_s}",
                      launchers))


frozen_case("frozen_rank1", 1)
frozen_case("frozen_rank0_store_host", 0)

error_case("host_memory_arena_over_budget", "this node's ranks need 1.00 MiB of host memory at sequence_length 512 "
           "(2 local rank(s) x 512.00 KiB: offloaded activations 512.00 KiB), over the node's 768.00 KiB",
           group="fail_fast", note="DS_LONGCTX_HOST_MEM=768KiB; the arena: 2 ranks x 2 layers x 4 x 256 tokens x 64 "
           "hidden x 4 bytes (was: allocated until the OOM killer)",
           setup=lambda d: (train_argv(TINY_CPU, "--steps", "1", "--seq-len", "512", "--eval-samples", "0"),
                            {"DS_LONGCTX_HOST_MEM": "768KiB"}))


# ---- issue 38: preemption under every launcher, and the faults that lost steps or trained on the wrong tokens -------
PREEMPTIBLE = os.path.join(ROOT, "ds_longctx", "dist", "preemptible.py")


def _wrapped_cmd(launcher, argv, port):
    """What the project ships: ds-longctx launch (the deepspeed runner through ds_longctx/dist/preemptible.py, what
    launch/single_node.sh runs) or launch/mpi.sh (mpirun through the same wrapper)."""
    if launcher == "deepspeed":
        return [sys.executable, PREEMPTIBLE, "--num_gpus", "2", "--master_port", str(port), *argv]
    return ["bash", os.path.join(ROOT, "launch", "mpi.sh"), *argv[1:]]  # the script adds train.py itself


def preempt38_case(name, sig, target, wrapped=True, launchers=("deepspeed", "mpirun"), note=""):
    """Training with --save through a launcher; ``sig`` to the launcher's pid or its process group once two steps
    ran: clear when the stopped step is saved, `latest` names it, no process is left, and every process exits 0
    (through the project's wrapper; the plain deepspeed runner dies of the signal itself: its code is recorded)."""
    def fn(d, launcher):
        ck, metrics = os.path.join(d, "ck"), os.path.join(d, "m.jsonl")
        argv = train_argv(TINY_CPU, "--steps", "100000", *FAST, "--save", ck, "--metrics", metrics)
        port = free_port()
        cmd = _wrapped_cmd(launcher, argv, port) if wrapped else launcher_cmd(launcher, argv, port)
        p = start(launcher, argv, cmd=cmd, env_extra={"NP": "2"})
        if not _wait_training(p, metrics):
            rc, out = finish(p, 5)
            return dict(outcome="wrong", detail="training did not start", rc=rc, tail=out[-2000:])
        t0 = time.monotonic()
        (os.killpg if target == "group" else os.kill)(p.pid, sig)
        rc, out = finish(p, TIMEOUT_S)
        while time.monotonic() - t0 < 60 and case_pids(d):  # the ranks of a runner that died of the signal
            time.sleep(0.1)
        wall = round(time.monotonic() - t0, 1)
        return _stop_verdict(rc, out, wall, orphans_after(d), metrics, ck,
                             lambda rc, out: (wrapped and rc != 0) or "ending this rank" in out, f", launcher exit {rc},")
    CASES.append(Case(name, "issue38", fn, note, launchers))


preempt38_case("i38_wrapped_sigterm_group", signal.SIGTERM, "group",
               note="item 1: SIGTERM to the process group of ds-longctx launch (deepspeed) / launch/mpi.sh (mpirun)")
preempt38_case("i38_wrapped_sigint_pid", signal.SIGINT, "pid", note="item 1: Ctrl-C once, to the wrapper's pid")
preempt38_case("i38_wrapped_usr1_group", signal.SIGUSR1, "group", launchers=("mpirun",),
               note="item 1: SIGUSR1 to launch/mpi.sh's group (mpirun forwards it)")
preempt38_case("i38_plain_runner_usr1_group", signal.SIGUSR1, "group", wrapped=False, launchers=("deepspeed",),
               note="item 1: the plain deepspeed runner, SIGUSR1 to its group (SLURM --signal, most schedulers): the "
               "runner and launch.py die of it (rc -10), the ranks save (was: latest = an older --save-every tag)")


def _tokenizer_rank(d, r):
    """Rank r's copy of 'the same' tokenizer path (another node's mount): rank 1's ids reversed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(d, f"node{r}", "tok")
    if not os.path.exists(path):
        n = 60
        tok = Tokenizer(models.WordLevel({f"w{i}": (n - 1 - i if r else i) for i in range(n)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(path)
    data = _file(d, "data.jsonl", json.dumps({"text": " ".join(f"w{2 + i % 50}" for i in range(400))}) + "\n")
    return train_argv(TINY_CPU, "--steps", "1", *FAST, "--data", data, "--tokenizer", path)


@case("i38_tokenizer_content_differs", "issue38", launchers=("mpirun",),
      note="item 2: the same --tokenizer path (relative: each rank in its own node directory, as two nodes' "
      "mounts), other content on rank 1 (was: 3 steps on different token ids)")
def _tokenizer_differs(d, launcher):
    argvs = [_tokenizer_rank(d, r) for r in (0, 1)]
    for argv in argvs:
        argv[argv.index("--tokenizer") + 1] = "tok"
    cmd = mpirun_command(1, ["dummy"])[:-2]  # mpirun and its global options, without the program
    del cmd[cmd.index("-np"):cmd.index("-np") + 2]
    for r, argv in enumerate(argvs):
        cmd += ([":"] if r else []) + ["-np", "1", "-wdir", os.path.join(d, f"node{r}"), sys.executable, *argv]
    p = start(launcher, None, cmd=cmd)
    rc, out = finish(p, TIMEOUT_S)
    orphans = orphans_after(d)
    outcome, detail = classify_error(rc, out, "tokenizer (the sha256 of its vocabulary, merges and special tokens): "
                                     "differs between the ranks of this job")
    return dict(rc=rc, outcome="orphan" if orphans else outcome, detail=f"pids {orphans}" if orphans else detail,
                tail=out[-1500:] if outcome != "clear" else "")


@case("i38_metrics_disk_full", "issue38", launchers=("deepspeed",),
      note="item 3: --metrics on a 64 KiB tmpfs filled to its last page (was: raw OSError at metrics.py:125, the "
      "step's save lost, a truncated line)")
def _metrics_full(d, launcher):
    mnt = os.path.join(d, "tmpfs")
    os.makedirs(mnt)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", mnt], capture_output=True, text=True)
    if m.returncode != 0:
        return dict(outcome="skipped", detail=f"cannot mount a tmpfs here: {m.stderr.strip()[:200]}")
    st = os.statvfs(mnt)
    with open(os.path.join(mnt, "filler"), "wb") as f:
        f.write(b"\0" * ((st.f_bavail - 1) * st.f_frsize))
    metrics, ck = os.path.join(mnt, "m.jsonl"), os.path.join(d, "ck")
    p = start(launcher, train_argv(TINY_CPU, "--steps", "60", *FAST, "--save", ck, "--metrics", metrics))
    rc, out = finish(p, TIMEOUT_S)
    orphans = orphans_after(d)
    outcome, detail = classify_error(rc, out, "could not write step", ranks=(0,))  # rank 0 writes the metrics
    res = dict(rc=rc, outcome="orphan" if orphans else outcome, detail=f"pids {orphans}" if orphans else detail,
               tail=out[-1500:] if outcome != "clear" else "")
    if res["outcome"] == "clear":
        step = int(re.search(r"could not write step (\d+)", res["detail"]).group(1))
        lines = open(metrics).read().splitlines()
        whole = all(json.loads(x) for x in lines)
        latest = open(os.path.join(ck, "latest")).read().strip()
        if latest != f"step{step}" or not whole:
            res.update(outcome="wrong", detail=f"latest {latest} (step {step} expected), whole lines {whole}")
    return res


@case("i38_metrics_resumed_once_per_step", "issue38", launchers=("deepspeed",),
      note="item 4: kill -9 of the job after a step past its last save, then --resume auto (was: the killed run's "
      "steps past the save stayed, then the resumed run's: a step twice)")
def _metrics_resumed(d, launcher):
    ck, metrics = os.path.join(d, "ck"), os.path.join(d, "m.jsonl")
    p = start(launcher, train_argv(TINY_CPU, "--steps", "100000", *FAST, "--save", ck, "--save-every", "3",
                                   "--metrics", metrics))
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and p.poll() is None:  # a step past the save of step 3
        if os.path.exists(os.path.join(ck, "latest")) and open(metrics).read().count("\n") >= 4:
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    finish(p, 30)
    orphans_after(d)
    killed_at = open(metrics).read().count("\n")
    saved = open(os.path.join(ck, "latest")).read().strip()
    rc, out = finish(start(launcher, train_argv(TINY_CPU, "--steps", str(killed_at + 2), *FAST, "--save", ck,
                                                "--resume", "auto", "--metrics", metrics)), TIMEOUT_S)
    steps = [json.loads(x)["step"] for x in open(metrics).read().splitlines()]
    res = dict(rc=rc, killed_after_step=killed_at, resumed_from=saved, steps=steps)
    if rc != 0 or any(m in out for m in RAW_MARKS):
        res.update(outcome="wrong" if rc else "raw", detail=f"resume exit {rc}", tail=out[-2000:])
    elif steps != list(range(1, killed_at + 3)):
        res.update(outcome="wrong", detail=f"metrics steps {steps}")
    else:
        res.update(outcome="clear", detail=f"killed after step {killed_at} ({saved} saved); resumed: steps 1.."
                   f"{killed_at + 2}, each once")
    return res


def _no_text(d):
    tok = _tokenizer(d, n=60)  # below the tiny model's vocabulary of 64
    data = _file(d, "empty.jsonl", '{"text": ""}\n' * 20)
    return train_argv(TINY_CPU, "--steps", "2", *FAST, "--data", data, "--tokenizer", tok), None


error_case("i38_data_without_text", "has no text tokens: each of its 20 document(s) is empty", group="issue38",
           note="item 5: every line {\"text\": \"\"} (was: one EOS-only sample trained 20 times)", setup=_no_text)
error_case("i38_metrics_under_a_file", "is a file, not a directory", group="issue38",
           note="item 8: --metrics under a regular file (was: 'directory does not exist. Fix: mkdir -p')",
           setup=lambda d: (train_argv(TINY_CPU, "--steps", "2", *FAST, "--metrics",
                                       os.path.join(_file(d, "a_file", "x"), "sub", "m.jsonl")), None))
error_case("i38_host_check_counts_the_device_side", "device side (host RAM: no CUDA device)", group="issue38",
           note="item 9: DS_LONGCTX_HOST_MEM between the offload arena and arena + model states on a CPU machine "
           "(was: admitted)",
           setup=lambda d: (train_argv(TINY_CPU, "--steps", "1", "--seq-len", "512", "--eval-samples", "0"),
                            {"DS_LONGCTX_HOST_MEM": "1100KiB"}))
for _c in CASES[-3:]:
    _c.launchers = ("deepspeed",)


@case("i38_convert_killed", "issue38", launchers=("deepspeed",),
      note="item 7: ds-longctx convert killed -9 while its pool works (was: 2-4 workers left with ppid 1, a partial "
      ".tmp-...universal- directory until the next --save run)")
def _convert_killed(d, launcher):
    ck = os.path.join(d, "ck")
    rc, out = finish(start(launcher, train_argv(TINY_CPU, "--steps", "2", *FAST, "--save", ck)), TIMEOUT_S)
    if rc != 0:
        return dict(outcome="wrong", detail=f"the checkpoint run exited {rc}", tail=out[-2000:])
    cmd = [sys.executable, "-c", "import sys; from ds_longctx.cli import main; sys.exit(main())", "convert", ck,
           "--workers", "4"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    workers, deadline = [], time.monotonic() + 120
    while len(workers) < 2 and p.poll() is None and time.monotonic() < deadline:
        workers = [pid for pid in case_pids(d) if pid != p.pid and _ppid(pid) == p.pid]
        time.sleep(0.01)
    if not workers:
        p.wait()
        return dict(outcome="skipped", detail="the conversion ended before its workers could be seen")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(5)
    alive = [w for w in workers if os.path.exists(f"/proc/{w}") and _ppid(w) is not None]
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    partial = [e for e in os.listdir(ck) if e.startswith(".tmp-")]
    res = dict(workers=len(workers), alive_after_5s=alive, partial_after_next=partial, rc_next=again.returncode)
    if alive or partial or again.returncode != 0:
        res.update(outcome="orphan" if alive else "wrong", detail=f"workers alive {alive}, partial {partial}, next "
                   f"conversion exit {again.returncode}", tail=(again.stdout + again.stderr)[-2000:])
    else:
        res.update(outcome="clear", detail=f"{len(workers)} workers gone with it; the next conversion completed and "
                   "left no partial directory")
    return res


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]) if fields[0] != "Z" else None
    except OSError:
        return None


@case("i38_readme_trainer_recipe", "issue38", launchers=("deepspeed",),
      note="item 6: README's HF Trainer recipe as written, twice in one process, under the deepspeed launcher on CPU "
      "(was: AssertionError parallel_state_sp.py:28; the second Trainer: 'already initialized')")
def _readme_recipe(d, launcher):
    p = start(launcher, None, cmd=[sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                                   "--master_port", str(free_port()), os.path.join(ROOT, "tests", "readme_recipe.py"),
                                   d])
    rc, out = finish(p, TIMEOUT_S * 2)
    res = dict(rc=rc)
    if rc != 0 or "readme_losses" not in out:
        bad = next((m for m in RAW_MARKS if m in out), None)
        res.update(outcome="raw" if bad else "wrong", detail=f"exit {rc}" + (f", {bad}" if bad else ""),
                   tail=out[-2000:])
    else:
        res.update(outcome="clear", detail="both Trainers trained: " + out.split("readme_losses", 1)[1][:120])
    return res


# ------------------------------------------------------------------ main ------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", choices=["deepspeed", "mpirun", "both"], default="both")
    ap.add_argument("--group", help="comma-separated groups: " + ",".join(sorted({c.group for c in CASES})))
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fault_rerun.json"))
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if (not args.group or c.group in args.group.split(","))
             and (not args.only or c.name in args.only.split(","))]
    if args.list:
        for c in cases:
            print(f"{c.group:12s} {c.name}")
        return 0
    launchers = ["deepspeed", "mpirun"] if args.launcher == "both" else [args.launcher]
    os.makedirs(BASE, exist_ok=True)
    results = {}
    if os.path.exists(args.out):  # a partial rerun updates its cases in the record
        results = json.load(open(args.out)).get("cases", {})
    t_all = time.monotonic()
    for c in cases:
        for launcher in launchers:
            if launcher not in c.launchers:
                continue
            d = os.path.join(BASE, f"{c.name}_{launcher}")
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            t0 = time.monotonic()
            try:
                res = c.run(d, launcher)
            except Exception as e:
                res = dict(outcome="script-error", detail=f"{type(e).__name__}: {e}"[:1000])
            res["case_s"] = round(time.monotonic() - t0, 1)
            _umount_under(d)
            results.setdefault(c.name, {"group": c.group, "note": c.note})[launcher] = res
            print(f"{c.group:11s} {c.name:34s} {launcher:9s} {res['outcome']:10s} {res['case_s']:6.1f}s  "
                  f"{res.get('detail', '')[:150]}", flush=True)
            if res["outcome"] == "clear":
                shutil.rmtree(d, ignore_errors=True)
    total = time.monotonic() - t_all
    counts = {}
    for name, per in results.items():
        for launcher, res in per.items():
            if isinstance(res, dict) and "outcome" in res:
                counts[res["outcome"]] = counts.get(res["outcome"], 0) + 1
    import datetime

    record = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
              "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, CPU only (gloo)",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "this_run_s": round(total, 1), "counts": counts, "cases": results}
    prev = json.load(open(args.out)) if os.path.exists(args.out) else {}
    record["runs"] = prev.get("runs", []) + [{"command": record["command"], "date": record["date"],
                                              "seconds": record["this_run_s"], "cases": len(cases),
                                              "launchers": launchers}]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{len(cases)} cases x {launchers}: {total:.0f} s; all recorded outcomes: {counts}")
    return 0 if set(counts) <= {"clear", "skipped"} else 1


if __name__ == "__main__":
    sys.exit(main())
