"""The per-step record of a training run and where it goes: a JSON-lines file, DeepSpeed's monitor (the
ds_config's ``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet`` sections, through ``engine.monitor``), and
the console (a progress bar on a terminal; one plain line every N steps otherwise, e.g. under SLURM or nohup).

:func:`step_record` builds the record from what the step measured (job/profiler.StepProfiler) and the
engine; :class:`StepLog` sends it. Rank 0 writes; every rank may call.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, Optional

from ..planner.rates import target_rates
from ..planner.units import fmt_bytes

# the record's numeric fields sent to DeepSpeed's monitor, as "Train/ds_longctx/<field>" (step as x)
MONITOR_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes",
                  "peak_reserved_bytes", "host_rss_bytes", "step_time_s", "eval_loss", "eval_perplexity")
MONITOR_PREFIX = "Train/ds_longctx/"


def host_rss_bytes() -> Optional[int]:
    """Current (not peak) resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def peak_tflops(dtype: str) -> Optional[float]:
    """The MFU denominator: the datasheet's dense bf16/fp16 TFLOP/s of this CUDA device when the planner knows
    it (planner/rates.py: H100, H200), else None (no MFU: a CPU, an unknown card, fp32 training)."""
    import torch

    if dtype not in ("bf16", "fp16") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    for target in ("h200", "h100"):
        if target in name:
            return target_rates(target).peak_tflops
    return None


def step_record(step: int, loss: float, prof: Dict[str, Any], engine, tokens: int, peak: Optional[float]) -> dict:
    """One step's record. ``prof``: StepProfiler.end_step's (time, TFLOP/s per GPU, peak memory); ``tokens``:
    the job's tokens this step (every data-parallel replica); ``peak``: :func:`peak_tflops`."""
    dt = prof["step_time_s"]
    lr = engine.get_lr()
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        grad_norm = float(grad_norm)
    rec = {"step": step, "loss": loss, "lr": lr[0] if lr else None, "grad_norm": grad_norm, "tokens": tokens,
           "tokens_per_s": tokens / dt if dt > 0 else 0.0, "tflops": prof["tflops_per_gpu"],
           "mfu": prof["tflops_per_gpu"] / peak if peak else None, "peak_mem_bytes": prof["peak_memory_bytes"],
           "host_rss_bytes": host_rss_bytes(), "step_time_s": dt}
    for key in ("peak_reserved_bytes", "artifacts", "allocator_model", "flops_by_category"):
        if key in prof:
            rec["profile_artifacts" if key == "artifacts" else key] = prof[key]
    return rec


def _fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def plain_line(rec: dict, total: int, eta_s: Optional[float] = None) -> str:
    """The one-line summary of a step (logs, SLURM output)."""
    parts = [f"step {rec['step']}/{total}", f"loss {rec['loss']:.4f}"]
    if rec.get("lr") is not None:
        parts.append(f"lr {rec['lr']:.3g}")
    if rec.get("grad_norm") is not None:
        parts.append(f"grad norm {rec['grad_norm']:.3g}")
    parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    tf = rec["tflops"]
    per = "GPU" if _cuda() else "rank"  # a CPU run has no GPU to divide by
    parts.append(f"{tf:.1f} TFLOP/s/{per}" if tf >= 1 else f"{tf * 1e3:.2f} GFLOP/s/{per}")
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    parts.append(f"peak {fmt_bytes(rec['peak_mem_bytes'])}")
    if rec.get("peak_reserved_bytes") is not None:
        parts.append(f"reserved {fmt_bytes(rec['peak_reserved_bytes'])}")
    parts.append(f"{rec['step_time_s']:.3g} s/step")
    if eta_s is not None:
        parts.append(f"eta {_fmt_duration(eta_s)}")
    return " | ".join(parts)


