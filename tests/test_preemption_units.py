"""Issue 38 without a launch: the signal semantics a rank needs under DeepSpeed's launcher (SIGINT once saves, the
launcher's copy of a group SIGTERM is absorbed only under launch.py, the launcher's death inside a graceful stop is a
stop request, a SIGTERM after the stop's save ends with 0); the metrics file cut back to a resumed step; the
tokenizer's content in the data identity and the agreement's message; a data file without text refused."""
import json
import os
import subprocess
import sys

import pytest

from launch_utils import ROOT, _env

_SIGNALS = r"""
import os, signal, sys, time
from ds_longctx.dist import runtime
from ds_longctx.dist.runtime import graceful_stop, install_signal_handlers, stop_requested, stop_saved
install_signal_handlers()
runtime.watch_launcher(interval_s=3600)  # the launcher-gone handler (the parent here is pytest, alive)
case = sys.argv[1]
with graceful_stop():
    if case == "sigint-twice":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        print("STOP", stop_requested(), flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # not under launch.py: a repeat ends the rank at once
        time.sleep(10)
    elif case == "launcher-gone":
        os.kill(os.getpid(), runtime._LAUNCHER_GONE_SIGNAL)  # what PR_SET_PDEATHSIG sends when the parent dies
        time.sleep(0.3)
        print("STOP", stop_requested(), flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second stop request changes nothing (and is named)
        time.sleep(0.3)
        print("STILL", stop_requested(), flush=True)
        stop_saved("step 3")
        os.kill(os.getpid(), signal.SIGTERM)  # after the save: exit 0
        time.sleep(10)
print("NOT REACHED", flush=True)
"""


@pytest.mark.distributed  # processes of their own (signals end them)
@pytest.mark.parametrize("case,code,stop", [("sigint-twice", 130, "SIGINT"),
                                            ("launcher-gone", 0, "the launcher's exit")])
def test_stop_signals(case, code, stop):
    p = subprocess.run([sys.executable, "-c", _SIGNALS, case], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr[-2000:])
    assert f"STOP {stop}" in p.stdout and "NOT REACHED" not in p.stdout, p.stdout
    if case == "sigint-twice":
        assert "received SIGINT: finishing this step, saving a checkpoint, then exiting" in p.stderr, p.stderr
        assert "received SIGINT: ending this rank (exit 130)" in p.stderr, p.stderr
    else:
        assert f"STILL {stop}" in p.stdout, p.stdout
        assert "the launcher (parent) process exited: finishing this step, saving a checkpoint" in p.stderr, p.stderr
        assert ("received SIGUSR1: finishing this step, saving a checkpoint, then exiting (already asked by the "
                "launcher's exit)") in p.stderr, p.stderr
        assert "received SIGTERM after the graceful stop's save (step 3): ending this rank (exit 0)" in p.stderr


def test_metrics_file_cut_back_to_the_resumed_step(tmp_path):
    from ds_longctx.job.metrics import truncate_metrics

    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)]
    path.write_text("".join(lines) + '{"step": 8, "lo')  # a line cut by a full disk or a kill
    assert truncate_metrics(str(path), 6) == (len("".join(lines[:6])), 6)
    assert path.read_text() == "".join(lines[:6])  # steps 7 (past the checkpoint) and the broken 8 gone
    path.write_text("".join(lines[:3]) + '{"step": 4, "lo')
    assert truncate_metrics(str(path), 6) == (len("".join(lines[:3])), 3)
    assert path.read_text() == "".join(lines[:3])
    assert truncate_metrics(str(tmp_path / "absent.jsonl"), 3) == (0, 0)


def _word_tokenizer(path, reverse=False, eos="w1"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = 50
    vocab = {f"w{i}": (n - 1 - i if reverse else i) for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(str(path))
    return str(path)


def test_tokenizer_content_in_the_data_identity(tmp_path):
    from transformers import AutoTokenizer

    from ds_longctx.job.agreement import disagreement, fingerprint, this_member
    from ds_longctx.data.token_cache import tokenizer_content_sha256

    a = tokenizer_content_sha256(AutoTokenizer.from_pretrained(_word_tokenizer(tmp_path / "a")))
    moved = tokenizer_content_sha256(AutoTokenizer.from_pretrained(_word_tokenizer(tmp_path / "other" / "a")))
    reversed_ids = tokenizer_content_sha256(AutoTokenizer.from_pretrained(_word_tokenizer(tmp_path / "r", True)))
    other_eos = tokenizer_content_sha256(AutoTokenizer.from_pretrained(_word_tokenizer(tmp_path / "e", eos="w2")))
    assert a == moved  # the content, not the path
    assert len({a, reversed_ids, other_eos}) == 3
    # train.py records it in the data identity of a file (what a resume compares), not of a built-in task
    import argparse

    from ds_longctx.train import args as train_args
    from ds_longctx.train import job as train_job
    from ds_longctx.train import loop as train_loop

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "w2 w3"}\n')
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "r"))
    ident = train_job.data_identity(argparse.Namespace(data=str(data), data_column="text"), tok)
    assert ident["tokenizer_sha256"] == reversed_ids and ident["column"] == "text", ident
    assert train_job.data_identity(argparse.Namespace(data="copy", data_column="text"), tok) == {"task": "copy"}
    flats = [fingerprint({"lr": 1}, {"cli": {"--tokenizer": "tok"}, "tokenizer": sha}) for sha in (a, reversed_ids)]
    err = disagreement(flats, [this_member(0), this_member(1)])
    assert str(err).startswith("tokenizer (the sha256 of its vocabulary, merges and special tokens): differs between "
                               f'the ranks of this job: "{a}" on rank 0'), str(err)
    assert "copy the tokenizer directory to every node" in str(err)


