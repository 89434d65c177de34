"""The processes and how they talk: rank discovery and the launch checks (``launch``), the SP x DP layout
(``layout``), SP groups and control-plane integers (``comm``), one way to decide on every rank (``verdicts``), the
process lifecycle (``runtime``: signals, graceful stop, an error on any rank ends the job) and the preemptible
wrapper behind ``ds-longctx launch`` (``preemptible``, run by path: no torch import)."""
