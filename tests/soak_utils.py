"""A chaos soak: one training run of the CPU demo hit by faults in sequence, each restart the same command line with
``--resume auto`` (what a requeued job runs), checked after every start and at the end (issue 52). Used by
tests/test_soak.py (a short sequence per launcher) and bench/chaos_soak.py (a long one at random steps).

Faults (``FAULTS``): ``kill_rank`` (SIGKILL to rank 1), ``sigusr1`` / ``sigterm`` (to the ``ds-longctx launch``
wrapper's process group, as a scheduler sends them), ``kill_wrapper`` (SIGKILL to the wrapper), ``disk_full`` (the
save directory's filesystem filled by rank 1 while it writes its first file of a save: a real ENOSPC; the filler is
removed before the next start, as an operator frees space), ``freeze_rank`` (SIGSTOP to rank 1: the watchdog ends
the job), ``corrupt`` (between two starts, 64 bytes of the newest tag's rank-0 optimizer states flipped in place).

What a soak holds (:meth:`Soak.check_start` after every start, :meth:`Soak.final` at the end): no process of the run
left (its command line names the run's directory), at most ``--keep-last`` + 1 tags in the save directory, no
``.tmp-`` entry once the run finished, every step 1..N in --metrics once with the uninterrupted run's loss (bit-equal)
and the final ``--save-hf`` weights bit-equal to the uninterrupted run's.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from dist_utils import free_port
from launch_utils import REFERENCE_ARGS, ROOT, TINY_CPU, TRAIN, _env, mpirun_command

FAULTS = ("kill_rank", "sigusr1", "sigterm", "kill_wrapper", "disk_full", "freeze_rank", "corrupt")
WATCHDOG_S = 10          # long_context.watchdog.timeout_s of the soak's config: a frozen rank ends the job in ~10 s
FILL_ENV = "DS_LONGCTX_TEST_FILL_AT"
FILLER = ".ds_longctx-test-filler"


@contextlib.contextmanager
def tmpfs(path: str, size: str = "16m"):
    """A small tmpfs mounted at ``path`` (the disk_full fault fills the save directory's filesystem: never a real
    disk), or None where this user cannot mount one."""
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if p.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def soak_config(path: str, watchdog_s: Optional[int] = None) -> str:
    """tiny-cpu.json, with ``long_context.watchdog.timeout_s`` when given (only the start that freezes a rank: on a
    loaded 2-core box a short timeout could end another start whose heartbeat thread waited on a long import)."""
    cfg = json.load(open(TINY_CPU))
    if watchdog_s:
        cfg.setdefault("long_context", {})["watchdog"] = {"timeout_s": watchdog_s}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def run_args(steps: int, save: str, metrics: str, hf: str, save_every: int = 2, keep_last: int = 2) -> List[str]:
    """The soak's command line: tests/launch_utils.py's REFERENCE_ARGS (the shared uninterrupted run's), and its
    saves, resume and export."""
    return [*REFERENCE_ARGS, "--no-progress", "--steps", str(steps), "--save", save, "--save-every", str(save_every),
            "--keep-last", str(keep_last),            "--resume", "auto", "--metrics", metrics, "--save-hf", hf]


def procs_of(marker: str) -> List[int]:
    """Pids of live (not zombie) processes whose command line holds ``marker``, this process excluded."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and marker.encode() in cmd:
            out.append(int(d))
    return out


def rank_pid(marker: str, rank: int) -> Optional[int]:
    """The train.py process of ``rank`` (RANK under the deepspeed launcher, OMPI_COMM_WORLD_RANK under mpirun)."""
    for pid in procs_of(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if not any(c.endswith(b"train.py") for c in cmd):
            continue
        r = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"RANK"))
        if r is not None and int(r) == rank:
            return pid
    return None


def ended_nonzero(out: str) -> bool:
    """A rank ended before or without its save ("ending this rank (exit 143)"); one that learns of its launcher's
    exit after the graceful stop's save ends with 0 and says so."""
    import re

    return re.search(r"ending this rank[^\n]*\(exit (?!0\))", out) is not None