def test_a_data_file_without_text_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from ds_longctx.data.corpus import open_corpus
    from ds_longctx.errors import ConfigError

    tok = AutoTokenizer.from_pretrained(_word_tokenizer(tmp_path / "t"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n' * 20)
    with pytest.raises(ConfigError, match=r"^--data: .*empty\.jsonl \(column 'text'\) has no text tokens: each of its "
                       r"20 document\(s\) is empty \(only the end-of-document token\)\. Fix: give a file with more text"):
        open_corpus(str(empty), tok, 8, cache_dir=str(tmp_path / "c1"))
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "w5 w6 w7"}\n' * 3)  # 12 tokens with the EOS, 9 of them text
    with pytest.raises(ConfigError, match=r"has 9 text tokens besides its 3 end-of-document tokens, fewer than one "
                       r"sample of 10"):  # before: one sample of 10 (EOS counted as text)
        open_corpus(str(short), tok, 10, cache_dir=str(tmp_path / "c2"))
    assert len(open_corpus(str(short), tok, 8, cache_dir=str(tmp_path / "c3"))) == 1


def test_messages_that_tell_the_truth(tmp_path):
    """Item 8: a save directory removed mid-run, a filesystem that fits one checkpoint, --metrics under a regular
    file, the --concat-documents refusal (a switch); and item 2's resume refusal of another tokenizer (a record of
    an older ds_longctx, without the tokenizer's hash, still resumes)."""
    from test_checkpoint import _saved

    from ds_longctx.train import args as train_args
    from ds_longctx.train import job as train_job
    from ds_longctx.train import loop as train_loop
    from ds_longctx.job import checkpoint
    from ds_longctx.errors import ConfigError

    for saved, now, fix in ((True, False, "resume with --concat-documents,"),
                            (False, True, "resume without --concat-documents,")):
        current = _saved(tmp_path, concat_documents=saved)
        with pytest.raises(ConfigError, match=rf"concat_documents {saved} in the checkpoint vs {now} now .*Fix: {fix} "
                           r"or start a new run"):
            checkpoint.plan_resume(str(tmp_path), dict(current, concat_documents=now))
    data = {"path": "/a/d.jsonl", "bytes": 10, "sha256": "ab", "column": "text", "tokenizer_sha256": "t1"}
    current = _saved(tmp_path, data=data)
    with pytest.raises(ConfigError, match=r"the data differ: tokenizer_sha256 't1' in the checkpoint vs 't2' now"):
        checkpoint.plan_resume(str(tmp_path), dict(current, data=dict(data, tokenizer_sha256="t2")))
    older = {k: v for k, v in data.items() if k != "tokenizer_sha256"}
    current = _saved(tmp_path, data=older)
    checkpoint.plan_resume(str(tmp_path), dict(current, data=data))

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=rf"^--metrics: {str(blocker)!r} is a file, not a directory, so .* cannot "
                       r"be created under it"):
        train_args._check_writable_file("--metrics", str(blocker / "sub" / "m.jsonl"))

    sd = checkpoint.SaveDir(path=str(tmp_path / "removed"), groups=[[0, 1]])
    facts = [{"free": 0, "missing": True, "bytes": 10, "host": "h"}] * 2
    with pytest.raises(ConfigError, match=r"^--save: '.*removed' no longer exists on h \(ranks 0-1\): it was removed "
                       r"or renamed while this run saved to it"):
        sd._check_space(facts, "the checkpoint of step 4")
    facts = [{"free": 15, "bytes": 10, "host": "h"}] * 2
    with pytest.raises(ConfigError, match=r"has 15 B free on h; the checkpoint of step 4 of ranks 0-1 needs 20 B .*"
                       r"--keep-last N removes older checkpoints only after each save: the filesystem needs room for "
                       r"N\+1 checkpoints, so it helps only where two fit"):
        sd._check_space(facts, "the checkpoint of step 4")


