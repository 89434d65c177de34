"""Offload target that writes checkpointed layer inputs to NVMe through DeepSpeed's async I/O op.

The I/O engine is the one ZeRO-Infinity's swappers use (``AsyncIOBuilder().load().aio_handle``:
``async_pwrite``/``async_pread`` + ``wait``, O_DIRECT, so buffers, lengths and file offsets are
aligned). What ZeRO-Infinity's swappers do not give us is the schedule of activations: a layer
input is written while the next layer's forward runs and read back one layer ahead in backward, so
this target keeps a small ring of staging buffers (page-locked host memory: cudaHostRegister'd on
CUDA, DeepSpeed's locked tensors on CPU) and one I/O thread that drives the handle in submission
order. One file per rank inside a fresh directory under ``nvme_path``, carved into exact-size slots
that are reused from step to step (no growth while shapes stay the same); the directory is removed
by :meth:`NVMeTarget.close`, when the target is garbage-collected, and at interpreter exit.
"""
from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
import weakref
from typing import List, Optional

import torch

from ..config import ConfigError
from .arena import HostBlock
from .offload import OffloadTarget, _dispatch_free

KEY = "long_context.activation_checkpointing"
ALIGN = 4096  # O_DIRECT: buffer address, length and file offset; 4 KiB covers 512 B and 4 KiB sectors

# DeepSpeed's aio defaults (deepspeed/runtime/swap_tensor/constants.py), what ZeRO-Infinity runs with
AIO_BLOCK_SIZE, AIO_QUEUE_DEPTH, AIO_INTRA_OP_PARALLELISM = 1 << 20, 8, 1


def load_aio():
    """DeepSpeed's async_io op module, or a ConfigError naming what is missing."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # pragma: no cover - deepspeed is a hard dependency
        raise ConfigError(f"{KEY}.offload", f"'nvme' needs DeepSpeed's async_io op and deepspeed cannot be "
                          f"imported ({e})", "install deepspeed, or use offload='cpu'") from None
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise ConfigError(f"{KEY}.offload", "'nvme' needs DeepSpeed's async_io op, which cannot be built here: "
                          "the libaio library and headers (libaio.h, -laio) or a C++ compiler were not found",
                          "install libaio-dev (apt-get install -y libaio-dev; libaio-devel on RPM systems) and a "
                          "C++ compiler, or set CFLAGS/LDFLAGS to where libaio lives, or use offload='cpu'")
    try:
        return builder.load(verbose=False)
    except Exception as e:
        raise ConfigError(f"{KEY}.offload", f"DeepSpeed's async_io op failed to build or load ({type(e).__name__}: "
                          f"{e})", "check the build log above (TORCH_EXTENSIONS_DIR), install libaio-dev, or use "
                          "offload='cpu'") from None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def check_nvme_path(path: Optional[str]) -> str:
    """The directory must exist and be writable by this process."""
    if not path:
        raise ConfigError(f"{KEY}.nvme_path", "offload='nvme' needs a directory on the NVMe drive",
                          'set "nvme_path": "/local_nvme" (a local NVMe mount, one per node)')
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ConfigError(f"{KEY}.nvme_path", f"{path!r} does not exist or is not a directory",
                          "create it (mkdir -p) on every node, or point nvme_path at the NVMe mount")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{KEY}.nvme_path", f"{path!r} is not writable by this process (uid {os.getuid()})",
                          "chmod/chown it for the training user, or pick a writable directory")
    return path


class NVMeSlot:
    """A layer input on disk: its place in the rank's file and its shape."""

    __slots__ = ("offset", "nbytes", "span", "shape", "dtype")

    def __init__(self, offset, nbytes, span, shape, dtype):
        self.offset, self.nbytes, self.span, self.shape, self.dtype = offset, nbytes, span, shape, dtype


class _Job:
    __slots__ = ("kind", "staging", "slot", "event", "out", "done", "error", "result")

    def __init__(self, kind, staging, slot, event=None, out=None):
        self.kind, self.staging, self.slot, self.event, self.out = kind, staging, slot, event, out
        self.done = threading.Event()
        self.error = None
        self.result = None


def _cleanup(state):
    """Stop the I/O thread and remove the rank's directory (also run at interpreter exit)."""
    q, cv, thread, directory = state["queue"], state["cv"], state["thread"], state["dir"]
    with cv:
        q.append(None)
        cv.notify_all()
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=60)
    free = state.get("free_locked")
    if free is not None:
        for t in state.get("locked", []):
            try:
                free(t)
            except Exception:
                pass
        state["locked"] = []
    shutil.rmtree(directory, ignore_errors=True)


