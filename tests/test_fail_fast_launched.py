"""Issue 30 under real launches, side by side (each launch is ~20 s of start-up on CPU): two "nodes" reading
different data files (mpirun MPMD: one train.py command per rank) are one clear error on every rank at the first
collective; a rank frozen with kill -STOP ends the whole job (deepspeed launcher) within the configured
long_context.watchdog.timeout_s, with the diagnosis on the live rank and no process left. Meanwhile this process
checks what "auto" uses: the planner's predicted step, and an "auto" choice that does not fit logged as a warning. Every kind of
disagreement, both launchers and the frozen rank 0 (the store's host): bench/fault_rerun.py --group fail_fast."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from dist_utils import free_port
from launch_utils import ROOT, TINY_CPU, TRAIN, _env

pytestmark = pytest.mark.distributed

TIMEOUT_S = 10  # the watchdog's timeout in the frozen-rank launch


def mpmd_command(argvs, port):
    """mpirun with one app context per rank (MPMD): ``argvs[r]`` is rank r's python argv."""
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONPATH",
           "-x", "MASTER_PORT"]
    for i, argv in enumerate(argvs):
        cmd += ([":"] if i else []) + ["-np", "1", sys.executable, *argv]
    return cmd


def train_pids(marker):
    """{rank: pid} of the train.py ranks whose command line holds ``marker`` (launchers excluded)."""
    ranks = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or marker.encode() not in b" ".join(cmd) or not any(c.endswith(b"train.py") for c in cmd):
            continue
        if any(b"deepspeed.launcher" in c or c.endswith((b"mpirun", b"prterun")) for c in cmd[:4]):
            continue
        r = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"RANK")
        if r is not None:
            ranks[int(r)] = int(d)
    return ranks


