"""The error types for bad user input (imports nothing from ds_longctx: every module may raise them).

``LongContextError`` (a ``ValueError``) is the one base a caller catches for both kinds:

* ``ConfigError``: a bad config key, or a config the model / world / machine cannot run. Raised by
  config.py and the spec builder (spec.py), plus the entry points that parse user input (CLI, launch,
  train.py): ops below them take plain numbers and raise plain ``ValueError``.
* ``BatchError``: a batch the patched model cannot train on (unshifted labels on a shard, a padding mask
  beside packed documents, ...). Raised on every rank before any collective (``sp_batch.agree``).

Every message names the thing (``key``: a config key path or ``batch.<field>``) and the fix.
"""


class LongContextError(ValueError):
    """Bad user input to ds_longctx. The message is ``"<key>: <problem>. Fix: <fix>"``."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}. Fix: {fix}")

    def __reduce__(self):  # picklable (broadcast_object_list, multiprocessing) with its three parts
        return (type(self), (self.key, self.problem, self.fix))


class ConfigError(LongContextError):
    """A bad config or shape. The message names the key path and the fix."""


class BatchError(LongContextError):
    """A batch the patched model cannot use. The message names the batch field and the fix."""


def error_class(name: str) -> type:
    """The error class named ``name`` (an error crosses ranks as its key, problem, fix and class name)."""
    cls = {"ConfigError": ConfigError, "BatchError": BatchError, "LongContextError": LongContextError}.get(name)
    return cls if cls is not None else BatchError


__all__ = ["LongContextError", "ConfigError", "BatchError", "error_class"]
