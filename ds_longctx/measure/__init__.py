"""Measuring real runs: live storage bytes (``live_bytes.LiveBytesTracker``, used by tests, benches and the
planner's CPU checks) and per-step time/throughput/TFLOPs/peak memory/profiler artifacts
(``profiler.StepProfiler``, used by train.py for ``long_context.profile``)."""
from .live_bytes import LiveBytesTracker
from .profiler import StepProfiler, count_params, flops_per_sample

__all__ = ["LiveBytesTracker", "StepProfiler", "count_params", "flops_per_sample"]
