"""Preemption and the faults of issue 38, through real launches (CPU, gloo, ZeRO-3, SP 2, ds_configs/tiny-cpu.json,
a .jsonl file and a local word tokenizer), batched into one test (three jobs side by side, then one):

* the deepspeed runner started as users do (`setsid deepspeed ... &`), SIGUSR1 to its whole process group (what
  SLURM's --signal and most schedulers do): the runner and launch.py die of SIGUSR1's default action; the ranks
  finish the step, save and move `latest` (before: launch.py's death ended them, the last --save-every tag stayed);
* the same with SIGTERM to the group: launch.py sends every rank a second SIGTERM, which the ranks absorb (before:
  the second SIGTERM ended them without the save);
* the stopped job's metrics equal an uninterrupted run's step for step (bit-equal: the same layout), each step once;
* --metrics on a full filesystem: the step is saved and the job ends naming the file; the file holds whole lines;
  after space is freed, --resume auto continues it without a duplicate step, bit-equal;
* `ds-longctx convert` killed with -9: its pool workers end with it, the next conversion removes its partial
  directory.

`ds-longctx launch` (ds_longctx/dist/preemptible.py, what launch/single_node.sh runs) resuming a stopped job, SIGTERM
or SIGUSR1 to its process group, every process exiting 0, the steps bit-equal to the uninterrupted run's:
tests/test_soak.py (over the deepspeed runner and mpirun); mpirun's signals through it: below."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import free_port
from launch_utils import (REFERENCE_ARGS, REFERENCE_STEPS, ROOT, TINY_CPU, TRAIN, _env, mpirun_command,
                          read_metrics, run_train)
from test_faults import small_tmpfs  # noqa: F401  (fixture)

from ds_longctx.job import checkpoint

pytestmark = pytest.mark.distributed

PREEMPTIBLE = os.path.join(ROOT, "ds_longctx", "dist", "preemptible.py")


def _tokenizer(path, reverse=False):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = 60  # below the tiny model's vocabulary of 64
    tok = Tokenizer(models.WordLevel({f"w{i}": (n - 1 - i if reverse else i) for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(str(path))
    return str(path)


def _data(path):
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(2, 60)}" for _ in range(rng.randrange(20, 200)))})
                    + "\n")
    return str(path)


def _start(log_path, argv, wrapper=False):
    """A job in a session of its own, as `setsid deepspeed ... &` (killpg reaches the runner, launch.py and ranks)."""
    head = [sys.executable, PREEMPTIBLE] if wrapper else [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd = [*head, "--num_gpus", "2", "--master_port", str(free_port()), TRAIN, "--deepspeed_config", TINY_CPU,
           "--no-progress", *argv]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    p.log_path = log_path
    return p


def _ended_nonzero(out):
    """A rank ended before or without its save ("ending this rank (exit 143)"); a rank that learns of its launcher's
    exit after the graceful stop's save ends with 0 and says so (timing: the store's host waits for the others)."""
    import re

    return re.search(r"ending this rank[^\n]*\(exit (?!0\))", out) is not None


def _steps(metrics):
    try:
        return open(metrics).read().count("\n")
    except FileNotFoundError:
        return 0


def _signal_after(p, metrics, n, sig, timeout=300):
    """``sig`` to the job's whole process group once ``metrics`` holds ``n`` steps; returns the job's exit code and
    its output once every process of the group ended."""
    deadline = time.monotonic() + timeout
    try:
        while _steps(metrics) < n:
            assert p.poll() is None and time.monotonic() < deadline, open(p.log_path).read()[-3000:]
            time.sleep(0.1)
        os.killpg(p.pid, sig)
        code = p.wait(timeout=180)
        while True:  # the ranks outlive a runner that died of the signal
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline + 180, open(p.log_path).read()[-3000:]
            time.sleep(0.1)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, open(p.log_path).read()


def _metrics_error_run(tmp_path, common, mnt):
    """--metrics on a filesystem with room for a few lines: returns (exit code, output, saved step)."""
    st = os.statvfs(mnt)
    with open(os.path.join(mnt, "filler"), "wb") as f:  # one page left: about 12 lines of room
        f.write(b"\0" * ((st.f_bavail - 1) * st.f_frsize))
    metrics = os.path.join(mnt, "m.jsonl")
    p = run_train(*common, "--steps", "40", "--save", str(tmp_path / "ck_full"), "--metrics", metrics, check=False,
                  timeout=400)
    return p.returncode, p.stdout + p.stderr, metrics


def test_preemption_through_the_deepspeed_runner(tmp_path, request):
    tok = _tokenizer(tmp_path / "tok")
    common = ["--seq-len", "64", "--eval-samples", "0", "--log-every", "0", "--data", _data(tmp_path / "d.jsonl"),
              "--tokenizer", tok]
    go = [*common, "--steps", "100000", "--save-every", "2"]
    a_ck, c_ck, a_m, c_m = tmp_path / "ck_a", tmp_path / "ck_c", tmp_path / "a.jsonl", tmp_path / "c.jsonl"
    try:
        mnt = request.getfixturevalue("small_tmpfs")
    except pytest.skip.Exception:
        mnt = None
    from concurrent.futures import ThreadPoolExecutor

    # side by side: a group SIGUSR1 and a group SIGTERM to the plain runner (job c, stopped after 18 steps, is the
    # uninterrupted reference of the others' steps), the full metrics disk
    with ThreadPoolExecutor(3) as pool:
        full = pool.submit(_metrics_error_run, tmp_path, common, mnt) if mnt else None
        a = pool.submit(_signal_after, _start(tmp_path / "a.log", [*go, "--save", str(a_ck), "--metrics", str(a_m)]),
                        a_m, 3, signal.SIGUSR1)
        c = pool.submit(_signal_after, _start(tmp_path / "c.log", [*go, "--save", str(c_ck), "--metrics", str(c_m)]),
                        c_m, 18, signal.SIGTERM)
        (a_code, a_out), (c_code, c_out) = a.result(), c.result()
        full = full.result() if full else None
    reference = {r["step"]: r["loss"] for r in read_metrics(c_m)}
    assert sorted(reference) == list(range(1, len(reference) + 1)) and len(reference) >= 18, reference
    for name, code, out, ck, metrics, sig in (("a", a_code, a_out, a_ck, a_m, "SIGUSR1"),
                                              ("c", c_code, c_out, c_ck, c_m, "SIGTERM")):
        last = read_metrics(metrics)[-1]["step"]
        assert code == -getattr(signal, sig), (name, code, out[-3000:])  # the runner: DeepSpeed's, no handler
        for r in (0, 1):
            assert f"[rank {r}] ds_longctx: received {sig}: finishing this step, saving a checkpoint" in out, out[-3000:]
        assert f"stopped after step {last} on {sig}: saved; continue with --resume {ck}" in out, out[-3000:]
        assert not _ended_nonzero(out) and "Traceback" not in out, out[-3000:]
        assert checkpoint.find_resume_tag(str(ck))[0] == f"step{last}", (name, os.listdir(ck))
    # (job c: launch.py's own SIGTERM reaches a rank either merged with the group's, absorbed as the launcher's copy,
    # or after the save; the runner's death is a stop request too: no path ends a rank before the save)

    # then the full-disk job resumed once the disk has room. (`ds-longctx launch` resuming a stopped job, preempted by
    # SIGTERM to its process group, every process exiting 0, each step once and bit-equal to the uninterrupted run's:
    # tests/test_soak.py, over the deepspeed runner and mpirun; this test's corpus data resumed bit-equal: job e)
    with ThreadPoolExecutor(1) as pool:  # meanwhile, `ds-longctx convert` killed with -9 (item 7)
        if full:
            os.unlink(os.path.join(mnt, "filler"))
            e = pool.submit(run_train, *common, "--steps", str(full_step(full) + 2), "--save", str(tmp_path / "ck_full"),
                            "--resume", "auto", "--metrics", full[2], timeout=400)
        n_workers, partial = _convert_killed_then_again(a_ck)
        e = e.result() if full else None
    assert n_workers >= 2
    # job a's metrics: each step once, equal to the uninterrupted run's (the same layout: the same arithmetic), the
    # grad norms too (the float64 norm sees a last-bit difference of the weights the float32 loss may round away)
    last = read_metrics(a_m)[-1]["step"]
    got = [(r["step"], r["loss"]) for r in read_metrics(a_m)]
    assert [s for s, _ in got] == list(range(1, last + 1)) and last <= len(reference), got
    assert all(loss == reference[s] for s, loss in got), (got, reference)
    norms = {r["step"]: r["grad_norm"] for r in read_metrics(c_m)}
    assert all(r["grad_norm"] == norms[r["step"]] for r in read_metrics(a_m)), (read_metrics(a_m), norms)

    if full:
        code, out, metrics = full
        step = full_step(full)
        assert code != 0, out[-3000:]
        assert f"ds_longctx: error: --metrics: {metrics!r}: could not write step {step}'s line (No space left on " \
               f"device, errno 28); the file holds steps up to {step - 1}, each line whole; step {step} is saved to " \
               in out and "Traceback" not in out, out[-3000:]
        # the resumed run continues after the saved step: that step's line (refused by the full disk) stays missing,
        # and is said; no step twice, no broken line
        got = {r["step"]: r["loss"] for r in read_metrics(metrics)}
        assert sorted(got) == [*range(1, step), step + 1, step + 2] and step + 2 <= len(reference), got
        assert got == {s: reference[s] for s in got}
        assert f"holds steps up to {step - 1}: steps {step}..{step} (trained before the checkpoint this run " \
               "resumes) have no line" in e.stdout, e.stdout[-3000:]


def _convert_killed_then_again(ck):
    """`ds-longctx convert` killed with -9 once its worker pool runs: no worker outlives it; the next conversion
    removes the partial directory and completes."""
    import psutil

    cmd = [sys.executable, "-c", "import sys; from ds_longctx.cli import main; sys.exit(main())", "convert", str(ck),
           "--workers", "4"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    parent, workers = psutil.Process(p.pid), []
    deadline = time.monotonic() + 240
    while len(workers) < 2 and p.poll() is None and time.monotonic() < deadline:
        try:  # the pool's forked workers (the same command line), not a helper command the imports run
            me = parent.cmdline()
            workers = [c for c in parent.children() if c.cmdline() == me]
        except psutil.NoSuchProcess:
            break
        time.sleep(0.005)
    if not workers:
        pytest.fail(f"the conversion ended before its workers could be seen: {p.communicate()[0][-2000:]!r}")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, [w.pid for w in alive]
    partial = [e for e in os.listdir(ck) if e.startswith(".tmp-") and ".universal-" in e]
    import socket

    tag = checkpoint.find_resume_tag(str(ck))[0]  # the killed one's directory (created here if it had not yet)
    os.makedirs(os.path.join(ck, f".tmp-{tag}.universal-{socket.gethostname()}-{p.pid}", "x"), exist_ok=True)
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert not [e for e in os.listdir(ck) if e.startswith(".tmp-")], (partial, os.listdir(ck))
    return len(workers), partial


def full_step(full):
    import re

    m = re.search(r"could not write step (\d+)'s line", full[1])
    assert m, full[1][-3000:]
    return int(m.group(1))


# --------------------------------------------------------------------------------------------------------------
# mpirun (pip's Open MPI 5: PRRTE's prterun) and the launch/*.sh scripts
# --------------------------------------------------------------------------------------------------------------

# a rank that says which signals reach it (standard library only: a launch takes ~1 s) and treats the first one as
# a graceful stop: it records it, 'saves' for 3 s (mpirun's SIGKILL follows its SIGTERM within about a second) and
# exits 0
_MPI_RANK = r"""
import os, signal, sys, time
rank, out = os.environ.get("OMPI_COMM_WORLD_RANK", "?"), sys.argv[1]
def say(what):
    with open(f"{out}.{rank}", "a") as fh:
        fh.write(what + "\n")