def flip(path: str, n: int = 64) -> None:
    """``n`` bytes in the middle of ``path`` inverted in place (the size unchanged)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def metrics_steps(path: str) -> List[int]:
    try:
        with open(path) as f:
            return [json.loads(line)["step"] for line in f if line.strip()]
    except FileNotFoundError:
        return []


def newest_tag(save: str) -> Optional[str]:
    try:
        return open(os.path.join(save, "latest")).read().strip()
    except OSError:
        return None


def tags_in(save: str) -> List[str]:
    return sorted(e for e in os.listdir(save) if e.startswith("step") and os.path.isdir(os.path.join(save, e)))


@dataclass
class Start:
    fault: Optional[str]
    at_step: Optional[int]
    code: Optional[int] = None
    seconds: float = 0.0
    first_step: Optional[int] = None
    last_step: Optional[int] = None
    log: str = ""
    notes: List[str] = field(default_factory=list)
    corrupted: Optional[str] = None   # the file flipped before this start
    resumed_at: Optional[int] = None  # the step of the tag this start resumed from (None: from step 1)


class Soak:
    """One run (``root``: its directory; the save directory ``save`` may be elsewhere, e.g. on a small tmpfs)."""

    def __init__(self, root: str, steps: int, launcher: str = "deepspeed", save: Optional[str] = None,
                 keep_last: int = 2, save_every: int = 2, can_fill: bool = False):
        """``save``: the save directory (default: ``root/ck``); ``can_fill``: it is on a small filesystem of its own
        (:func:`tmpfs`), so that the disk_full fault may fill it (otherwise that fault is skipped, and said)."""
        assert launcher in ("deepspeed", "mpirun")
        self.root, self.steps, self.launcher, self.keep_last = root, steps, launcher, keep_last
        self.save_every = save_every
        self.can_fill = can_fill
        self.skipped: List[str] = []
        os.makedirs(root, exist_ok=True)
        self.save = save or os.path.join(root, "ck")
        self.metrics, self.hf = os.path.join(root, "m.jsonl"), os.path.join(root, "hf")
        self.config = soak_config(os.path.join(root, "soak.json"))
        self.freeze_config = soak_config(os.path.join(root, "soak_watchdog.json"), WATCHDOG_S)
        self.args = run_args(steps, self.save, self.metrics, self.hf, save_every, keep_last)
        self.starts: List[Start] = []
        self.problems: List[str] = []

    # ---- one start ----------------------------------------------------------------------------
    def _command(self, fault: Optional[str]) -> Tuple[List[str], dict]:
        launch = [sys.executable, "-m", "ds_longctx.cli", "launch"]
        env = _env()
        config = self.freeze_config if fault == "freeze_rank" else self.config
        if self.launcher == "deepspeed":
            cmd = [*launch, "--num_gpus", "2", "--master_port", str(free_port()), TRAIN, "--deepspeed_config",
                   config, *self.args]
        else:
            env["MASTER_PORT"] = str(free_port())
            cmd = [*launch, *mpirun_command(2, [TRAIN, "--deepspeed_config", config, *self.args])]
        return cmd, env

    def start(self, fault: Optional[str] = None, after: int = 2, timeout: float = 300, corrupt: bool = False) -> Start:
        """Start the run; with ``fault``, inject it once the run logged ``after`` steps past its resume point
        (``disk_full``: the first save from there fails). ``corrupt`` (or ``fault`` "corrupt", then no other):
        before the start, the newest tag's rank-0 optimizer states get a byte flip. Returns when every process of
        the start has ended."""
        flipped = None
        if corrupt or fault == "corrupt":
            tag = newest_tag(self.save)
            if tag is not None and os.path.isdir(os.path.join(self.save, tag)):
                flipped = os.path.join(self.save, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
                flip(flipped)
        done = metrics_steps(self.metrics)
        begin = done[-1] if done else 0
        s = Start(fault, None)
        s.corrupted = flipped
        cmd, env = self._command(fault)
        if fault == "disk_full":
            # the first save at or after begin + after: rank 1 fills the filesystem after its first file
            step = begin + after
            step += (-step) % 2
            env[FILL_ENV] = f"1:after_file1@{step}"
            s.at_step = step
        log_path = os.path.join(self.root, f"start{len(self.starts) + 1}.log")
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            if fault in ("kill_rank", "sigusr1", "sigterm", "kill_wrapper", "freeze_rank"):
                # the ranks are found while they start; once the run logged its target step both are stopped
                # (SIGSTOP) while the fault is injected and continued after: a loaded box delays this process's
                # polling by steps, the stop holds the run within one step of the target
                target = begin + after
                deadline = time.monotonic() + timeout
                ranks: Dict[int, int] = {}
                while True:
                    for r in (0, 1):
                        if r not in ranks:
                            pid = rank_pid(self.root, r)
                            if pid:
                                ranks[r] = pid
                    steps = metrics_steps(self.metrics)
                    if len(ranks) == 2 and steps and steps[-1] >= target:
                        break
                    if p.poll() is not None:  # ended on its own before the fault: said, the caller tries again
                        s.notes.append("ended before its fault")
                        break
                    assert time.monotonic() < deadline, open(log_path).read()[-3000:]
                    time.sleep(0.05)
                if not s.notes:
                    for pid in ranks.values():
                        os.kill(pid, signal.SIGSTOP)
                    s.at_step = metrics_steps(self.metrics)[-1]
                    go_on = [ranks[0], ranks[1]]
                    if fault in ("kill_rank", "freeze_rank"):
                        go_on = [ranks[0]]
                        if fault == "kill_rank":
                            os.kill(ranks[1], signal.SIGKILL)
                    elif fault == "kill_wrapper":
                        os.kill(p.pid, signal.SIGKILL)
                    else:
                        os.killpg(p.pid, signal.SIGUSR1 if fault == "sigusr1" else signal.SIGTERM)
                        time.sleep(0.2)  # the wrapper sends it on to the ranks (pending while they are stopped)
                    for pid in go_on:
                        os.kill(pid, signal.SIGCONT)
            s.code = p.wait(timeout=timeout)
            deadline = time.monotonic() + 60  # the ranks outlive a wrapper killed with -9 by a step and a save
            while procs_of(self.root) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            left = procs_of(self.root)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if p.poll() is None:
                p.kill()
                p.wait()
        s.seconds = time.monotonic() - t0
        s.log = open(log_path).read()
        if left:
            self.problems.append(f"start {len(self.starts) + 1} ({fault}): processes left: {left}")
        if fault == "disk_full":
            try:
                os.remove(os.path.join(self.save, FILLER))
            except FileNotFoundError:
                self.problems.append(f"start {len(self.starts) + 1} (disk_full): no filler file: the save of step "
                                     f"{s.at_step} did not fill the disk")
        steps = metrics_steps(self.metrics)
        s.first_step, s.last_step = begin + 1, (steps[-1] if steps else 0)
        import re

        m = re.search(r"resumed from \S+ \(step (\d+),", s.log)
        s.resumed_at = int(m.group(1)) if m else (0 if "starting at step 1" in s.log else None)
        self.starts.append(s)
        self.check_start(s)
        return s

    def check_start(self, s: Start) -> None:
        n = len(self.starts)
        tags = tags_in(self.save) if os.path.isdir(self.save) else []
        if len(tags) > self.keep_last + 1:
            self.problems.append(f"start {n} ({s.fault}): {len(tags)} tags {tags} > --keep-last {self.keep_last} + 1")
        if "Traceback" in s.log:
            self.problems.append(f"start {n} ({s.fault}): a traceback:\n{s.log[-2000:]}")
        if s.corrupted and f"{s.corrupted!r} does not match its checksum" not in s.log:
            self.problems.append(f"start {n} ({s.fault}): the flipped {s.corrupted} was not named:\n{s.log[-2000:]}")
        if s.fault in ("sigusr1", "sigterm") and not s.notes:
            # a scheduler's signal to `ds-longctx launch`'s process group: the wrapper asks the ranks (SIGUSR1), they
            # finish the step, save it ('latest' names it) and every process exits 0 (the deepspeed runner's
            # launch.py: both ranks "exit successfully"); no rank ends before its save
            said = [f"ds-longctx launch: received {s.fault.upper()}: asking the ranks to finish this step, save a "
                    "checkpoint", f"stopped after step {s.last_step} on SIGUSR1: saved"]
            if self.launcher == "deepspeed" and s.log.count("exits successfully") != 2:
                said.append("launch.py: 2 x 'exits successfully'")
            missing = [m for m in said if m not in s.log]
            if s.code != 0 or missing or ended_nonzero(s.log) or newest_tag(self.save) != f"step{s.last_step}":
                self.problems.append(f"start {n} ({s.fault}): exit {s.code}, 'latest' {newest_tag(self.save)!r}, "
                                     f"missing {missing}:\n{s.log[-3000:]}")

    def run(self, plan: List[Tuple[Optional[str], int]], timeout: float = 300) -> None:
        """Each (fault, steps after the resume point) in turn, then starts without a fault until the run ends."""
        pending = False  # a "corrupt" fault: applied before the next start, which carries the plan's next fault
        for fault, after in plan:
            if fault == "disk_full" and not self.can_fill:
                self.skipped.append("disk_full: the save directory is not on a filesystem of its own (no tmpfs here)")
                continue
            if fault == "corrupt":
                if newest_tag(self.save) is None:
                    self.skipped.append("corrupt: drawn before the first save (no tag to damage)")
                else:
                    pending = True
                continue
            if metrics_steps(self.metrics)[-1:] == [self.steps]:
                self.skipped.append(f"{fault}: the run had ended")
                continue
            for _ in range(3):  # a start that ended before its fault (a slow box): the fault on the next start
                s = self.start(fault, after, timeout=timeout, corrupt=pending)
                pending = False
                if not s.notes:
                    break
                self.problems.append(f"start {len(self.starts)} ({fault}) ended (exit {s.code}) before its fault "
                                     f"could be injected:\n{s.log[-3000:]}")
        for _ in range(3):
            if not pending and metrics_steps(self.metrics)[-1:] == [self.steps] and os.path.isdir(self.hf):
                break
            s = self.start(None, timeout=timeout, corrupt=pending)
            pending = False
            if s.code != 0:
                self.problems.append(f"start {len(self.starts)} (no fault) exited {s.code}:\n{s.log[-3000:]}")

    # ---- the end --------------------------------------------------------------------------------
    def final(self, reference_metrics: str, reference_hf: str) -> Dict[str, object]:
        """The soak's verdict against the uninterrupted run: problems (empty = passed) and the figures."""
        import torch
        from safetensors.torch import load_file

        problems = list(self.problems)
        with open(self.metrics) as f:
            got = [json.loads(line) for line in f if line.strip()]
        with open(reference_metrics) as f:
            ref = {r["step"]: r for r in map(json.loads, f)}
        steps = [r["step"] for r in got]
        if steps != list(range(1, self.steps + 1)):
            problems.append(f"--metrics steps are not 1..{self.steps} once each: {steps}")
        bit_equal = {}
        for key in ("loss", "grad_norm"):  # the float64 grad norm sees a last-bit difference the float32 loss rounds away
            off = [(r["step"], r[key], ref.get(r["step"], {}).get(key)) for r in got
                   if r[key] != ref.get(r["step"], {}).get(key)]
            bit_equal[key] = not off
            if off:
                problems.append(f"{key} differs from the uninterrupted run's at {len(off)} steps: {off[:5]}")
        # the last start saved at its end (step N, also when N is no multiple of --save-every) and pruned to
        # --keep-last tags
        saves = sorted(set(range(self.save_every, self.steps + 1, self.save_every) if self.save_every else ()) |
                       {self.steps})
        want = [f"step{s}" for s in saves[-self.keep_last:]] if self.keep_last else [f"step{s}" for s in saves]
        if newest_tag(self.save) != f"step{self.steps}" or sorted(tags_in(self.save)) != sorted(want):
            problems.append(f"the save directory ends with 'latest' {newest_tag(self.save)!r} and tags "
                            f"{tags_in(self.save)}, not step{self.steps} and {want}")
        equal = None
        if os.path.isdir(self.hf):
            a = load_file(os.path.join(self.hf, "model.safetensors"))
            b = load_file(os.path.join(reference_hf, "model.safetensors"))
            equal = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
            if not equal:
                problems.append("the final --save-hf weights differ from the uninterrupted run's")
        else:
            problems.append("no --save-hf directory at the end")
        tmp = [e for e in os.listdir(self.save) if e.startswith(".tmp-")]
        if tmp:
            problems.append(f"temporary entries left in the save directory: {tmp}")
        faults = [f for s in self.starts for f in (["corrupt"] if s.corrupted else []) + ([s.fault] if s.fault else [])]
        return {"problems": problems, "starts": len(self.starts), "skipped": self.skipped, "steps": self.steps,
                "faults": faults, "weights_bit_equal": equal, "losses_bit_equal": bit_equal["loss"],
                "grad_norms_bit_equal": bit_equal["grad_norm"], "latest": newest_tag(self.save),
                "tags": tags_in(self.save),
                "seconds": sum(s.seconds for s in self.starts),
                "per_start": [{"fault": s.fault, "corrupted_before": bool(s.corrupted), "at_step": s.at_step,
                               "resumed_at": s.resumed_at,
                               "code": s.code, "seconds": round(s.seconds, 1), "steps": [s.first_step, s.last_step]}
                              for s in self.starts]}


def reference_run(root: str, steps: int, launcher: str = "deepspeed", timeout: float = 600) -> Tuple[str, str]:
    """The uninterrupted run of the same command line (no --save): (its metrics, its --save-hf directory)."""
    from launch_utils import run_train

    os.makedirs(root, exist_ok=True)
    metrics, hf = os.path.join(root, "ref.jsonl"), os.path.join(root, "ref_hf")
    shutil.rmtree(hf, ignore_errors=True)
    args = run_args(steps, os.path.join(root, "ref_ck"), metrics, hf, save_every=0, keep_last=0)
    # no periodic saves: the reference saves once at its end (--save is needed by --resume auto's flag set)
    run_train(*[a for a in args if a != "--no-progress"], config=soak_config(os.path.join(root, "ref.json")),
              launcher=launcher, timeout=timeout)
    return metrics, hf
