"""What a run of days needs around the step, below ``initialize``: every rank agreeing on config and data
(``agreement``), the watchdog, host-memory and storage checks before step 1 (``hostmem``, ``preflight``), metrics
and the step profiler (``metrics``, ``profiler``), and checkpoints (``checkpoint/``: tags, the save directory,
resume, universal conversion, the run's record, export)."""
