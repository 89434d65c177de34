"""The error types for bad user input (imports nothing from ds_longctx: every module may raise them).

``LongContextError`` (a ``ValueError``) is the one base a caller catches for both kinds:

* ``ConfigError``: a bad config key, or a config the model / world / machine cannot run. Raised by
  config.py and the spec builder (spec.py), plus the entry points that parse user input (CLI, launch,
  train.py): ops below them take plain numbers and raise plain ``ValueError``.
* ``BatchError``: a batch the patched model cannot train on (unshifted labels on a shard, a padding mask
  beside packed documents, ...). Raised on every rank before any collective (``sp_batch.agree``).

Every message names the thing (``key``: a config key path or ``batch.<field>``) and the fix.

Ops (attention kernels, the tiled MLP, the NVMe ring) know no config key: they refuse with a ``ValueError``
subclass of their own that carries ``problem`` and ``fix`` in op terms. The layer where the value came from
the config (the spec builder, the installs) re-raises it as the ``ConfigError`` naming the key
(:func:`naming`), so the user sees one error, naming the key and the fix.
"""
import contextlib


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


@contextlib.contextmanager
def naming(key: str, op_error, fix=None):
    """Inside the block, an ``op_error`` (an op's ``ValueError`` subclass, or a tuple of them, with ``problem``
    and ``fix`` attributes) is re-raised as ``ConfigError(key, problem, fix)``: ``fix(err)`` when given (the fix
    restated in config terms), else the op's own fix. One error for the user (the op's stays as
    ``__context__``, not printed)."""
    try:
        yield
    except op_error as e:
        raise ConfigError(key, e.problem, fix(e) if fix is not None else e.fix) from None


def error_class(name: str) -> type:
    """The error class named ``name`` (an error crosses ranks as its key, problem, fix and class name)."""
    cls = {"ConfigError": ConfigError, "BatchError": BatchError, "LongContextError": LongContextError}.get(name)
    return cls if cls is not None else BatchError


__all__ = ["LongContextError", "ConfigError", "BatchError", "error_class", "naming"]


def command_line(prog: str, main, argv=None) -> int:
    """Run a command's ``main(argv)``: a ConfigError is one line on stderr (``prog: key: problem. Fix: ...``) and
    exit code 2, as every ds-longctx command and ``python -m`` entry reports a bad input."""
    import sys

    try:
        return main(argv)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
