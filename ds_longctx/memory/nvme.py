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
by :meth:`NVMeTarget.close`, when the target is garbage-collected, at interpreter exit and on every
exit path of ``ds_longctx.dist.runtime`` (error exits, SIGTERM/SIGINT, the launcher's death).

Faults. DeepSpeed's aio op ignores each request's result (short writes, ENOSPC, EIO are dropped), and
its pread asserts (a native abort) when the file is shorter than the read. So: the file's space is
reserved with ``posix_fallocate`` before any write lands in it (a full drive is a clear error naming
the path, the bytes needed and free; :func:`reserve_on_every_rank` does it for the whole plan before
step 1, on every rank at once); a read checks the file covers it; and each chunk's first and last 8
bytes are kept at write time and compared after the read, so a write or read the drive silently
dropped is an error, not stale activations (a sampled check: it catches lost and short requests, not a
corrupted byte in the middle of a chunk).

Stale directories. Each rank's directory holds ``owner.json`` (host, uid, pid and the process's start
time). A new target removes the directories in ``nvme_path`` whose owner ran on this host under this
uid and no longer exists (kill -9 is the only exit that skips the cleanups): never a live job's, nor
another host's or user's.
"""
from __future__ import annotations

import collections
import json
import os
import socket
import shutil
import tempfile
import threading
import time
import weakref
from typing import List, Optional

import torch

from ..dist.runtime import cancel_on_exit, on_exit, proc_start_time
from .arena import HostBlock
from .offload import OffloadTarget, _dispatch_free

ALIGN = 4096  # O_DIRECT: buffer address, length and file offset; 4 KiB covers 512 B and 4 KiB sectors

CHUNK_BYTES = 128 << 20  # one staging buffer; a layer input moves through the ring in chunks of this size

# DeepSpeed's aio defaults (deepspeed/runtime/swap_tensor/constants.py), what ZeRO-Infinity runs with
AIO_BLOCK_SIZE, AIO_QUEUE_DEPTH, AIO_INTRA_OP_PARALLELISM = 1 << 20, 8, 1


HOST_FALLBACK = "offload to host memory instead (memory.offload.AutoTarget)"


class NVMeError(ValueError):
    """The NVMe target cannot run here, in op terms (no config key): ``problem``, ``kind``: "aio" (DeepSpeed's
    async_io op is missing or does not build), "path" (the ``nvme_path`` directory is unusable) or "space" (its
    drive cannot hold the layer inputs), and the fix: ``options``, then (``host_fallback``) offloading to host
    memory instead. The install that built the target from the config re-raises it as the ConfigError naming
    the key, with the fix in config terms (memory.naming_nvme_keys)."""

    def __init__(self, problem: str, options: str, kind: str, host_fallback: bool = False):
        self.problem, self.options, self.kind, self.host_fallback = problem, options, kind, host_fallback
        self.fix = f"{options}, or {HOST_FALLBACK}" if host_fallback else options
        super().__init__(f"{problem}. Fix: {self.fix}")

    def __reduce__(self):
        return (type(self), (self.problem, self.options, self.kind, self.host_fallback))


def load_aio():
    """DeepSpeed's async_io op module, or an NVMeError (kind "aio") naming what is missing."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # pragma: no cover - deepspeed is a hard dependency
        raise NVMeError(f"'nvme' needs DeepSpeed's async_io op and deepspeed cannot be imported ({e})",
                        "install deepspeed", "aio", True) from None
    builder = AsyncIOBuilder()
    check_op_build_lock(builder.name)  # a killed build's lock: every load would wait on it forever
    if not builder.is_compatible(verbose=False):
        raise NVMeError("'nvme' needs DeepSpeed's async_io op, which cannot be built here: the libaio library and "
                        "headers (libaio.h, -laio) or a C++ compiler were not found",
                        "install libaio-dev (apt-get install -y libaio-dev; libaio-devel on RPM systems) and a C++ "
                        "compiler, or set CFLAGS/LDFLAGS to where libaio lives", "aio", True)
    try:
        return builder.load(verbose=False)
    except Exception as e:
        raise NVMeError(f"DeepSpeed's async_io op failed to build or load ({type(e).__name__}: {e})",
                        "check the build log above (TORCH_EXTENSIONS_DIR), install libaio-dev", "aio", True) from None


# how long a build lock may stand with no process building next to it before it is called stale: a live build runs
# ninja and the compiler with the build directory as their working directory for all but a few milliseconds
STALE_LOCK_WINDOW_S = 20.0


