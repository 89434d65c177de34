"""Run a function on N fresh gloo processes and collect each rank's return value.

SP groups and the attention override are once per process, so every distributed case runs in
fresh processes (forked from a server that has only imported torch, deepspeed, transformers and ds_longctx);
batch many cases into one call to keep the suite short.
"""
from __future__ import annotations

import os
import sys
import pickle
import socket
import tempfile
import threading
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free now (the kernel's pick). Under pytest-xdist (pytest.ini's -n 2) each worker takes only ports of
    its own residue modulo the worker count: two workers never pick the same port before either binds it."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    mine = int(worker) % count if worker.isdigit() else 0
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port % count == mine:
            return port


# What every rank imports: loaded once into the forkserver, so a spawn costs a fork, not these imports (on a
# 2-core box the imports were most of a spawn: ~8 s idle, ~30 s loaded, against 0.3 s from the server). Also what
# the ranks import later: DeepSpeed's ZeRO init imports its Muon optimizer, whose kernels torch.compile at import
# (3.4 s a rank), and the Trainer route's transformers.trainer (2.3 s); then forkserver_gc (gc.freeze) last.
PRELOAD = ["torch", "deepspeed", "transformers", "ds_longctx", "deepspeed.runtime.zero.muon.muon_optimizer",
           "transformers.trainer", "accelerate", "peft", "trl", "forkserver_gc"]
_METHOD = []
_METHOD_LOCK = threading.Lock()  # run_distributed_side_by_side's threads ask at once (PYTHONPATH is swapped below)


def _start_method() -> str:
    """"forkserver" with :data:`PRELOAD` imported in the server (a fresh interpreter started for it, never a fork of
    pytest: each rank starts from that clean imported state); "spawn" where CUDA is present (nothing forks a process
    that may have queried CUDA) or ``DS_LONGCTX_TEST_SPAWN=1``."""
    with _METHOD_LOCK:
        if not _METHOD:
            _METHOD.append(_choose_start_method())
    return _METHOD[0]


def _choose_start_method() -> str:
    import multiprocessing
    from multiprocessing import forkserver

    import torch

    if torch.cuda.is_available() or os.environ.get("DS_LONGCTX_TEST_SPAWN") == "1":
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    # started here with tests/ on its PYTHONPATH: the server is a fresh `python -c` that imports PRELOAD before it
    # reads the sys.path it is handed (Python 3.11), so forkserver_gc was not found (and skipped silently)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), before) if p)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
    return "forkserver"


def _worker(rank, world, port, fn, args, out_dir, environ):
    # the parent's environment now (a forkserver child inherits the server's, from when it started)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    result = None
    try:
        import deepspeed

        from ds_longctx.dist.comm import disable_cpu_shm_allreduce

        disable_cpu_shm_allreduce()
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # report, don't hang the parent
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized() and result[0] == "ok":
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    # the result is written: end without interpreter finalization, where gloo's threads can abort the process
    # ("terminate called without an active exception", the exit-time abort ds_longctx.shutdown avoids)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world: int, *args, timeout: float = 600):
    """Spawn ``world`` processes running ``fn(rank, world, *args)``; return the list of results.

    Raises with every failing rank's traceback if any rank raised.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args, out_dir, dict(os.environ)),
                                 nprocs=world, join=False, start_method=_start_method())
        import time

        deadline = time.time() + timeout
        while not ctx.join(timeout=5):
            if time.time() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"distributed run of {fn.__name__} did not finish in {timeout}s")
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} wrote no result (crashed?)")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    errors = [msg for status, msg in results if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [value for _, value in results]


def run_distributed_side_by_side(*calls, timeout: float = 600, return_exceptions: bool = False):
    """Independent ``run_distributed(fn, world, *args)`` calls at the same time (e.g. a one-process reference
    next to the SP run it is compared with); ``calls``: (fn, world, *args) tuples. Returns each call's list of
    results, in order; raises like run_distributed (``return_exceptions``: a failed call's exception takes its
    place instead, for a module fixture whose tests each re-raise their own). Each call is its own spawn with
    its own port; side by side they overlap the spawned processes' single-threaded start-up (imports) on a
    2-core machine."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        jobs = [pool.submit(run_distributed, fn, world, *args, timeout=timeout) for fn, world, *args in calls]
        if not return_exceptions:
            return [job.result() for job in jobs]
        return [job.exception() or job.result() for job in jobs]


def runs_per_degree(worker, cases: dict) -> dict:
    """``{sp: worker's results}`` for ``cases`` = ``{sp: [case, ...]}``: one spawn per degree, side by side, a failed
    degree's exception in its place (:func:`result_or_raise` re-raises it in the test of that degree)."""
    sps = sorted(cases)
    runs = run_distributed_side_by_side(*[(worker, sp, cases[sp]) for sp in sps], return_exceptions=True)
    return dict(zip(sps, runs))


def result_or_raise(result):
    """One entry of run_distributed_side_by_side(..., return_exceptions=True): re-raised if it failed."""
    if isinstance(result, BaseException):
        raise result
    return result
