"""The training command (``train.py``, ``python -m ds_longctx.train``, ``deepspeed --module ds_longctx.train``): its
flags and what they do are in ``args.DESCRIPTION`` (``--help``).

The package: ``args`` (the flag table and every value's check), ``stages`` (context extension's schedule), ``job``
(the model, data and engine assembled and checked: :func:`~ds_longctx.train.job.prepare`), ``loop`` (the loop and
``main``); ``python -m ds_longctx.train`` runs ``main`` under ``ds_longctx.run`` (an error on any rank ends the job).
"""
from .loop import main  # noqa: F401

__all__ = ["main"]
