"""The job's lines on stdout: ``info`` (rank 0's statements go through it)."""
from __future__ import annotations

import logging
import sys


def _logger():
    """The job's lines on stdout under the ``ds_longctx`` logger (quiet them all with
    ``logging.getLogger("ds_longctx").setLevel(logging.WARNING)``)."""
    log = logging.getLogger("ds_longctx.train")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[ds_longctx] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        if logging.getLogger("ds_longctx").level == logging.NOTSET:
            logging.getLogger("ds_longctx").setLevel(logging.INFO)
    return log


def info(text: str) -> None:
    _logger().info(text)