def test_a_newcomers_hour(tmp_path, capfd):
    """Item 11 (the parts in this area): --version; help without markup or source paths; `configs` lists the model
    configs and not the planner's targets.json; a CPU run's plain line says GFLOP/s per rank, not per GPU; an export's
    config sets dtype (torch_dtype is deprecated)."""
    import torch

    from ds_longctx import cli
    from ds_longctx._version import __version__
    from ds_longctx.job.metrics import plain_line

    assert cli.main(["--version"]) == 0 and capfd.readouterr().out == f"ds-longctx {__version__}\n"
    assert cli.main(["--help"]) == 0
    out = capfd.readouterr().out
    assert "``" not in out and ".py" not in out.replace("train.py", "") and "ds-longctx launch" in out, out
    assert cli.main(["configs"]) == 0
    out = capfd.readouterr().out
    assert "  models/tiny-llama.json" in out and "targets.json" not in out and "  tiny-cpu.json" in out, out
    rec = {"step": 3, "loss": 1.0, "tokens_per_s": 10.0, "tflops": 0.002, "peak_mem_bytes": 1, "step_time_s": 1.0}
    line = plain_line(rec, 10)
    assert ("2.00 GFLOP/s/rank" if not torch.cuda.is_available() else "2.00 GFLOP/s/GPU") in line, line

    from transformers import LlamaConfig

    from ds_longctx.job.checkpoint import write_hf

    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_config(cfg).state_dict()
    capfd.readouterr()
    write_hf(str(tmp_path / "hf"), sd, cfg, dtype=torch.bfloat16)
    assert "torch_dtype" not in capfd.readouterr().err  # transformers logs "`torch_dtype` is deprecated!" once
    saved = json.load(open(tmp_path / "hf" / "config.json"))
    assert saved.get("dtype", saved.get("torch_dtype")) == "bfloat16", saved


def test_plot_labels_end_inside_their_panels(tmp_path, monkeypatch):
    """Item 11: the planner plot's labels after the bars (step time and MFU, the max context) crossed the panel's
    frame into the next panel; each panel's range now grows until they fit."""
    pytest.importorskip("matplotlib")
    from types import SimpleNamespace as NS

    import matplotlib.pyplot as plt

    from ds_longctx.planner import cli

    g = 2**30

    def row(label, peak, fits, mx=None, secs=12.0, binding="device"):
        bd = {"model_states": 10 * g, "attention": peak * 0.3, "mlp": peak * 0.2, "loss": peak * 0.1,
              "other": peak * 0.4 - 10 * g}
        return (label, NS(device_budget_bytes=80 * g, reserve_bytes=3 * g, world_size=8, binding=binding,
                          breakdown=bd, peak_device_bytes=peak, activation_peak_bytes=peak - 10 * g, fits=fits,
                          sequence_length=2**20, time={"seconds": secs, "mfu": 0.41, "target": "dgx-h100"}), mx)

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    fixed = [row("baseline (no ds_longctx)", 900 * g, False, secs=300), row("ulysses + tiled mlp", 70 * g, True),
             row("untied + offload nvme, heads_per_chunk 1", 40 * g, True, secs=3000)]
    at_max = [row("baseline", 60 * g, True, mx=123456, secs=1.5),
              row("ulysses + tiled mlp + checkpoint", 75 * g, True, mx=8_000_000, secs=900),
              row("untied + offload nvme", 74 * g, True, mx=15_000_000, secs=4000, binding="host")]
    crossing = []
    for rows, show_max in ((fixed, False), (at_max, True)):
        cli.plot(rows, str(tmp_path / f"p{show_max}.png"), show_max)
        fig = figs[-1]
        r = fig.canvas.get_renderer()
        for ax in fig.axes:
            frame = ax.get_window_extent(r)
            for t in ax.texts:
                b = t.get_window_extent(r)
                if t.get_text() and (b.x0 < frame.x0 - 1 or b.x1 > frame.x1 + 1 or b.y1 > frame.y1 + 1):
                    crossing.append((show_max, t.get_text()))
    assert not crossing, crossing  # before: 5 (both step-time panels, the 15M max context)


def test_model_config_hint_names_a_path_this_install_has(monkeypatch):
    """Item 11: the hub refusal's --model-config example named ds_configs/models/llama3-8b.json, which a wheel does
    not have (its presets lie inside the package)."""
    from ds_longctx.train import args as train_args
    from ds_longctx.train import job as train_job
    from ds_longctx.train import loop as train_loop
    from ds_longctx.errors import ConfigError

    def fail():
        raise OSError("no such repo")

    with pytest.raises(ConfigError) as e:
        train_job.hub_load("--model", "no/such-model", fail)
    example = os.path.join(train_job.shipped_configs_dir(), "models", "llama3-8b.json")
    assert f"e.g. {example})" in str(e.value) and os.path.isfile(example), str(e.value)
    monkeypatch.setattr(train_job, "shipped_configs_dir", lambda: "/site-packages/ds_longctx/ds_configs")  # a wheel's
    with pytest.raises(ConfigError, match=r"e\.g\. /site-packages/ds_longctx/ds_configs/models/llama3-8b\.json\)"):
        train_job.hub_load("--model", "no/such-model", fail)