def word_tokenizer(d, n=100):
    """A local word-level tokenizer (w0 ... w{n-1}; no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = os.path.join(d, "tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(path)
    return path


def _data_mismatch(tmp, tok):
    """Rank 0 reads one file, rank 1 another with other content (the same name on two nodes)."""
    argvs = []
    for r in range(2):
        d = os.path.join(tmp, f"node{r}")
        os.makedirs(d)
        path = os.path.join(d, "train.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"text": " ".join(f"w{(i * (r + 1)) % 50}" for i in range(400))}) + "\n")
        argvs.append([TRAIN, "--deepspeed_config", TINY_CPU, "--no-progress", "--steps", "1", "--seq-len", "64",
                      "--eval-samples", "0", "--data", path, "--tokenizer", tok])
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.run(mpmd_command(argvs, port), cwd=ROOT, env=dict(_env(), MASTER_PORT=str(port)),
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def _frozen_rank(tmp):
    """kill -STOP rank 1 after step 2 of a long run: (seconds until no process of the job is left, output, pids
    still there)."""
    cfg = json.load(open(TINY_CPU))
    cfg["long_context"]["watchdog"] = {"timeout_s": TIMEOUT_S}
    config = os.path.join(tmp, "frozen.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    metrics = os.path.join(tmp, "m.jsonl")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           TRAIN, "--deepspeed_config", config, "--no-progress", "--seq-len", "64", "--eval-samples", "0",
           "--steps", "100000", "--metrics", metrics]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(metrics) and open(metrics).read().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() < deadline, "".join(chunks)[-3000:]
            time.sleep(0.2)
        pids = train_pids(config)
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            p.poll()  # reap the runner (a zombie still counts as a member of the group)
            try:
                os.killpg(p.pid, 0)  # the launcher, launch.py and the ranks share the runner's process group
            except ProcessLookupError:
                break
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        left = train_pids(config)
    finally:
        for pid in train_pids(config).values():  # this test's own ranks, by pid
            os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        reader.join(10)
    return gone_s, "".join(chunks), left


def _auto_prediction():
    """What "auto" is raised to on a CUDA machine: the planner's predicted step for the config as initialize resolved
    it ("auto" heads_per_chunk written in), against the planner run directly on that config."""
    import copy

    from ds_longctx.config import load_ds_config, parse
    from ds_longctx.planner.core import Planner, load_model_config
    from ds_longctx.job.watchdog import predicted_step_seconds

    model = os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json")
    cfg = load_ds_config(TINY_CPU)
    cfg["long_context"]["attention"]["heads_per_chunk"] = "auto"
    lc = parse(dict(cfg, long_context=dict(cfg["long_context"], attention=dict(cfg["long_context"]["attention"],
                                                                                 heads_per_chunk=2))))
    predicted = predicted_step_seconds(cfg, lc, model, 2, 80 << 30, "h100")
    resolved = copy.deepcopy(cfg)
    resolved["long_context"]["attention"]["heads_per_chunk"] = 2
    direct = Planner(resolved, load_model_config(model), 2, gpu_mem=80 << 30, reserve="0", target="h100").run(512)
    return predicted, direct.time["seconds"]


def _auto_unfit_is_a_warning(caplog):
    """initialize's log for the planner's "auto" lines: the memory-safest choice not fitting (here the host, 1 MiB of
    arena per node over 100 KiB) is a warning (shown by default), not an INFO line; the host check then refuses."""
    import logging

    from ds_longctx.config import load_ds_config
    from ds_longctx.initialize import _auto_log
    from ds_longctx.planner import resolve_auto

    cfg = load_ds_config(TINY_CPU)
    cfg["long_context"]["attention"]["heads_per_chunk"] = "auto"
    with caplog.at_level(logging.INFO, logger="ds_longctx"):
        chosen = resolve_auto(cfg, os.path.join(ROOT, "ds_configs", "models", "tiny-llama.json"), 2, 80 << 30,
                              host_mem=100 << 10, log=_auto_log, gpus_per_node=2)
    return chosen, [(r.levelname, r.getMessage()) for r in caplog.records if "ds_longctx auto" in r.getMessage()]


def test_data_mismatch_mpmd_and_a_frozen_rank_end_the_job_clearly(tmp_path, caplog):
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with ThreadPoolExecutor(2) as pool:
        # built here, not in a pool thread: transformers' lazy imports race between threads
        mismatch = pool.submit(_data_mismatch, str(tmp_path / "a"), word_tokenizer(str(tmp_path / "a")))
        frozen = pool.submit(_frozen_rank, str(tmp_path / "b"))
        predicted, direct = _auto_prediction()  # meanwhile, in this process
        chosen, auto_lines = _auto_unfit_is_a_warning(caplog)
        rc, out, wall = mismatch.result()
        gone_s, fout, left = frozen.result()
    # the data: one line on every rank naming both files, their sizes and hashes, before any other collective
    assert rc != 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if "ds_longctx: error:" in ln]
    for r in (0, 1):
        line = next((ln for ln in lines if ln.startswith(f"[rank {r}] ")), None)
        assert line is not None, out[-3000:]
        assert "ds_longctx: error: data (the data this rank reads): differs between the ranks of this job: " in line
        for n in (0, 1):
            assert f"{os.path.join(str(tmp_path / 'a'), f'node{n}', 'train.jsonl')!r} (" in line, line
        assert "on rank 0 (host " in line and "on rank 1 (host " in line and ". Fix: let every rank read" in line
    assert "Traceback" not in out, out[-3000:]
    # the frozen rank: rank 0 names rank 1 and the collective it waits in; the job is gone within the timeout
    # (plus the launcher's own exit; DeepSpeed's default is 10 minutes, and the deepspeed launcher alone would
    # wait 30 s more for the stopped rank), no process left
    assert left == {}, (left, fout[-3000:])
    line = next((ln for ln in fout.splitlines() if ln.startswith("[rank 0] ds_longctx: error: long_context.watchdog"
                                                                 ".timeout_s: rank 1 (host ")), None)
    assert line is not None, fout[-3000:]
    # rank 0 waits in a collective: a torch.distributed function, or (ZeRO-3's gathers) a Work.wait() in C++
    assert " went silent: no heartbeat for " in line and ("this rank has been in torch.distributed." in line or
                                                          "this rank has been in a wait() on an asynchronous handle"
                                                          in line), line
    assert "Fix: find why rank 1 stopped" in line and f"(now {TIMEOUT_S} s)" in line, line
    assert gone_s < TIMEOUT_S + 20, (gone_s, fout[-3000:])
    assert "Traceback" not in fout, fout[-3000:]
    assert predicted == direct > 0
    assert chosen["attention.heads_per_chunk"] == 1
    assert auto_lines == [("WARNING", "ds_longctx auto: even the memory-safest settings do not fit at 512 tokens (over "
                                      "host memory: 1.00 MiB, 924.00 KiB over 100.00 KiB per node; NVMe not checked (0 B/node)); "
                                      "keeping them: attention.heads_per_chunk=1, tiled_mlp.shards=4, "
                                      "tiled_loss.shards=4")], auto_lines
