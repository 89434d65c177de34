"""Units behind the reliability fixes: shutdown()/main_guard() in a subprocess, near-miss keys, batch
sizes, MASTER_PORT, train.py's CLI validation, data iteration without retention, resume layout check."""
import gc
import json
import os
import subprocess
import sys
import types
import weakref

import pytest
import torch

from ds_longctx.config import ConfigError, parse
from ds_longctx.data import SPDataLoader, LongRangeCopy, TokenFileDataset, shard_batch
from ds_longctx.launch import master_port
from launch_utils import ROOT, TINY_CPU

sys.path.insert(0, ROOT)
import train  # noqa: E402


def _py(code, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))


@pytest.mark.distributed  # starts processes
def test_shutdown_runs_atexit_and_exits_with_the_code():
    code = ("import atexit, ds_longctx; atexit.register(print, 'atexit ran'); print('x', end=''); "
            "ds_longctx.shutdown({})")
    ok = _py(code.format(0))
    assert ok.returncode == 0 and ok.stdout == "xatexit ran\n", ok
    bad = _py(code.format(3))  # an error exit ends now: no atexit handler (it could wait on a dead peer)
    assert bad.returncode == 3 and bad.stdout == "x", bad


@pytest.mark.distributed  # starts processes
def test_main_guard_prints_the_rank_and_exits_nonzero():
    p = _py("import ds_longctx\nwith ds_longctx.main_guard():\n    raise ValueError('boom')\nprint('not reached')",
            RANK="5")
    assert p.returncode == 1 and "not reached" not in p.stdout, p
    assert "[rank 5] Traceback (most recent call last):" in p.stderr and "[rank 5] ValueError: boom" in p.stderr
    p = _py("import ds_longctx\nfrom ds_longctx import ConfigError\n"
            "ds_longctx.run(lambda: (_ for _ in ()).throw(ConfigError('k', 'bad', 'fix it')))", RANK="1")
    assert p.returncode == 1 and p.stderr.strip().endswith("[rank 1] ds_longctx: error: k: bad. Fix: fix it"), p
    assert "Traceback" not in p.stderr
    p = _py("import ds_longctx, sys\nds_longctx.run(sys.exit, 'usage: bad flag')", RANK="0")
    assert p.returncode == 1 and "[rank 0] usage: bad flag" in p.stderr, p
    p = _py("import ds_longctx\nds_longctx.run(print, 'fine')")
    assert p.returncode == 0 and p.stdout == "fine\n", p


def _tiny():
    return json.load(open(TINY_CPU))


@pytest.mark.parametrize("key,intended", [("long_contex", "long_context"), ("Long_Context", "long_context"),
                                          ("long-context", "long_context"), ("long_ctx", "long_context"),
                                          ("sequence_paralel_size", "sequence_parallel_size"),
                                          ("sequence_parallelism_size", "sequence_parallel_size"),
                                          ("seq_parallel_communication_dtype", "seq_parallel_communication_data_type")])
def test_near_miss_top_level_keys(key, intended):
    with pytest.raises(ConfigError, match=f"^{key}: unknown top-level key, a near miss of '{intended}'.*"
                                          f"Fix: rename it to '{intended}'"):
        parse(dict(_tiny(), **{key: 2}))


def test_real_deepspeed_keys_are_not_near_misses():
    parse(dict(_tiny(), communication_data_type="fp32", pipeline_parallel_size=1, checkpoint={}, data_types={},
               seq_parallel_communication_data_type="fp32", train_batch_size=4, gradient_accumulation_steps="auto"))


@pytest.mark.parametrize("key,value", [("train_micro_batch_size_per_gpu", 0), ("gradient_accumulation_steps", -1),
                                       ("train_batch_size", 2.5), ("train_micro_batch_size_per_gpu", True)])
def test_batch_sizes_must_be_positive(key, value):
    with pytest.raises(ConfigError, match=f"^{key}: must be a positive integer, got {value!r}"):
        parse(dict(_tiny(), **{key: value}))


def test_master_port(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert master_port() == 29500 and master_port(29123) == 29123
    monkeypatch.setenv("MASTER_PORT", "31234")  # the launcher's (or mpirun -x) port wins, as for env://
    assert master_port() == 31234 and master_port(29123) == 31234
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ConfigError, match="MASTER_PORT: 'http' is not a TCP port"):
        master_port()


def _args(*argv):
    return train.parse_args(["--deepspeed_config", TINY_CPU, *argv])


