"""Offload target that writes checkpointed layer inputs to NVMe through DeepSpeed's async I/O op.

The I/O engine is the one ZeRO-Infinity's swappers use (``AsyncIOBuilder().load().aio_handle``:
``async_pwrite``/``async_pread`` + ``wait``, O_DIRECT, so buffers, lengths and file offsets are
aligned). What ZeRO-Infinity's swappers do not give us is the schedule of activations: a layer
input is written while the next layer's forward runs and read back one layer ahead in backward, so
this target has one I/O thread that drives the handle in submission order and streams each layer
input through a small ring of staging chunks (page-locked host memory: cudaHostRegister'd on CUDA,
DeepSpeed's locked tensors on CPU; ``nvme_buffer_count`` x ``CHUNK_BYTES``, so host memory does not
grow with the layer size: the copy of chunk j+1 overlaps the drive's write of chunk j). One file per rank inside a fresh directory under ``nvme_path``, carved into exact-size slots
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

from ..errors import ConfigError
from .arena import HostBlock
from .offload import OffloadTarget, _dispatch_free

KEY = "long_context.activation_checkpointing"
ALIGN = 4096  # O_DIRECT: buffer address, length and file offset; 4 KiB covers 512 B and 4 KiB sectors

CHUNK_BYTES = 128 << 20  # one staging buffer; a layer input moves through the ring in chunks of this size

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
    """Layer inputs go device -> staging chunk -> file, and come back file -> staging chunk -> device,
    on one I/O thread. ``to_host`` returns at once; the returned job is the offloader's throttle (it
    waits for the write issued ``max_inflight`` layers ago, which bounds how many offloaded device
    tensors the I/O thread keeps alive). Host memory: ``ring`` staging chunks."""

    def __init__(self, nvme_path: str, ring: int = 3, pin_memory: bool = True, rank: Optional[int] = None,
                 chunk_bytes: int = CHUNK_BYTES, block_size: int = AIO_BLOCK_SIZE,
                 queue_depth: int = AIO_QUEUE_DEPTH, intra_op_parallelism: int = AIO_INTRA_OP_PARALLELISM):
        base = check_nvme_path(nvme_path)
        self._aio = load_aio()
        if ring < 2:
            raise ConfigError(f"{KEY}.nvme_buffer_count", f"must be at least 2, got {ring}",
                              "use 2 or 3 (one chunk is written while the next is copied)")
        self.ring = ring
        self.chunk_bytes = _align(chunk_bytes)
        self.pin = pin_memory and torch.cuda.is_available()
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        try:
            self.dir = tempfile.mkdtemp(prefix=f"ds_longctx_act_rank{rank}_", dir=base)
        except OSError as e:
            raise ConfigError(f"{KEY}.nvme_path", f"cannot create a directory in {base!r} ({e})",
                              "point nvme_path at a writable directory on a local NVMe drive") from None
        self.file = os.path.join(self.dir, "layer_inputs.bin")
        self.handle = self._aio.aio_handle(block_size, queue_depth, False, True, intra_op_parallelism)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._state = {"queue": self._queue, "cv": self._cv, "thread": None, "dir": self.dir, "locked": [],
                       "free_locked": None if self.pin else self.handle.free_cpu_locked_tensor}
        self._finalizer = weakref.finalize(self, _cleanup, self._state)  # also runs at exit
        self._staging: List[torch.Tensor] = []  # used by the I/O thread only (after the probe)
        self._staging_bytes = 0         # size of each staging chunk
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
        back = self._new_buffer(ALIGN)
        why = ""
        try:
            buf.fill_(0x5A)
            back.zero_()
            w = self.handle.sync_pwrite(buf, self.file, 0)
            r = self.handle.sync_pread(back, self.file, 0)
            if w < 0 or r < 0:
                why = f"the aio write/read returned {w}/{r}"
            elif not torch.equal(buf, back):
                why = "the data read back differs"
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        self._release_buffers(buf, back)
        if why:
            self.close()
            raise ConfigError(f"{KEY}.nvme_path", f"an O_DIRECT test write/read in {os.path.dirname(self.dir)!r} "
                              f"failed ({why})", "use a directory on a local disk that supports O_DIRECT "
                              "(ext4/xfs on NVMe; not some network or FUSE filesystems)")
        os.truncate(self.file, 0)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        with _dispatch_free():
            if self.pin:
                # cudaHostRegister'd, so both the aio engine (is_pinned) and non_blocking H2D/D2H use it
                # directly. Not run on CPU CI.
                block = HostBlock(nbytes, True, ALIGN)
                t = block.data
                self._state["locked"].append(block)  # keeps the registration alive with the target
            else:
                # DeepSpeed's page-locked, page-aligned tensors: the aio engine uses them without a bounce copy
                t = self.handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
                self._state["locked"].append(t)
        return t

    def _release_buffers(self, *bufs):
        for b in bufs:
            self._state["locked"] = [t for t in self._state["locked"]
                                     if not (t is b or getattr(t, "data", None) is b)]
            if not self.pin:
                self.handle.free_cpu_locked_tensor(b)

    def _stream(self, device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    # -- staging ring (I/O thread) and file slots ------------------------------------------------------
    def _ring_for(self, nbytes: int) -> List[torch.Tensor]:
        size = min(self.chunk_bytes, _align(nbytes))
        if size > self._staging_bytes:
            # first use, or a larger layer input than before (below one chunk): rebuild at the new size
            self._release_buffers(*self._staging)
            self._staging = [self._new_buffer(size) for _ in range(self.ring)]
            self._staging_bytes = size
        return self._staging

    def _chunks(self, nbytes: int):
        c = self._staging_bytes
        return [(o, min(c, nbytes - o)) for o in range(0, nbytes, c)]

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
                job.staging = job.out = None  # drop the device tensor: its memory may be reused now
                job.done.set()

    def _io(self, write: bool, buf: torch.Tensor, offset: int):
        fn = self.handle.async_pwrite if write else self.handle.async_pread
        if fn(buf, self.file, offset) != 0:
            raise OSError(f"aio {'write' if write else 'read'} of {buf.numel()} bytes at offset {offset} failed")

    def _wait(self, n: int):
        done = self.handle.wait()
        if done != n:
            raise OSError(f"aio wait completed {done} of {n} operations in {self.file}")

    def _do(self, job: _Job):
        if job.kind == "barrier":
            return
        slot = job.slot
        ring = self._ring_for(slot.nbytes)
        chunks = self._chunks(slot.nbytes)
        if job.kind == "write":
            src = job.staging  # the device tensor, as bytes
            cuda = src.device.type == "cuda"
            if cuda:
                side = self._stream(src.device)
                side.wait_event(job.event)  # src was produced on the compute stream
            pending = 0
            for j, (off, n) in enumerate(chunks):
                buf = ring[j % len(ring)]
                # the write that used this buffer ring-1 chunks ago is done: we wait for each before
                # submitting the next (at most one write in flight, overlapping this copy)
                if cuda:
                    with torch.cuda.stream(side):
                        buf[:n].copy_(src[off:off + n], non_blocking=True)
                    side.synchronize()
                else:
                    with _dispatch_free():
                        buf[:n].copy_(src[off:off + n])
                if pending:
                    self._wait(pending)
                self._io(True, buf[:_align(n)], slot.offset + off)
                pending = 1
            if pending:
                self._wait(pending)
            self.writes += 1
            return
        out = job.out  # the freshly allocated device tensor, as bytes
        cuda = out.device.type == "cuda"
        side = self._stream(out.device) if cuda else None
        events = [None] * len(ring)
        for j, (off, n) in enumerate(chunks):
            b = j % len(ring)
            if events[b] is not None:
                events[b].synchronize()  # the H2D that read this buffer is done
            self._io(False, ring[b][:_align(n)], slot.offset + off)
            self._wait(1)
            if cuda:
                with torch.cuda.stream(side):
                    out[off:off + n].copy_(ring[b][:n], non_blocking=True)
                    events[b] = side.record_event()
            else:
                with _dispatch_free():
                    out[off:off + n].copy_(ring[b][:n])
        if cuda:
            job.result = side.record_event()
            job.result.synchronize()  # the ring is free for the next job only once every H2D has read it
        self.reads += 1

    # -- OffloadTarget ----------------------------------------------------------------------------------
    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    def to_host(self, t):
        self._raise_if_failed()
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        ev = None
        if src.device.type == "cuda":
            ev = torch.cuda.current_stream(src.device).record_event()
            # the I/O thread copies from src on its side stream later: keep the allocator from reusing it
            src.record_stream(self._stream(src.device))
        slot = self._slot(nbytes, t.shape, t.dtype)
        job = _Job("write", self._bytes(src), slot, event=ev)  # the job holds src until it is written
        self._submit(job)
        return slot, job

    def to_device(self, host: NVMeSlot, device):
        device = torch.device(device)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        if device.type == "cuda":
            # out's block may have been freed by kernels still queued on the compute stream
            self._stream(device).wait_stream(torch.cuda.current_stream(device))
            out.record_stream(self._stream(device))
        job = _Job("read", None, host, out=self._bytes(out))
        self._submit(job)
        return out, job

    def wait(self, event):
        if isinstance(event, _Job):
            event.done.wait()
            if event.error is not None:
                raise RuntimeError(f"NVMe offload I/O failed in {self.file}: {event.error}") from event.error
            event = event.result
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def sync(self, event):
        if isinstance(event, _Job):
            event.done.wait()
            self._raise_if_failed()
        elif event is not None:
            event.synchronize()

    def drain(self):
        """Block until every queued write/read is done."""
        job = _Job("barrier", None, None)
        self._submit(job)
        job.done.wait()
        self._raise_if_failed()

    def memory_stats(self) -> dict:
        staging = self._staging_bytes * len(self._staging)
        return {"nvme_bytes": self.file_bytes, "staging_bytes": staging,
                "pinned_bytes": staging if self.pin else 0, "nvme_writes": self.writes, "nvme_reads": self.reads}

    def close(self):
        """Stop the I/O thread, free the staging ring and remove this rank's directory."""
        self._finalizer()
        self._staging = []