class NVMeTarget(OffloadTarget):
    """Layer inputs go device -> staging buffer -> file, and come back file -> staging -> device.

    ``ring`` staging buffers (each one layer input, aligned) bound the host memory: a write holds one
    until the drive has the data, a read until the copy out of it is done, so at most ``ring`` layer
    inputs are in flight, and a new offload waits for the oldest write when all are busy.
    """

    def __init__(self, nvme_path: str, ring: int = 3, pin_memory: bool = True, rank: Optional[int] = None,
                 block_size: int = AIO_BLOCK_SIZE, queue_depth: int = AIO_QUEUE_DEPTH,
                 intra_op_parallelism: int = AIO_INTRA_OP_PARALLELISM):
        base = check_nvme_path(nvme_path)
        self._aio = load_aio()
        if ring < 2:
            raise ConfigError(f"{KEY}.nvme_buffer_count", f"must be at least 2, got {ring}",
                              "use 2 or 3 (one buffer writing while the next layer fills another)")
        self.ring = ring
        self.pin = pin_memory and torch.cuda.is_available()
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        self.dir = tempfile.mkdtemp(prefix=f"ds_longctx_act_rank{rank}_", dir=base)
        self.file = os.path.join(self.dir, "layer_inputs.bin")
        self.handle = self._aio.aio_handle(block_size, queue_depth, False, True, intra_op_parallelism)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._state = {"queue": self._queue, "cv": self._cv, "thread": None, "dir": self.dir, "locked": [],
                       "free_locked": None if self.pin else self.handle.free_cpu_locked_tensor}
        self._finalizer = weakref.finalize(self, _cleanup, self._state)  # also runs at exit
        self._staging: List = []        # free staging buffers (uint8 tensors, ALIGN-aligned)
        self._staging_bytes = 0         # size of each
        self._staging_total = 0         # host bytes held by the ring
        self._slots_free: List[tuple] = []  # (offset, span) free in the file
        self.file_bytes = 0             # size of the file: NVMe bytes this rank uses
        self.writes = self.reads = 0
        self.error: Optional[BaseException] = None
        self._streams = {}
        self._probe()
        t = threading.Thread(target=self._run, name="ds_longctx-nvme", daemon=True)
        self._state["thread"] = t
        t.start()

    # -- setup ---------------------------------------------------------------------------------
    def _probe(self):
        """One aligned write and read-back now, so an unusable path fails before training starts."""
        buf = self._new_buffer(ALIGN)
        try:
            buf.fill_(0x5A)
            back = self._new_buffer(ALIGN)
            ok = (self.handle.sync_pwrite(buf, self.file, 0) == 1 and self.handle.sync_pread(back, self.file, 0) == 1
                  and torch.equal(buf, back))
        except Exception as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "the data read back differs" if not ok else ""
        if not ok:
            self.close()
            raise ConfigError(f"{KEY}.nvme_path", f"an O_DIRECT test write/read in {os.path.dirname(self.dir)!r} "
                              f"failed ({why or 'I/O error'})", "use a directory on a local disk that supports "
                              "O_DIRECT (ext4/xfs on NVMe; not tmpfs or some network filesystems)")
        self._release_buffers(buf, back)
        os.truncate(self.file, 0)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        with _dispatch_free():
            if self.pin:
                # cudaHostRegister'd, so both the aio engine (is_pinned) and non_blocking H2D/D2H use it
                # directly. Not run on CPU CI.
                block = HostBlock(nbytes, True, ALIGN)
                t = block.data
                t._ds_longctx_block = block  # keeps the registration alive with the tensor
            else:
                # DeepSpeed's page-locked, page-aligned tensors: the aio engine uses them without a bounce copy
                t = self.handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
                self._state["locked"].append(t)
        return t

    def _release_buffers(self, *bufs):
        if not self.pin:
            for b in bufs:
                self._state["locked"] = [t for t in self._state["locked"] if t is not b]
                self.handle.free_cpu_locked_tensor(b)

    def _stream(self, device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    # -- staging ring and file slots ----------------------------------------------------------------
    def _acquire(self, nbytes: int) -> torch.Tensor:
        span = _align(nbytes)
        with self._cv:
            if span > self._staging_bytes:
                # first use, or a larger layer input than before: (re)build the ring at the new size
                while len(self._staging) < self._ring_built():
                    self._raise_if_failed()
                    self._cv.wait()
                old, self._staging = self._staging, []
                self._release_buffers(*old)
                self._staging = [self._new_buffer(span) for _ in range(self.ring)]
                self._staging_bytes, self._staging_total = span, span * self.ring
            while not self._staging:
                self._raise_if_failed()
                self._cv.wait()
            return self._staging.pop()

    def _ring_built(self) -> int:
        return self.ring if self._staging_bytes else 0

    def _give_back(self, buf):
        with self._cv:
            self._staging.append(buf)
            self._cv.notify_all()

    def _slot(self, nbytes: int, shape, dtype) -> NVMeSlot:
        span = _align(nbytes)
        with self._cv:
            best = None
            for i, (off, sp) in enumerate(self._slots_free):
                if sp >= span and (best is None or sp < self._slots_free[best][1]):
                    best = i
            if best is not None:
                off, sp = self._slots_free.pop(best)
            else:
                off, sp = self.file_bytes, span
                self.file_bytes += span
        return NVMeSlot(off, nbytes, sp, shape, dtype)

    def release(self, host: NVMeSlot):
        with self._cv:
            self._slots_free.append((host.offset, host.span))

    def _raise_if_failed(self):
        if self.error is not None:
            raise RuntimeError(f"NVMe offload I/O failed in {self.file}: {self.error}") from self.error

    # -- the I/O thread ------------------------------------------------------------------------------
    def _submit(self, job: _Job):
        with self._cv:
            self._raise_if_failed()
            self._queue.append(job)
            self._cv.notify_all()

    def _run(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
            if job is None:
                return
            try:
                self._do(job)
            except BaseException as e:  # surfaced to the training thread by the next wait/offload
                job.error = e
                with self._cv:
                    self.error = e
                    self._cv.notify_all()
            finally:
                job.done.set()

    def _do(self, job: _Job):
        if job.kind == "barrier":
            return
        slot, buf = job.slot, job.staging
        io = buf[:slot.span]
        if job.kind == "write":
            if job.event is not None:
                job.event.synchronize()  # the D2H into the staging buffer is done
            if self.handle.async_pwrite(io, self.file, slot.offset) != 0 or self.handle.wait() != 1:
                raise OSError(f"aio write of {slot.span} bytes at offset {slot.offset} failed")
            self.writes += 1
            self._give_back(buf)
            return
        if self.handle.async_pread(io, self.file, slot.offset) != 0 or self.handle.wait() != 1:
            raise OSError(f"aio read of {slot.span} bytes at offset {slot.offset} failed")
        self.reads += 1
        src = buf[:slot.nbytes].view(slot.dtype).view(slot.shape)
        out = job.out
        if out.device.type == "cuda":
            side = self._stream(out.device)
            with torch.cuda.stream(side):
                out.copy_(src, non_blocking=True)
                ev = side.record_event()
            ev.synchronize()  # the staging buffer is free only once the H2D has read it
            job.result = ev
        else:
            with _dispatch_free():
                out.copy_(src)
        self._give_back(buf)

    # -- OffloadTarget ----------------------------------------------------------------------------------
    def to_host(self, t):
        self._raise_if_failed()
        nbytes = t.numel() * t.element_size()
        buf = self._acquire(nbytes)
        view = buf[:nbytes].view(t.dtype).view(t.shape)
        ev = None
        if t.device.type == "cuda":
            side = self._stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                view.copy_(t.detach(), non_blocking=True)
            t.record_stream(side)
            ev = side.record_event()
        else:
            with _dispatch_free():
                view.copy_(t.detach())
        slot = self._slot(nbytes, t.shape, t.dtype)
        self._submit(_Job("write", buf, slot, event=ev))
        return slot, ev

    def to_device(self, host: NVMeSlot, device):
        device = torch.device(device)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        if device.type == "cuda":
            # out's block may have been freed by kernels still queued on the compute stream
            self._stream(device).wait_stream(torch.cuda.current_stream(device))
            out.record_stream(self._stream(device))
        buf = self._acquire(host.nbytes)
        job = _Job("read", buf, host, out=out)
        self._submit(job)
        return out, job

    def wait(self, event):
        if isinstance(event, _Job):
            event.done.wait()
            if event.error is not None:
                raise RuntimeError(f"NVMe offload read failed in {self.file}: {event.error}") from event.error
            event = event.result
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def sync(self, event):
        if isinstance(event, _Job):
            event.done.wait()
        elif event is not None:
            event.synchronize()

    def drain(self):
        """Block until every queued write/read is done."""
        job = _Job("barrier", None, None)
        self._submit(job)
        job.done.wait()
        self._raise_if_failed()

    def memory_stats(self) -> dict:
        return {"nvme_bytes": self.file_bytes, "staging_bytes": self._staging_total,
                "pinned_bytes": self._staging_total if self.pin else 0, "nvme_writes": self.writes,
                "nvme_reads": self.reads}

    def close(self):
        """Stop the I/O thread, free the staging ring and remove this rank's directory."""
        self._finalizer()
        self._staging = []