@pytest.mark.parametrize("argv,msg", [
    (("--steps", "0"), "--steps: must be >= 1, got 0"),
    (("--seed", "-1"), "--seed: must be >= 0"),
    (("--eval-samples", "-1"), "--eval-samples: must be >= 0"),
    (("--seq-len", "-4"), "--seq-len: must be >= 1, got -4"),
    (("--seq-len", "31"), "--seq-len: 31 is not divisible by sequence_parallel_size=2"),
    (("--data", "nope"), "--data: 'nope' is neither a task"),
    (("--model-config", "/nonexistent/c.json"), "--model-config: '/nonexistent/c.json' does not exist"),
    (("--metrics", "/nonexistent/m.jsonl"), "--metrics: directory '/nonexistent' does not exist"),
    (("--metrics", "/"), "--metrics: '/' is a directory"),
    (("--save", TINY_CPU), f"--save: {TINY_CPU!r} exists and is not a directory"),
    (("--resume", "/nonexistent"), "--resume: '/nonexistent' holds no checkpoint"),
])
def test_cli_values_are_validated(argv, msg):
    lc = parse(_tiny())
    with pytest.raises(ConfigError, match="^" + msg.replace("(", r"\(")):
        train.validate_args(_args(*argv), lc)


def test_cli_defaults_and_copy_length(tmp_path):
    assert train.validate_args(_args(), parse(_tiny())) == 512  # long_context.sequence_length
    sp1 = parse(dict(_tiny(), sequence_parallel_size=1))
    assert train.validate_args(_args("--seq-len", "6"), sp1) == 6
    with pytest.raises(ConfigError, match="the copy task needs an even length >= 4, got 3"):
        train.validate_args(_args("--seq-len", "3"), sp1)
    data = tmp_path / "d.csv"
    data.write_text("x")
    with pytest.raises(ConfigError, match="unsupported file type"):
        train.validate_args(_args("--data", str(data), "--tokenizer", "t"), sp1)
    data = tmp_path / "d.jsonl"
    data.write_text("{}")
    with pytest.raises(ConfigError, match="--data: a file needs a tokenizer"):
        train.validate_args(_args("--data", str(data)), sp1)


def test_jsonl_lines_are_checked(tmp_path):
    tok = types.SimpleNamespace(eos_token_id=None)
    for text, msg in [('{"text": "a"}\n{"txt": "b"}\n', "line 2: has no string \"text\" field \\(got \\['txt'\\]\\)"),
                      ('[1]\n', "line 1: has no string \"text\" field \\(got list\\)"),
                      ('{"text": \n', "line 1: is not valid JSON")]:
        path = tmp_path / "d.jsonl"
        path.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            TokenFileDataset(str(path), tok, 4)


def test_shards_own_only_their_bytes():
    for bsz, sp in [(1, 1), (1, 2), (2, 2)]:
        batch = {"input_ids": torch.arange(bsz * 64).view(bsz, 64)}
        for k, v in shard_batch(batch, 0, sp).items():
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), (bsz, sp, k)


def test_data_iteration_keeps_no_batch_and_resumes_at_its_position():
    loader = SPDataLoader(LongRangeCopy(16, 64, num_samples=12), batch_size=2, sp_rank=0, sp_size=2)
    assert len(loader) == 6
    it = train.micro_batches(loader, 0)
    refs, seen = [], []
    for _ in range(14):  # past two epoch ends
        b = next(it)
        refs.append(weakref.ref(b["input_ids"]))
        seen.append(b["input_ids"].clone())
        del b
    gc.collect()
    assert all(r() is None for r in refs)  # itertools.cycle kept every batch alive
    assert torch.equal(seen[0], seen[6]) and torch.equal(seen[1], seen[13])  # epochs repeat (no shuffle)
    resumed = train.micro_batches(loader, 9)
    for k in range(9, 14):
        assert torch.equal(next(resumed)["input_ids"], seen[k])


def test_resume_layout_mismatch_names_every_difference():
    layout = {"world_size": 2, "sequence_parallel_size": 2, "data_parallel_size": 1, "seq_len": 64,
              "micro_batch": 4, "gradient_accumulation_steps": 1, "seed": 0, "data": "copy",
              "batches_per_epoch": 25000}
    train.check_resume_layout(dict(layout, step=3), layout, "ck")
    now = dict(layout, world_size=4, data_parallel_size=2, seed=1)
    with pytest.raises(ConfigError) as e:
        train.check_resume_layout(layout, now, "ck")
    msg = str(e.value)
    assert msg.startswith("--resume: ck was saved with a different layout: world_size 2 in the checkpoint vs 4 now, "
                          "data_parallel_size 1 in the checkpoint vs 2 now, seed 0 in the checkpoint vs 1 now")
    assert "Fix: resume with the number of processes = 2, world / sequence_parallel_size = 1, --seed = 0" in msg
