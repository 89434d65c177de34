"""Which backend runs: the shipped backends registered in "auto" order, 'auto' by measurement on CUDA
(:class:`MeasuredChoice`: kernel speed depends on the build, the chip and the shape, so it is timed once per call
signature), and name resolution per layer (:class:`KernelChoice`: a window or soft-cap picks a kernel that applies
it, or is refused)."""
from __future__ import annotations

import torch
from typing import Dict, Optional, Tuple

from ...dist.verdicts import world_sum
from .banded import TorchBanded, TorchBandedCUDA
from .base import BACKENDS, Backend, KernelError, _AUTO_ORDER, _CONFIG_NAMES, _MEASURED, _OVERRIDES, _check, _instance, register_backend
from .flash_attn import FlashAttn2, FlashAttn3
from .sdpa import TorchCPUFlash, TorchCUDAFlash, TorchCUDAcuDNN, Windowed


# device type -> the banded kernels: 'auto''s kernel for a windowed / soft-capped layer where 'auto' is one kernel
# without the capability (CPU), and a measured candidate for such layers only where 'auto' measures (CUDA)
_BANDED: Dict[str, Tuple[str, ...]] = {"cpu": ("torch_banded",), "cuda": ("torch_banded_cuda",)}


# CUDA "auto" measures every available candidate (MeasuredChoice); this order only breaks exact ties
for _cls, _auto, _named in ((FlashAttn3, True, True), (FlashAttn2, True, True), (TorchCUDAcuDNN, True, True),
                            (TorchCUDAFlash, True, True), (TorchCPUFlash, True, False), (TorchBanded, False, False),
                            (TorchBandedCUDA, False, False)):
    register_backend(_cls, auto=_auto, config_name=_named)


MEASURE_MAX_TOKENS = 32768  # time on a prefix of at most this many tokens: at 5M tokens one stage is seconds,