def test_export_line_says_whether_a_tokenizer_was_written():
    """Item 11: README listed a tokenizer in --save-hf's directory; the demo (the built-in copy task) has none, and
    the export's line now says so instead of implying one."""
    from ds_longctx.job.checkpoint import exported_line

    assert "config, generation config, tokenizer;" in exported_line("out", object(), 1.0)
    line = exported_line("out", None, 1.0)
    assert "no tokenizer: the run has none" in line and "--tokenizer names one" in line, line


def test_launch_noise_where_we_launch():
    """Item 11: every CPU launch printed DeepSpeed's "Setting accelerator to CPU" three times (runner, launch.py, a
    rank: ds-longctx launch and launch/*.sh now choose DeepSpeed's CPU fallback once, saying so, where no accelerator
    device exists) and torch's two FutureWarnings about DeepSpeed's deprecated calls (train.py filters those two)."""
    import warnings

    from ds_longctx.train import args as train_args
    from ds_longctx.train import job as train_job
    from ds_longctx.train import loop as train_loop
    from ds_longctx.dist import preemptible

    assert preemptible.accelerator_env({}, nodes=[]) == {"DS_ACCELERATOR": "cpu"}
    assert preemptible.accelerator_env({}, nodes=["/dev/nvidia0"]) == {}
    assert preemptible.accelerator_env({"DS_ACCELERATOR": "cuda"}, nodes=[]) == {}  # the user's choice stays
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train_loop.quiet_deepspeed_warnings()
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed.x` instead.",
                          FutureWarning)
        warnings.warn("`torch.distributed.other` is deprecated.", FutureWarning)  # anything else still shows
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", UserWarning)
    assert [str(w.message)[:40] for w in seen] == ["`torch.distributed.other` is deprecated.",
                                                   "`torch.distributed.all_gather_into_tenso"], seen


def test_wrapper_modes(tmp_path):
    """ds-longctx launch: an MPI launcher is wrapped as itself (its first stop signal sent on to mpirun's pid as
    SIGUSR1); a deepspeed hostfile of several hosts (pdsh) hands the stop to the runner (SIGTERM); one host: the
    runner's process group (tests/test_preemption.py launches each)."""
    from ds_longctx.dist import preemptible

    assert preemptible._is_mpi(["mpirun", "-np", "2"]) and preemptible._is_mpi(["/opt/bin/mpiexec"])
    assert not preemptible._is_mpi(["--num_gpus", "2", "train.py"])
    two, one = tmp_path / "two", tmp_path / "one"
    two.write_text("# nodes\nnode-a slots=8\n\nnode-b slots=8  # second\n")
    one.write_text("localhost slots=2\n")
    assert preemptible._hostfile_hosts(["--hostfile", str(two), "train.py", "--hostfile", "x"]) == ["node-a", "node-b"]
    assert preemptible._hostfile_hosts([f"--hostfile={one}", "train.py"]) == ["localhost"]
    assert preemptible._hostfile_hosts(["--hostfile", str(tmp_path / "none"), "train.py"]) == []


def test_cpu_device_side_counts_what_a_cpu_run_makes_resident():
    """Item 9 as measured by the fault rerun: the host check of the tiny CPU demo counted 3.73 GiB per rank of
    "device side" (ZeRO-3's 5e8-element reduce bucket and its transient copy, 2 GB each in fp32) for a model of
    0.13M parameters whose ranks peak near 0.4 GiB: a torch.empty bucket on the host is resident only where gradients
    are written, at most the parameter count. A CPU box with less than 7.5 GiB free would have refused the demo."""
    from ds_longctx.job.hostmem import resident_on_cpu
    from ds_longctx.planner import model_states as ms

    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")))
    p = ms.ParamInfo(total=130_000, largest_module=0)

    def device(c):
        s = ms.compute(c, p, 2)
        return s.device_total + s.step_transient_device

    assert device(cfg) > 3.7 * 2**30  # the GPU figure: the whole bucket is device memory there
    assert device(resident_on_cpu(cfg, 130_000)) < 4 * 2**20
    small = dict(cfg, zero_optimization=dict(cfg["zero_optimization"], reduce_bucket_size=1000))
    assert resident_on_cpu(small, 10**6)["zero_optimization"]["reduce_bucket_size"] == 1000  # under the model: kept
    assert cfg["zero_optimization"] == {"stage": 3}  # not changed in place
