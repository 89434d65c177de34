"""Per-step time, throughput, TFLOPs and peak memory, plus profiler artifacts for chosen steps.

The train loop calls ``start_step(step)`` before the forward and ``end_step(step, tokens)`` after the
optimizer step, and stores the returned dict in its metrics file. With ``long_context.profile.enabled``
the steps listed in ``profile.steps`` also write, under ``profile.output_dir``:

- ``trace_rank{r}_step{s}.json``: a torch.profiler Chrome trace (CPU, and CUDA when present);
- ``memory_snapshot_rank{r}_step{s}.pickle`` (CUDA only): ``torch.cuda.memory._dump_snapshot``, open it
  at https://pytorch.org/memory_viz;
- ``memory_rank{r}_step{s}.png`` (and ``.csv``): device memory sampled over the step (CUDA: allocated
  bytes; CPU: process RSS). The PNG needs matplotlib; without it only the CSV is written.

TFLOPs per GPU = (ds_longctx.measure.formula: dense + attention) x samples / C / step_seconds / 1e12, for an SP
group of C ranks.

Where the step goes (profiled steps, when ``plan_work`` is given): the step's ops are counted as the
planner counts its fake step (measure/flops.WorkCounter: torch's FLOP formulas + the attention ops'
causal-aware ones, by kind and phase: attention forward / backward / recompute, GEMMs forward / backward /
recompute, other ops' bytes, all-to-all bytes, calls), and put next to the planner's counts for the same
config and length (``plan_work(seq_len)``, e.g. ``functools.partial(ds_longctx.planner.planned_work,
ds_config, model_config, world_size)``; ``rec["flops_by_category"]``: measured, planned, measured / planned per category;
``format_flops`` prints it). These are executed FLOPs (recompute included), not the MFU formula below.

train.py reports it. ``tokens`` given to ``end_step``
is the global tokens the rank's SP group processed this step (sequence length x samples); tokens/s is
reported per GPU (divided by C), as UPipe and ALST do.
"""
from __future__ import annotations

import json
import os
import threading
import time
import torch
from typing import Any, Callable, Dict, List, Optional

from ..memory.checkpointing import around_checkpointed_runs
from ..models import attention_shape, text_config
from ..measure.allocator import check_step
from ..measure.flops import WorkCounter, by_category
from ..measure.formula import config_value, attention_layers, attention_width, count_params, flops_per_sample


