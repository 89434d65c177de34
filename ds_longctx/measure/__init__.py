"""Measuring, below every op module: live storage bytes (``live_bytes.LiveBytesTracker``, used by tests, benches and
the planner's CPU checks), FLOPs and bytes per dispatched op (``flops``: the planner's counting), the project's one
analytic FLOPs formula (``formula``), the caching-allocator model (``allocator``) and the planner's simulation seam
(``simulation``). The runtime step profiler is ``ds_longctx.job.profiler``.

Import the submodule you need: the package imports none of them."""
