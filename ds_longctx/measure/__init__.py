"""Measuring real runs: live storage bytes (``live_bytes.LiveBytesTracker``, used by tests, benches and the
planner's CPU checks), FLOPs and bytes per dispatched op (``flops``: the planner's counting, below every op
module), the caching-allocator model (``allocator``) and per-step time/throughput/TFLOPs/peak memory/profiler
artifacts (``profiler.StepProfiler``, used by train.py for ``long_context.profile``).

Import the submodule you need: the package imports none of them, so the low ones (``flops``, which attention
kernels and the tile loops import) do not pull in the high one (``profiler``, which reads the memory stack's
checkpointing seam)."""