class _Sampler(threading.Thread):
    """Samples device memory every ``interval`` seconds while a profiled step runs."""

    def __init__(self, cuda: bool, interval: float = 0.005):
        super().__init__(daemon=True)
        self.cuda, self.interval = cuda, interval
        self.samples: List[tuple] = []
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    def _read(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        import psutil

        return psutil.Process().memory_info().rss

    def run(self):
        while not self._halt.is_set():
            self.samples.append((time.perf_counter() - self.t0, self._read()))
            self._halt.wait(self.interval)

    def stop(self):
        self._halt.set()
        self.join(timeout=1.0)
        self.samples.append((time.perf_counter() - self.t0, self._read()))


class StepProfiler:
    """See the module doc. ``model_config``: the HF config (for FLOPs); ``model``: optional, for the
    exact parameter count (else estimated from the config); ``tracker``: a LiveBytesTracker whose peak
    is reported on CPU instead of RSS."""

    def __init__(self, cfg=None, model_config=None, world_size: int = 1, sp_size: int = 1, rank: int = 0,
                 model=None, tracker=None, device: Optional[str] = None, seq_len: Optional[int] = None,
                 plan_work: Optional[Callable[[int], dict]] = None):
        self.enabled = bool(config_value(cfg, "enabled", False))
        self.steps = set(int(s) for s in (config_value(cfg, "steps", []) or []))
        self.output_dir = config_value(cfg, "output_dir", "profiles")
        self.world_size, self.sp, self.rank = world_size, max(1, sp_size), rank
        self.tracker = tracker
        self.cuda = (device == "cuda") if device is not None else torch.cuda.is_available()
        tc = text_config(model_config) if model_config is not None else None
        self.num_layers = attention_layers(tc) if tc is not None else 0  # the S^2 term's layers
        self.attn_width = attention_width(tc) if tc is not None else 0
        self.seq_len = seq_len  # tokens per sample; None: every step is one sample
        if model is not None:
            c = count_params(model)
            self.n_params = c["total"] - c["embedding"]
        else:
            self.n_params = self._estimate_params(tc)
        self._t0 = None
        self._prof = None
        self._sampler = None
        self._snapshot = False
        self.allocator_check = bool(config_value(cfg, "allocator_check", False))
        if self.allocator_check and not self.cuda:
            raise ValueError("profile.allocator_check replays CUDA allocations: it needs a CUDA device")
        self._alloc_start = None
        self.history: List[Dict[str, Any]] = []
        self.plan_work = plan_work
        self._counter = None
        self._planned: Dict[int, dict] = {}  # tokens per sample -> the planner's counts

    @staticmethod
    def _estimate_params(tc) -> int:
        if tc is None:
            return 0
        h, L = tc.hidden_size, tc.num_hidden_layers
        shape = attention_shape(tc)
        heads, d, kv = shape.heads, shape.head_dim, shape.kv_heads
        inter = getattr(tc, "intermediate_size", 4 * h)
        per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h
        return L * per_layer + h + tc.vocab_size * h  # + final norm + lm_head

    def _profiled(self, step: int) -> bool:
        return self.enabled and step in self.steps

    def start_step(self, step: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self.tracker is not None:
            self.tracker.reset_peak()
        if self.allocator_check and step in self.steps:
            # the allocator's state before the step, then its trace over the step (measure/allocator.check_step)
            self._alloc_start = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
        if self._profiled(step):
            os.makedirs(self.output_dir, exist_ok=True)
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=200000)
                self._snapshot = True
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=False)
            self._prof.__enter__()
            self._sampler = _Sampler(self.cuda)
            self._sampler.start()
            if self.plan_work is not None:
                self._counter = WorkCounter()
                self._seam = around_checkpointed_runs(self._counter.layer_run)  # recomputes told apart
                self._seam.__enter__()
                self._counter.__enter__()
        self._t0 = time.perf_counter()

    def _peak_memory(self):
        if self.cuda:
            return torch.cuda.max_memory_allocated(), "cuda_max_memory_allocated"
        if self.tracker is not None:
            return self.tracker.peak, "live_bytes_tracker"
        import resource

        # CPU without a tracker: the process's peak RSS so far (host RAM is the device there)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"

    def end_step(self, step: int, tokens: int) -> Dict[str, Any]:
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - (self._t0 if self._t0 is not None else time.perf_counter())
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self._seam.__exit__(None, None, None)
        peak, source = self._peak_memory()
        seq = self.seq_len or tokens  # FLOPs scale with S^2 per sample, not per step
        samples = tokens / seq
        f = flops_per_sample(seq, self.n_params, self.num_layers, self.attn_width)
        rec = {"step": step, "step_time_s": dt, "tokens": tokens,
               "tokens_per_s_per_gpu": tokens / self.sp / dt if dt > 0 else 0.0,
               "tflops_per_gpu": f["total"] * samples / self.sp / dt / 1e12 if dt > 0 else 0.0,
               "attention_flops_fraction": f["attention"] / f["total"] if f["total"] else 0.0,
               "peak_memory_bytes": int(peak), "peak_memory_source": source}
        if self.cuda:  # what the caching allocator held (allocated + its slack): what an OOM is about
            rec["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        if self._alloc_start is not None:
            end = torch.cuda.memory._snapshot()
            if not self._snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            # DS_LONGCTX_ALLOCATOR_TRACE_DIR (bench/device/run_all.sh): the step's events also go to a file there
            # (measure/allocator.save_events), for replaying them again off the device
            tdir = os.environ.get("DS_LONGCTX_ALLOCATOR_TRACE_DIR")
            save_to = os.path.join(tdir, f"alloc_trace_rank{self.rank}_step{step}.json.gz") if tdir else None
            if save_to:
                os.makedirs(tdir, exist_ok=True)
            rec["allocator_model"] = {**check_step(self._alloc_start, end, "expandable_segments:True" in conf,
                                                   save_to=save_to),
                                      "measured_peak_reserved": rec["peak_reserved_bytes"],
                                      "measured_peak_allocated": int(torch.cuda.max_memory_allocated())}
            self._alloc_start = None
        if counter is not None:
            rec["flops_by_category"] = self._compare(counter.work, int(seq), samples)
        if self._profiled(step):
            rec["artifacts"] = self._finish_artifacts(step)
        self.history.append(rec)
        return rec

    def planned_work(self, seq_len: int) -> dict:
        """The planner's counts for one micro batch of ``seq_len`` tokens (``plan_work``; cached)."""
        if seq_len not in self._planned:
            self._planned[seq_len] = self.plan_work(seq_len)
        return self._planned[seq_len]

    def _compare(self, work: dict, seq_len: int, samples: float) -> Dict[str, Any]:
        measured = by_category(work)["flops"]
        plan = self.planned_work(seq_len)
        per = samples / plan["micro_batch"]  # the planner's step is one micro batch
        planned = {k: v * per for k, v in plan["flops"].items()}
        out = {}
        for k in sorted(set(measured) | set(planned)):
            m, p = measured.get(k, 0.0), planned.get(k, 0.0)
            out[k] = {"measured": m, "planned": p, "ratio": m / p if p else None}
        m, p = sum(measured.values()), sum(planned.values())
        out["total"] = {"measured": m, "planned": p, "ratio": m / p if p else None}
        return out

    def _finish_artifacts(self, step: int) -> List[str]:
        out = []
        tag = f"rank{self.rank}_step{step}"
        if self._sampler is not None:
            self._sampler.stop()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            path = os.path.join(self.output_dir, f"trace_{tag}.json")
            self._prof.export_chrome_trace(path)
            out.append(path)
            self._prof = None
        if self._snapshot:
            path = os.path.join(self.output_dir, f"memory_snapshot_{tag}.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshot = False
            out.append(path)
        if self._sampler is not None:
            out += self._write_timeline(self._sampler.samples, tag)
            self._sampler = None
        return out

    def _write_timeline(self, samples, tag) -> List[str]:
        csv = os.path.join(self.output_dir, f"memory_{tag}.csv")
        with open(csv, "w") as f:
            f.write("seconds,bytes\n")
            f.writelines(f"{t:.6f},{b}\n" for t, b in samples)
        out = [csv]
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return out
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot([t for t, _ in samples], [b / 2**30 for _, b in samples])
        ax.set_xlabel("seconds into the step")
        ax.set_ylabel("GiB " + ("allocated (CUDA)" if self.cuda else "RSS"))
        ax.set_title(f"memory over the step ({tag})")
        fig.tight_layout()
        png = os.path.join(self.output_dir, f"memory_{tag}.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return out + [png]

    def write_summary(self, path: Optional[str] = None) -> str:
        path = path or os.path.join(self.output_dir, f"steps_rank{self.rank}.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.history, f, indent=1)
        return path


def format_flops(by_category: Dict[str, Any]) -> List[str]:
    """A profiled step's ``flops_by_category`` as table lines: category, measured and planned TFLOP, share of
    the measured step, measured / planned."""
    total = by_category.get("total", {}).get("measured") or 1.0
    lines = [f"{'category':<22}{'measured TFLOP':>16}{'planned TFLOP':>16}{'share':>8}{'meas/plan':>11}"]
    for k, v in sorted(by_category.items(), key=lambda kv: (kv[0] == "total", -kv[1]["measured"])):
        ratio = f"{v['ratio']:.3f}" if v["ratio"] is not None else "-"
        lines.append(f"{k:<22}{v['measured'] / 1e12:>16.6g}{v['planned'] / 1e12:>16.6g}"
                     f"{100 * v['measured'] / total:>7.1f}%{ratio:>11}")
    return lines