def on(s, f):
    say(signal.Signals(s).name)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(s, on)
say("ready")
t0 = time.monotonic()
while time.monotonic() - t0 < 60:
    time.sleep(0.05)
    if open(f"{out}.{rank}").read().split()[1:]:
        time.sleep(3)
        say("saved")
        os._exit(0)
os._exit(3)
"""


def _ready(path):
    """The stub rank wrote its first line (the file exists from the open() before the write: a signal handled
    between the two would write its line first)."""
    try:
        with open(path) as f:
            return f.read().startswith("ready\n")
    except FileNotFoundError:
        return False


def _mpi_case(tmp_path, name, wrapped, signals, target):
    """One mpirun job of two stub ranks; ``signals`` sent 0.3 s apart to the launcher's pid or its process group
    once both ranks are ready. Returns (exit code, {rank: lines}, seconds from the first signal to the exit)."""
    script = tmp_path / "mpi_rank.py"
    script.write_text(_MPI_RANK)
    out = str(tmp_path / name)
    mpirun = mpirun_command(2, [str(script), out])
    cmd = [sys.executable, PREEMPTIBLE, *mpirun] if wrapped else mpirun
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(_env(), MASTER_PORT="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all(_ready(f"{out}.{r}") for r in (0, 1)):  # its "ready" written whole: a signal before it
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-2000:]
            time.sleep(0.05)
        t0 = time.monotonic()
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.3)
            (os.killpg if target == "group" else os.kill)(p.pid, sig)
        log = p.communicate(timeout=60)[0].decode(errors="replace")
        took = time.monotonic() - t0
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = {}
    for r in (0, 1):
        with open(f"{out}.{r}") as f:
            lines[r] = f.read().split()[1:]
    return p.returncode, lines, took, log


def test_mpirun_signals_through_the_wrapper(tmp_path):
    """Open MPI's mpirun forwards SIGUSR1 to its ranks but kills them on SIGTERM/SIGINT (no handler of theirs runs,
    rc 1) and puts each rank in a process group of its own: the wrapper (ds-longctx launch mpirun ..., what
    launch/mpi.sh runs) turns the first SIGTERM, SIGINT or SIGUSR1, sent to its pid or its process group, into one
    SIGUSR1 per rank, and every process exits 0; a second SIGTERM ends the job at once."""
    from concurrent.futures import ThreadPoolExecutor

    cases = {"plain-term": (False, [signal.SIGTERM], "pid"), "plain-usr1": (False, [signal.SIGUSR1], "group"),
             "twice": (True, [signal.SIGTERM, signal.SIGTERM], "group")}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        for target in ("pid", "group"):
            cases[f"{sig.name}-{target}"] = (True, [sig], target)
    with ThreadPoolExecutor(len(cases)) as pool:  # stub ranks sleep: side by side
        got = dict(zip(cases, pool.map(lambda kv: _mpi_case(tmp_path, kv[0], *kv[1]), cases.items())))
    saved = {0: ["SIGUSR1", "saved"], 1: ["SIGUSR1", "saved"]}
    # plain mpirun: what the wrapper is for (SIGTERM: killed before the save; SIGUSR1 forwarded)
    code, lines, _, log = got.pop("plain-term")
    assert code != 0 and lines == {0: ["SIGTERM"], 1: ["SIGTERM"]}, (code, lines, log)
    code, lines, _, log = got.pop("plain-usr1")
    assert code == 0 and lines == saved, (code, lines, log)
    # a second SIGTERM: mpirun's own SIGTERM, the job ends now, before the 3 s save
    code, lines, took, log = got.pop("twice")
    assert code != 0 and "saved" not in lines[0] + lines[1], (code, took, lines, log)
    assert "received SIGTERM again: ending the job now" in log, log
    for name, (code, lines, _, log) in got.items():
        assert code == 0 and lines == saved, (name, code, lines, log)
        assert f"received {name.split('-')[0]}: asking the ranks to finish this step" in log, (name, log)


class _Job:
    """train.py on two ranks through one of the project's launch paths, in a session of its own:
    ``mpi`` launch/mpi.sh (mpirun through the wrapper), ``multi`` launch/multi_node.sh with a one-host hostfile (the
    deepspeed runner through the wrapper), ``slurm`` launch/slurm.sbatch's srun line (`python train.py "$@"` per
    task with the environment srun and the script set; SLURM signals the step's processes: each rank)."""

    def __init__(self, tmp_path, name, how, argv):
        port = str(free_port())
        self.name, self.how, self.log = name, how, tmp_path / f"{name}.log"
        env = dict(_env(), MASTER_PORT=port, NP="2")
        common = ["--deepspeed_config", TINY_CPU, "--no-progress", *argv]
        out = open(self.log, "w")
        if how == "slurm":
            self.procs = []
            for r in range(2):
                renv = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
                renv.update(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_NTASKS_PER_NODE="2",
                            SLURM_JOB_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1")
                self.procs.append(subprocess.Popen([sys.executable, TRAIN, *common], cwd=ROOT, env=renv, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            return
        if how == "multi":
            hostfile = tmp_path / f"{name}.hostfile"
            hostfile.write_text("localhost slots=2\n")
            # the runner checks `ssh localhost hostname` for any hostfile (no sshd here): a stand-in that answers it
            # (one host: the runner starts launch.py itself, no pdsh)
            bin_dir = tmp_path / "bin"
            bin_dir.mkdir(exist_ok=True)
            (bin_dir / "ssh").write_text("#!/bin/sh\nexec hostname\n")
            (bin_dir / "ssh").chmod(0o755)
            env.update(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", PATH=f"{bin_dir}:{env['PATH']}")
        script = {"mpi": "launch/mpi.sh", "multi": "launch/multi_node.sh"}[how]
        self.procs = [subprocess.Popen(["bash", os.path.join(ROOT, script), *common], cwd=ROOT, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)]

    def signal_after(self, metrics, n, sig, target, timeout=400):
        """``sig`` to the launcher's pid or its process group (slurm: to every rank) once ``metrics`` holds ``n``
        steps; returns the exit codes and the output once every process ended."""
        deadline = time.monotonic() + timeout
        try:
            while _steps(metrics) < n:
                assert all(p.poll() is None for p in self.procs) and time.monotonic() < deadline, self.output()
                time.sleep(0.1)
            for p in self.procs:
                (os.killpg if target == "group" else os.kill)(p.pid, sig)
            codes = [p.wait(timeout=300) for p in self.procs]
            for p in self.procs:  # no process of the job left behind
                while True:
                    try:
                        os.killpg(p.pid, 0)
                    except ProcessLookupError:
                        break
                    assert time.monotonic() < deadline + 120, self.output()
                    time.sleep(0.1)
        finally:
            for p in self.procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return codes, self.output()

    def output(self):
        return open(self.log).read()[-4000:]


def test_preemption_under_mpi_sh_slurm_srun_and_multi_node_sh(tmp_path, copy_reference):
    """Each launch path the project ships, preempted as its scheduler does, then resumed: every process exits 0, the
    stopped step is saved and `latest` names it, and the stopped-and-resumed job's steps equal an uninterrupted
    run's (bit-equal: one layout; tests/conftest.py copy_reference). Two rounds of jobs side by side:
    round 1: launch/mpi.sh, SIGTERM to its process group; the srun line, SIGUSR1 to every rank (`--signal=USR1@900`);
    round 2: both resumed (--resume auto): launch/mpi.sh, SIGINT to its pid; the srun line, SIGINT to every rank
    (srun forwards Ctrl-C); launch/multi_node.sh (one-host hostfile), SIGUSR1 to its pid.
    (the deepspeed runner: test_preemption_through_the_deepspeed_runner; ds-longctx launch: tests/test_soak.py;
    mpirun's signal delivery for every signal x target and a second SIGTERM: test_mpirun_signals_through_the_wrapper)"""
    from concurrent.futures import ThreadPoolExecutor

    common = [*REFERENCE_ARGS, "--steps", "40"]  # the shared uninterrupted run's command line (copy_reference)

    def job(name, how, n, sig, target, resume=False):
        ck, m = tmp_path / f"ck_{name.split('.')[0]}", tmp_path / f"{name.split('.')[0]}.jsonl"
        j = _Job(tmp_path, name, how, [*common, "--save", str(ck), "--metrics", str(m),
                                       *(["--resume", "auto"] if resume else [])])
        start = read_metrics(m)[-1]["step"] if resume else 0
        codes, out = j.signal_after(m, start + n, sig, target)
        return name, sig, codes, out, ck, read_metrics(m), checkpoint.find_resume_tag(str(ck))[0]

    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(job, "mpi", "mpi", 2, signal.SIGTERM, "group"),
                 pool.submit(job, "slurm", "slurm", 2, signal.SIGUSR1, "pid")]
        first = [f.result() for f in first]
    with ThreadPoolExecutor(3) as pool:
        second = [pool.submit(job, "mpi.2", "mpi", 2, signal.SIGINT, "pid", True),
                  pool.submit(job, "slurm.2", "slurm", 2, signal.SIGINT, "pid", True),
                  pool.submit(job, "multi", "multi", 2, signal.SIGUSR1, "pid")]
        second = [f.result() for f in second]
    reference = dict(enumerate(copy_reference["losses"], 1))
    ranks_saw = {"mpi": "SIGUSR1", "multi": "SIGUSR1"}  # the wrapper's request (mpirun's, the runner group's copy)
    for name, sig, codes, out, ck, records, tag in first + second:
        steps = [r["step"] for r in records]
        last = steps[-1]
        assert codes == [0] * len(codes), (name, codes, out)
        saw = ranks_saw.get(name.split(".")[0], sig.name)
        for r in (0, 1):
            assert f"[rank {r}] ds_longctx: received {saw}: finishing this step, saving a checkpoint" in out, (name, out)
        assert f"stopped after step {last} on {saw}: saved" in out, (name, out)
        assert not _ended_nonzero(out) and "Traceback" not in out, (name, out)
        assert tag == f"step{last}", (name, tag, last)
        if name.endswith(".2") or name == "multi":  # the stopped (and resumed) job's steps, each once
            got = [(r["step"], r["loss"]) for r in records]
            assert steps == list(range(1, last + 1)) and last <= REFERENCE_STEPS, (name, got)
            assert all(loss == reference[s] for s, loss in got), (name, got, reference)
