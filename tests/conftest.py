import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")



def pytest_sessionstart(session):
    """DeepSpeed's CPU shared-memory all-reduce op is switched off in every rank we start
    (ds_longctx.dist.comm.disable_cpu_shm_allreduce): no JIT build race, no leaked /dev/shm segments.
    Remove segments an older run may have left so they cannot fill /dev/shm."""
    import glob
    import os

    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            os.unlink(path)
        except OSError:
            pass