def truncate_metrics(path: str, step: int) -> int:
    """Cut the JSON-lines file ``path`` at its first line that is not a whole record of a step <= ``step``: a resume
    from ``step`` then appends no duplicate of a step the stopped run logged past its checkpoint, and no line
    follows a broken one (a write cut by a kill or a full disk). Shrinks in place (needs no free space). Returns
    the size kept and the last step kept (0: none)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0, 0
    keep = last = 0
    with f:
        for line in f:
            try:
                rec = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or rec["step"] > step:
                break
            keep, last = keep + len(line), rec["step"]
    if keep != os.path.getsize(path):
        os.truncate(path, keep)
    return keep, last


class StepLog:
    """Sends each step's record to the JSON-lines file (``metrics_path``; appended on a resume), DeepSpeed's
    monitor (when the ds_config enables one) and the console: a tqdm bar when stdout is a terminal (unless
    ``progress`` is False), otherwise ``print_line`` every ``log_every`` steps and at the last step."""

    def __init__(self, engine, total_steps: int, start_step: int = 0, metrics_path: Optional[str] = None,
                 append: bool = False, log_every: int = 10, progress: bool = True, rank: int = 0,
                 print_line=print):
        self.rank, self.total, self.log_every, self.print_line = rank, total_steps, log_every, print_line
        self.monitor = getattr(engine, "monitor", None)
        if self.monitor is not None and not getattr(self.monitor, "enabled", False):
            self.monitor = None
        # a raw descriptor (no buffer): a failed write is known at that step, and truncating to the last whole
        # line (no space needed) leaves no broken line
        self.path, self.file, self.failed, self._good = metrics_path, None, None, 0
        if metrics_path and rank == 0:
            if append:
                self._good, last = truncate_metrics(metrics_path, start_step)
                if 0 < last < start_step:  # e.g. the step whose line a full disk refused (that run saved it)
                    print_line(f"--metrics {metrics_path!r} holds steps up to {last}: steps {last + 1}..{start_step} "
                               "(trained before the checkpoint this run resumes) have no line")
            self.file = os.open(metrics_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC),
                                0o644)
            self._good = os.lseek(self.file, 0, os.SEEK_END)
        self.bar = None
        if rank == 0 and progress and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stdout,
                            mininterval=1.0)
        self._t0, self._start = time.monotonic(), start_step

    def step(self, rec: dict) -> None:
        if self.rank != 0:
            return
        if self.file is not None:
            self._write(rec)
        self.events(rec)
        if self.bar is not None:
            tf = rec["tflops"]
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                 flops=f"{tf:.1f}T/s" if tf >= 1 else f"{tf * 1e3:.1f}G/s",
                                 peak=f"{rec['peak_mem_bytes'] / 2**20:.0f}MiB")
            self.bar.update(1)
        elif self.log_every and (rec["step"] % self.log_every == 0 or rec["step"] == self.total):
            done = rec["step"] - self._start
            per = (time.monotonic() - self._t0) / done if done > 0 else None
            self.print_line(plain_line(rec, self.total, per * (self.total - rec["step"]) if per else None))

    def _write(self, rec: dict) -> None:
        """One line; on a failure (ENOSPC, EIO, a quota) the file is cut back to its last whole line, closed, and
        :attr:`failed` says why: the training loop saves this step and ends the job naming the file."""
        data = (json.dumps(rec) + "\n").encode()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.file, view):]
            self._good += len(data)
        except OSError as e:
            try:
                os.ftruncate(self.file, self._good)
            except OSError:
                pass
            self._close_file()
            self.failed = (f"{self.path!r}: could not write step {rec['step']}'s line ({e.strerror or e}, errno "
                           f"{e.errno}); the file holds steps up to {rec['step'] - 1}, each line whole")
            self.print_line(f"--metrics {self.failed}")

    def _close_file(self) -> None:
        if self.file is not None:
            try:
                os.close(self.file)
            except OSError:
                pass
            self.file = None

    def events(self, rec: dict) -> None:
        """``rec``'s numeric fields to DeepSpeed's monitor at x = the step (rank 0)."""
        if self.monitor is None or self.rank != 0:
            return
        events = [(MONITOR_PREFIX + k, float(rec[k]), int(rec["step"])) for k in MONITOR_FIELDS
                  if isinstance(rec.get(k), (int, float)) and not isinstance(rec.get(k), bool)]
        if events:
            self.monitor.write_events(events)

    def note(self, text: str) -> None:
        """A line that must not break the bar (saves, evaluations)."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            self.print_line(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._close_file()
        if self.monitor is not None and self.rank == 0:
            for m in ("tb_monitor", "csv_monitor", "wandb_monitor", "comet_monitor"):
                mon = getattr(self.monitor, m, None)
                flush = getattr(getattr(mon, "summary_writer", None), "flush", None)
                if flush is not None:
                    flush()
