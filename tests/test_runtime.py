"""Units behind the reliability fixes: shutdown()/main_guard() in a subprocess, near-miss keys, batch
sizes, MASTER_PORT, train.py's CLI validation, data iteration (one order for every layout, no retention)."""
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
from ds_longctx.data import LongRangeCopy, TokenFileDataset, shard_batch
from ds_longctx.dist.launch import master_port
from launch_utils import ROOT, TINY_CPU

from ds_longctx.train import args as train_args  # noqa: E402


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
    return train_args.parse_args(["--deepspeed_config", TINY_CPU, *argv])


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
        train_args.validate_args(_args(*argv), lc)


def test_cli_defaults_and_copy_length(tmp_path):
    assert train_args.validate_args(_args(), parse(_tiny())) == 512  # long_context.sequence_length
    sp1 = parse(dict(_tiny(), sequence_parallel_size=1))
    assert train_args.validate_args(_args("--seq-len", "6"), sp1) == 6
    with pytest.raises(ConfigError, match="the copy task needs an even length >= 4, got 3"):
        train_args.validate_args(_args("--seq-len", "3"), sp1)
    data = tmp_path / "d.csv"
    data.write_text("x")
    with pytest.raises(ConfigError, match="unsupported file type"):
        train_args.validate_args(_args("--data", str(data), "--tokenizer", "t"), sp1)
    data = tmp_path / "d.jsonl"
    data.write_text("{}")
    with pytest.raises(ConfigError, match="--data: a file needs a tokenizer"):
        train_args.validate_args(_args("--data", str(data)), sp1)


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


def test_sample_stream_is_one_order_for_every_layout_and_keeps_no_batch():
    """train.py's data: global position p is sample p % N (epochs run on); replica r of dp reads positions
    start + r, start + r + dp, ...; so the samples of step k are the same for every layout, and a run resumed on
    another layout at the samples consumed continues with none repeated and none skipped."""
    from ds_longctx.data import SampleStream

    ds = LongRangeCopy(16, 64, num_samples=7)
    one = SampleStream(ds, 2)  # one replica, micro batch 2
    refs, seen = [], []
    for _ in range(6):  # past an epoch end (7 samples)
        b = next(one)
        refs.append(weakref.ref(b["input_ids"]))
        seen.append(b["input_ids"].clone())
        del b
    gc.collect()
    assert all(r() is None for r in refs)  # no batch is kept alive
    assert one.position == 12
    order = torch.cat(seen)  # positions 0..11 = samples 0..6, 0..4
    assert torch.equal(order[7], order[0]) and torch.equal(order[11], order[4])
    # DP 2 (micro 1) from position 4 of the same order: replica r reads 4 + r, 6 + r, ...
    for r in (0, 1):
        s = SampleStream(ds, 1, dp_rank=r, dp_size=2, start=4)
        got = torch.cat([next(s)["input_ids"] for _ in range(3)])
        assert torch.equal(got, order[[4 + r, 6 + r, 8 + r]]), r
        assert s.position == 10
    # SP 2: each rank keeps its half of the same samples
    halves = [next(SampleStream(ds, 2, sp_rank=r, sp_size=2))["input_ids"] for r in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=1), order[:2])
    # with shuffle: DistributedSampler's permutation per epoch
    from torch.utils.data import DistributedSampler

    sh = SampleStream(ds, 7, shuffle=True, seed=3)
    ids = torch.stack([ds[i]["input_ids"] for i in DistributedSampler(ds, 1, 0, shuffle=True, seed=3)])
    assert torch.equal(next(sh)["input_ids"], ids)


