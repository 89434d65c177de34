import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_sessionstart(session):
    """DeepSpeed JIT-builds its CPU shared-memory comm op at the first init_distributed; two ranks
    building it at once can abort, so build it once here before any test spawns ranks."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