def _cuda_timer(fn, reps: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up, with CUDA events."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


class MeasuredChoice(Backend):
    """'auto' where several backends are available: at the first call of a signature (dtype, causal,
    head_dim, query and kv heads; not the length) each candidate's forward + backward is timed once on the
    call's own inputs (a prefix of at most MEASURE_MAX_TOKENS tokens), the per-candidate times are summed
    over every rank of the job (one collective: every rank then picks the same kernel), and the fastest
    is used for that signature from then on. A candidate that raises is out for the signature. The
    choice and its times are logged on rank 0 and kept in ``choices``.

    ``timer(fn) -> seconds`` and ``agree(tensor) -> tensor`` are injectable (CPU tests); defaults: CUDA
    events and an all-reduce over the default group. Every rank must reach a new signature at the same
    point of the program (same model, same layer order): attention calls do, packed ones included
    (``DocumentBackend`` measures the dense kernel before its varlen call).

    A layer with a sliding window or soft-capping (``window``/``softcap`` given, through :class:`Windowed`)
    has its own signature (the window and cap are part of it): its candidates are those that apply both
    (``supports_window``/``supports_softcap``) plus ``pattern_only`` (the banded kernel: exact, never a
    candidate for a full layer). It is agreed over the job like a full one: a windowed layer always runs its
    windowed kernel, whatever the sequence length (a window covering the sequence is exactly causal), so
    which signatures a rank meets, and in which order, never depends on its batch's length.
    """

    native_gqa = True  # each candidate handles GQA itself

    def __init__(self, candidates, timer=None, agree=None, pattern_only=()):
        if not candidates:
            raise ValueError("MeasuredChoice needs at least one candidate backend")
        self.candidates = list(candidates)
        self.pattern_only = list(pattern_only)
        every = self.candidates + self.pattern_only
        self.supports_window = any(c.supports_window for c in every)
        self.supports_softcap = any(c.supports_softcap for c in every)
        self.device_type = self.candidates[0].device_type
        self.name = "auto"
        self.timer = timer or _cuda_timer
        self.agree = agree or world_sum
        self.choices = {}  # signature -> {"kernel": name, "seconds": {name: s or None}}
        self._chosen = {}  # signature -> Backend

    @staticmethod
    def signature(q, k, causal: bool, window: Optional[int] = None, softcap: Optional[float] = None):
        # no sequence length: ranks of different data-parallel replicas (or documents of a packed sample) see
        # different lengths, and a signature one rank meets alone would leave the others in the collective.
        # The window and soft-cap are in it: a windowed layer and a full one may pick different kernels.
        return (str(q.dtype), bool(causal), q.shape[-1], q.shape[2], k.shape[2], int(window or 0),
                float(softcap or 0.0))

    def eligible(self, window: Optional[int] = None, softcap: Optional[float] = None):
        """The candidates for a layer with this window / soft-cap (none: the full-layer candidates)."""
        if not window and not softcap:
            return self.candidates
        return [c for c in self.candidates + self.pattern_only
                if (not window or c.supports_window) and (not softcap or c.supports_softcap)]

    def _time(self, cand, q, k, v, causal, scale, window, softcap) -> float:
        n = min(q.shape[1], MEASURE_MAX_TOKENS)
        qs, ks, vs = q[:, :n], k[:, :n], v[:, :n]

        def step():
            o, lse = cand.forward(qs, ks, vs, causal, scale, window, softcap)
            # dout = out: any tensor of the right shape
            cand.backward(o, qs, ks, vs, o, lse, causal, scale, window, softcap)

        return float(self.timer(step))

    def choose(self, q, k, v, causal: bool, scale: float, window: Optional[int] = None,
               softcap: Optional[float] = None) -> Backend:
        sig = self.signature(q, k, causal, window, softcap)
        if sig in self._chosen:
            return self._chosen[sig]
        cands = self.eligible(window, softcap)
        if not cands:
            raise KernelError(f"no kernel of {[c.name for c in self.candidates]} applies a sliding window of "
                              f"{window} and soft-capping {softcap}", "run on CPU or install flash-attn >= 2.6")
        secs = []
        for cand in cands:
            try:
                secs.append(self._time(cand, q, k, v, causal, scale, window, softcap))
            except Exception:  # noqa: BLE001 - a kernel that cannot run this signature is out for it
                secs.append(float("inf"))
        t = torch.tensor(secs, dtype=torch.float64, device=q.device)
        t = self.agree(t).cpu().tolist()
        best = min(range(len(t)), key=lambda i: (t[i], i))
        if t[best] == float("inf"):
            raise RuntimeError(f"attention 'auto': no candidate kernel ran q {tuple(q.shape)} {q.dtype}, k "
                               f"{tuple(k.shape)}, window {window}, softcap {softcap} (tried "
                               f"{[c.name for c in cands]}); name one of them as the kernel instead of 'auto' to see its "
                               "error")
        chosen = cands[best]
        self._chosen[sig] = chosen
        self.choices[sig] = {"kernel": chosen.name,
                             "seconds": {c.name: (None if s == float("inf") else s) for c, s in zip(cands, t)}}
        _log_choice(sig, self.choices[sig])
        return chosen

    def forward(self, q, k, v, causal: bool, scale: float, window=None, softcap=None):
        _check(self, q, k, v)
        w, c = self._pattern(causal, window, softcap)
        return self.choose(q, k, v, causal, scale, w, c).forward(q, k, v, causal, scale, w, c)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, window=None, softcap=None):
        w, c = self._pattern(causal, window, softcap)
        sig = self.signature(q, k, causal, w, c)
        if sig not in self._chosen:
            raise RuntimeError(f"attention 'auto': backward of a signature {sig} whose forward never ran")
        return self._chosen[sig].backward(dout, q, k, v, out, lse, causal, scale, w, c)


def _log_choice(sig, choice):
    import logging

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    times = ", ".join(f"{n} {'-' if s is None else f'{s * 1e3:.2f} ms'}" for n, s in choice["seconds"].items())
    logging.getLogger("ds_longctx").info("attention 'auto' for %s: %s (%s)", sig, choice["kernel"], times)


def kernel_names() -> Tuple[str, ...]:
    """Values ``long_context.attention.kernel`` accepts: "auto" (measured on CUDA, see MeasuredChoice), the
    named backends (sdpa_cuda_cudnn: cuDNN's fused attention; sdpa_cuda_flash: torch's bundled FA2), and
    "sdpa" (torch's flash kernel for the tensors' device)."""
    return ("auto",) + tuple(_CONFIG_NAMES) + ("sdpa",)


def available_backends():
    return [n for n, cls in BACKENDS.items() if cls.available()]


def is_known(name: str) -> bool:
    return name in ("auto", "sdpa") or name in BACKENDS


def is_available(name: str) -> bool:
    """``name`` is known and its kernel can run on this machine ("auto"/"sdpa" always: resolved per device)."""
    return name in ("auto", "sdpa") or (name in BACKENDS and BACKENDS[name].available())


def backend_for(name: str, device) -> Backend:
    """The backend for ``name`` ('auto' | 'sdpa' | a backend's name) on ``device``; KernelError when there is
    none (checks.get_backend checks a config value first and names the key)."""
    dev = torch.device(device).type
    if dev in _OVERRIDES:
        return _instance(_OVERRIDES[dev])
    if not is_available(name):
        raise KernelError(f"attention kernel {name!r} is " + ("unknown" if not is_known(name) else
                          f"not available on this machine (found: {available_backends()})"),
                          "use kernel 'auto' or 'sdpa'")
    return _resolve(name, dev)