def op_build_directory(name: str) -> str:
    """Where torch's JIT build of DeepSpeed's op ``name`` (e.g. "async_io") puts its files and its ``lock``
    (TORCH_EXTENSIONS_DIR, else torch's default: torch.utils.cpp_extension's own choice)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def _building_in(directory: str) -> bool:
    """A process on this machine has ``directory`` as its working directory (ninja and the compiler of a build)."""
    want = os.path.realpath(directory)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == want:
                    return True
            except OSError:  # gone, or another user's
                continue
    return False


def check_op_build_lock(name: str, window_s: Optional[float] = None) -> None:
    """Refuse to load op ``name`` behind a stale build lock. torch's JIT build holds ``<build dir>/lock`` while it
    builds, and every later load of the op (an already built one too) waits until the file is gone, silently and
    without end: a build that was killed (Ctrl-C, a job's time limit) leaves it. When the lock stands for
    ``window_s`` (default :data:`STALE_LOCK_WINDOW_S`) while no process here builds in that directory, this is an
    NVMeError (kind "aio") naming the lock, its age and the fix; a live build (another rank building it now) is
    waited for as before, with one line saying so."""
    lock = os.path.join(op_build_directory(name), "lock")
    if not os.path.exists(lock):
        return
    window = STALE_LOCK_WINDOW_S if window_s is None else window_s
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        if not os.path.exists(lock):
            return
        if _building_in(os.path.dirname(lock)):
            print(f"ds_longctx: waiting for the build of DeepSpeed's {name} op that another process is running "
                  f"({lock})", flush=True)
            return
        time.sleep(min(1.0, window / 10))
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return
    raise NVMeError(f"DeepSpeed's {name} op is locked by {lock} (made {age:.0f} s ago) and no process on this machine "
                    f"has built in its directory for {window:.0f} s: a build that was killed left the lock, and every "
                    "load of the op would wait on it forever", f"remove it (rm {lock}) and run again: the op then "
                    "builds once (minutes) or loads; if a process on another machine sharing that directory is "
                    "building it, wait for that build instead", "aio", True)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


PREFIX = "ds_longctx_act_rank"
MARKER = "owner.json"


def _fmt_bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n} bytes ({n / 2**20:.1f} MiB)"


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _owner() -> dict:
    return {"host": socket.gethostname(), "uid": os.getuid(), "pid": os.getpid(),
            "start_time": proc_start_time(os.getpid())}


def remove_stale_dirs(base: str) -> List[str]:
    """Remove the activation directories under ``base`` left by dead processes of this user on this
    host (identified by their owner.json); returns the removed paths."""
    me, removed = _owner(), []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        d = os.path.join(base, name)
        if not name.startswith(PREFIX) or not os.path.isdir(d):
            continue
        try:
            with open(os.path.join(d, MARKER)) as f:
                owner = json.load(f)
            host, uid, pid, start = owner["host"], owner["uid"], int(owner["pid"]), owner["start_time"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no readable marker: not provably ours, leave it
        if host != me["host"] or uid != me["uid"] or pid == me["pid"]:
            continue
        if proc_start_time(pid) == start and start is not None:
            continue  # the owner is alive: a running job's files
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def check_nvme_path(path: Optional[str]) -> str:
    """The directory must exist and be writable by this process (else an NVMeError of kind "path")."""
    if not path:
        raise NVMeError("offload='nvme' needs a directory on the NVMe drive",
                        'pass nvme_path="/local_nvme" (a local NVMe mount, one per node)', "path")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise NVMeError(f"{path!r} does not exist or is not a directory",
                        "create it (mkdir -p) on every node, or point nvme_path at the NVMe mount", "path")
    if not os.access(path, os.W_OK | os.X_OK):
        raise NVMeError(f"{path!r} is not writable by this process (uid {os.getuid()})",
                        "chmod/chown it for the training user, or pick a writable directory", "path")
    return path


SPACE_FIX = "free space on that drive, point nvme_path at a larger drive, keep more layer inputs on the device"


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


def _exit_cleanup(state):
    """On an exit path (runtime.on_exit: error exits, signals, the launcher's death): remove the directory at
    once (a launcher may SIGKILL within a second), then drop the queued I/O and let the write in flight end,
    and remove again: a write in flight recreates ``layer_inputs.bin`` (DeepSpeed's aio opens the file by
    name) between rmtree's unlink and its rmdir, which left the directory behind."""
    directory = state["dir"]
    shutil.rmtree(directory, ignore_errors=True)
    q, cv, thread = state["queue"], state["cv"], state["thread"]
    with cv:
        q.clear()
        q.append(None)
        cv.notify_all()
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=2.0)
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
        if ring < 2:  # config.py refuses nvme_buffer_count < 2 at parse; this guards direct callers
            raise ValueError(f"ring: must be at least 2 staging chunks, got {ring}; use 2 or 3 (one chunk is "
                             "written while the next is copied)")
        self.ring = ring
        self.chunk_bytes = _align(chunk_bytes)
        self.pin = pin_memory and torch.cuda.is_available()
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        self.base = base
        self.removed_stale = remove_stale_dirs(base)
        try:
            self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{rank}_", dir=base)
            with open(os.path.join(self.dir, MARKER), "w") as f:
                json.dump(_owner(), f)
        except OSError as e:
            if getattr(self, "dir", None):
                shutil.rmtree(self.dir, ignore_errors=True)
            raise NVMeError(f"cannot create a directory in {base!r} ({e})",
                            "point nvme_path at a writable directory on a local NVMe drive with free space",
                            "path") from None
        self.file = os.path.join(self.dir, "layer_inputs.bin")
        self.handle = self._aio.aio_handle(block_size, queue_depth, False, True, intra_op_parallelism)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._state = {"queue": self._queue, "cv": self._cv, "thread": None, "dir": self.dir, "locked": [],
                       "free_locked": None if self.pin else self.handle.free_cpu_locked_tensor}
        self._finalizer = weakref.finalize(self, _cleanup, self._state)  # also runs at exit
        # os._exit paths (error exits, signals, the launcher's death) skip atexit: remove the files there too

        state = self._state
        key = on_exit(lambda: _exit_cleanup(state))
        weakref.finalize(self, cancel_on_exit, key)
        self._allocated = 0             # bytes of the file reserved with posix_fallocate
        self._samples = {}              # slot offset -> the first/last 8 bytes of each chunk written there
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
            raise NVMeError(f"an O_DIRECT test write/read in {os.path.dirname(self.dir)!r} failed ({why})",
                            "use a directory on a local disk that supports O_DIRECT (ext4/xfs on NVMe; not some "
                            "network or FUSE filesystems)", "path")
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
                self._ensure_allocated(off + span)
                self.file_bytes += span
        return NVMeSlot(off, nbytes, sp, shape, dtype)

    def _space_error(self, need_total: int, why: str = "") -> NVMeError:
        free = free_bytes(self.base)
        more = max(0, need_total - self._allocated)
        return NVMeError(f"{self.base!r} is too full for this rank's layer inputs: {_fmt_bytes(need_total)} needed "
                         f"in {self.file} ({_fmt_bytes(more)} more than reserved), {_fmt_bytes(free)} free{why}",
                         SPACE_FIX, "space", True)

    def _ensure_allocated(self, nbytes: int):
        """Reserve the file's blocks up to ``nbytes`` before any write lands there (DeepSpeed's aio drops
        ENOSPC): a full drive is an error now, naming the path, the bytes needed and free."""
        if nbytes <= self._allocated:
            return
        try:
            fd = os.open(self.file, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, self._allocated, nbytes - self._allocated)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._space_error(nbytes, f" ({e.strerror})") from None
        self._allocated = nbytes

    def reserve(self, nbytes: int) -> Optional[str]:
        """Reserve ``nbytes`` of file now (the plan's NVMe bytes for this rank); returns None, or the
        problem (the drive's free space cannot hold it), the text of an NVMeError of kind "space"."""
        nbytes = _align(nbytes)
        if nbytes - self._allocated > free_bytes(self.base):
            return self._space_error(nbytes).problem
        try:
            with self._cv:
                self._ensure_allocated(nbytes)
        except NVMeError as e:
            return e.problem
        return None

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
            samples = []
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
                samples.append(self._sample(buf, n))
                if pending:
                    self._wait(pending)
                self._io(True, buf[:_align(n)], slot.offset + off)
                pending = 1
            if pending:
                self._wait(pending)
            self._samples[slot.offset] = samples
            self.writes += 1
            return
        out = job.out  # the freshly allocated device tensor, as bytes
        size = os.path.getsize(self.file)
        if size < slot.offset + slot.span:  # DeepSpeed's pread would abort the process (a native assert)
            raise OSError(f"{self.file} holds {size} bytes, short of the {slot.span} bytes at offset {slot.offset} "
                          "this layer input was written to (the file was truncated or a write was lost)")
        samples = self._samples.get(slot.offset)
        cuda = out.device.type == "cuda"
        side = self._stream(out.device) if cuda else None
        events = [None] * len(ring)
        for j, (off, n) in enumerate(chunks):
            b = j % len(ring)
            if events[b] is not None:
                events[b].synchronize()  # the H2D that read this buffer is done
            self._io(False, ring[b][:_align(n)], slot.offset + off)
            self._wait(1)
            if samples is not None and self._sample(ring[b], n) != samples[j]:
                raise OSError(f"the {n} bytes read at offset {slot.offset + off} of {self.file} differ from those "
                              "written there (a write or read the drive failed without an error reaching "
                              "DeepSpeed's aio): the activations would be stale")
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

    @staticmethod
    def _sample(buf: torch.Tensor, n: int) -> bytes:
        with _dispatch_free():
            return bytes(buf[:min(8, n)].tolist() + buf[max(0, n - 8):n].tolist())

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


def reserve_on_every_rank(target: "NVMeTarget", nbytes: int, group=None) -> None:
    """Reserve this rank's planned NVMe bytes before step 1 and agree over the job: when any rank's
    drive is too small, every rank raises the same NVMeError (kind "space") naming each failing rank's path,
    bytes needed and free (one rank raising alone would leave the others in the next collective)."""
    import torch.distributed as dist

    problem = target.reserve(nbytes) if target is not None else None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if problem:
            raise NVMeError(problem, SPACE_FIX, "space", True)
        return
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if bad:
        raise NVMeError("; ".join(bad), SPACE_FIX, "space", True)