get_backend = backend_for  # the op-level name tests and benches use


class KernelChoice:
    """One kernel name, checked before (checks.check_kernel, called by the spec builder) and trusted here,
    resolved once per device type (at its first use): what an install holds instead of resolving the name per
    forward. An :func:`overridden` device type still wins at every call (the planner's stand-in)."""

    def __init__(self, name: str):
        self.name = name
        self._by_device: Dict[str, Backend] = {}

    def on(self, device: torch.device) -> Backend:
        dev = device.type if isinstance(device, torch.device) else torch.device(device).type
        if dev in _OVERRIDES:
            return _instance(_OVERRIDES[dev])
        backend = self._by_device.get(dev)
        if backend is None:
            backend = self._by_device[dev] = _resolve(self.name, dev)
        return backend

    def check_pattern(self, window: Optional[int], softcap: Optional[float], where: str) -> None:
        """At install, no tensor yet: a named kernel (or 'sdpa') that cannot apply the layer's sliding window or
        soft-capping is refused here, naming the layer; 'auto' always finds one (the banded kernel at least)."""
        if not window and not softcap or self.name == "auto":
            return
        names = ("sdpa_cpu_flash", "sdpa_cuda_flash") if self.name == "sdpa" else (self.name,)
        for n in names:
            cls = BACKENDS[n]
            asks = ((f"a sliding window of {window} tokens", window, cls.supports_window),
                    (f"attention soft-capping {softcap}", softcap, cls.supports_softcap))
            lacking = [what for what, on, ok in asks if on and not ok]
            if lacking:
                raise KernelError(f"{where} has {' and '.join(lacking)}, which kernel {n!r} ({self.name!r}) cannot "
                                  "apply", "use kernel 'auto': it runs such layers on a kernel that applies them (a "
                                  "flash kernel with window_size / softcap, or torch_banded)")

    def for_layer(self, device: torch.device, window: Optional[int], softcap: Optional[float],
                  where: str = "this layer") -> Backend:
        """The backend of one layer with its sliding window / soft-cap bound (:class:`Windowed`), or the plain
        backend for a full-causal layer. 'auto' measured on CUDA (:class:`MeasuredChoice`) measures, for such a
        layer, the kernels that apply its window / cap (flash's native window_size / softcap) and the banded
        kernel; a single-kernel 'auto' without the capability (CPU) takes the device's banded kernel; a named
        kernel without the capability is a KernelError naming ``where`` (also raised by check_pattern at
        install). An overridden device type (the planner's stand-in) keeps its override: its ops' FLOP
        formulas count the window."""
        base = self.on(device)
        if not window and not softcap:
            return base
        dev = device.type if isinstance(device, torch.device) else torch.device(device).type
        if dev not in _OVERRIDES:
            self.check_pattern(window, softcap, where)
            if (window and not base.supports_window) or (softcap and not base.supports_softcap):
                capable = [c for c in _BANDED.get(dev, ()) if BACKENDS[c].available()]
                if not capable:
                    raise KernelError(f"{where} needs a kernel with sliding windows / soft-capping, and none is "
                                      f"available for {dev} tensors", "run on CPU or CUDA")
                base = _instance(BACKENDS[capable[0]])
        return Windowed(base, window or 0, softcap or 0.0)


def _resolve(name: str, dev: str) -> Backend:
    """The backend of an already checked ``name`` for device type ``dev`` (no override)."""
    if name == "auto":
        found = [BACKENDS[c] for c in _AUTO_ORDER.get(dev, ()) if BACKENDS[c].available()]
        if not found:
            raise KernelError(f"no attention kernel with LSE is available for {dev} tensors",
                              "run on CPU or CUDA with torch>=2.3")
        if len(found) == 1:
            return _instance(found[0])
        if dev not in _MEASURED:  # one per device type: its choices hold for the whole job
            banded = [_instance(BACKENDS[c]) for c in _BANDED.get(dev, ()) if BACKENDS[c].available()]
            _MEASURED[dev] = MeasuredChoice([_instance(c) for c in found], pattern_only=banded)
        return _MEASURED[dev]
    if name == "sdpa":
        cand = {"cpu": "sdpa_cpu_flash", "cuda": "sdpa_cuda_flash"}.get(dev)
        if cand is None or not BACKENDS[cand].available():
            raise KernelError(f"torch's flash SDPA is not available for {dev} tensors",
                              "use kernel 'auto' or run on CPU/CUDA")
        return _instance(BACKENDS[cand])
    backend = _instance(BACKENDS[name])
    if backend.device_type != dev:
        raise KernelError(f"attention kernel {name!r} runs on {backend.device_type}, the tensors are on {dev}",
                          "use kernel 'auto' or move the model to the kernel's device")
    return backend
