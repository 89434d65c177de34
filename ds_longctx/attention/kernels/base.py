"""The backend contract: layout, the interface that keeps the log-sum-exp (:class:`Backend`: forward/backward
with GQA, sliding window and soft-cap checks), :class:`KernelError`, and the registry of backends by name (what
``register_backend`` and ``overridden`` change; nothing assigns these dicts from outside)."""
from __future__ import annotations

import contextlib
import torch
from typing import Dict, List, Optional, Tuple, Type

from ...config import KERNEL_NAMES


aten = torch.ops.aten


class KernelError(ValueError):
    """A kernel that cannot run what it is asked (a window or soft-cap it does not apply, a build that drops
    them, another device's tensors), in op terms: ``problem`` and ``fix`` name kernels, not a config key. The
    layer that took the kernel name from the config (checks.get_backend, the attention installs) re-raises it
    as the ConfigError naming ``long_context.attention.kernel`` (errors.naming)."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")

    def __reduce__(self):
        return (type(self), (self.problem, self.fix))


class Backend:
    name = "base"
    native_gqa = False
    device_type = "cpu"
    supports_window = False   # applies a sliding window (never silently ignores one: forward refuses)
    supports_softcap = False  # applies attention logit soft-capping

    @staticmethod
    def available() -> bool:
        return False

    def _fwd(self, q, k, v, causal, scale):
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        raise NotImplementedError

    # True: the planner's stand-in, whose kernel is the ops' fake (it never runs on real tensors)
    fake_only = False

    def _through_op(self) -> bool:
        # registered backends (and the planner's stand-in) run as the custom ops below, so fake tensors, torch's
        # FlopCounterMode and torch.compile see one op with a fake and a FLOP formula; a subclass defined
        # elsewhere (tests) is called directly
        return self.fake_only or BACKENDS.get(self.name) is type(self)

    def _fwd_pattern(self, q, k, v, causal, scale, window: int, softcap: float):
        """The kernel with a sliding window (``window`` > 0) and/or soft-capping (``softcap`` > 0); a backend
        that supports neither only ever gets window 0 and softcap 0 (``forward`` refuses the rest)."""
        if window > 0 or softcap > 0:
            raise NotImplementedError(f"{self.name} applies no sliding window or soft-capping")
        return self._fwd(q, k, v, causal, scale)

    def _bwd_pattern(self, dout, q, k, v, out, lse, causal, scale, window: int, softcap: float):
        if window > 0 or softcap > 0:
            raise NotImplementedError(f"{self.name} applies no sliding window or soft-capping")
        return self._bwd(dout, q, k, v, out, lse, causal, scale)

    def fwd(self, q, k, v, causal, scale, window: int = 0, softcap: float = 0.0):
        if self._through_op():
            return torch.ops.ds_longctx.attention_forward(q, k, v, causal, float(scale), self.name, int(window),
                                                          float(softcap))
        return self._fwd_pattern(q, k, v, causal, scale, int(window), float(softcap))

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window: int = 0, softcap: float = 0.0):
        if self._through_op():
            return torch.ops.ds_longctx.attention_backward(dout, q, k, v, out, lse, causal, float(scale), self.name,
                                                           int(window), float(softcap))
        return self._bwd_pattern(dout, q, k, v, out, lse, causal, scale, int(window), float(softcap))

    def _pattern(self, causal, window, softcap) -> Tuple[int, float]:
        """(window, softcap) as the ops take them (0: none); refuses what this backend would drop."""
        w = int(window) if window else 0
        c = float(softcap) if softcap else 0.0
        if w < 0 or c < 0:
            raise ValueError(f"{self.name}: sliding window {window!r} and soft-cap {softcap!r} must be positive")
        if w and not causal:
            raise ValueError(f"{self.name}: a sliding window needs causal attention")
        if not self.fake_only and ((w and not self.supports_window) or (c and not self.supports_softcap)):
            what = " and ".join(n for n, on in (("a sliding window", w and not self.supports_window),
                                                ("attention soft-capping", c and not self.supports_softcap)) if on)
            raise KernelError(f"kernel {self.name!r} cannot apply {what}",
                              "use kernel 'auto', which picks a kernel that applies them")
        return w, c

    def forward(self, q, k, v, causal: bool, scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        _check(self, q, k, v)
        w, c = self._pattern(causal, window, softcap)
        rep = q.shape[2] // k.shape[2]
        if rep > 1 and not self.native_gqa:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return self.fwd(q, k, v, causal, scale, w, c)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, window: Optional[int] = None,
                 softcap: Optional[float] = None):
        w, c = self._pattern(causal, window, softcap)
        rep = q.shape[2] // k.shape[2]
        if rep > 1 and not self.native_gqa:
            b, s, hk, d = k.shape
            ke, ve = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            dq, dk, dv = self.bwd(dout, q, ke, ve, out, lse, causal, scale, w, c)
            return dq, dk.view(b, s, hk, rep, d).sum(3), dv.view(b, s, hk, rep, d).sum(3)
        return self.bwd(dout, q, k, v, out, lse, causal, scale, w, c)


def _check(backend, q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{backend.name}: q/k/v must be [b, s, h, d], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0 or k.shape != v.shape:
        raise ValueError(f"{backend.name}: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads "
                         f"(k {tuple(k.shape)}, v {tuple(v.shape)})")
    if q.device.type != backend.device_type:
        raise KernelError(f"{backend.name} runs on {backend.device_type} tensors, got {q.device}",
                          "use kernel 'auto' or a kernel for this device")


def _bhsd(t):
    # [b, s, h, d] -> [b, h, s, d] view: torch's flash ops take this layout and read strides
    return t.transpose(1, 2)


# The registration seam: backends by name, the per-device "auto" order, and per-device overrides.
# Callers change these only through register_backend / overridden (never by assigning module attributes).
BACKENDS: Dict[str, Type[Backend]] = {}


_AUTO_ORDER: Dict[str, Tuple[str, ...]] = {}


_OVERRIDES: Dict[str, Type[Backend]] = {}  # device type -> the backend every kernel name resolves to


_INSTANCES: Dict[type, Backend] = {}


_MEASURED: Dict[str, "Backend"] = {}  # device type -> the "auto" of that device (several candidates)


_CONFIG_NAMES: List[str] = []  # backends a config may name (the rest are reached via "auto"/"sdpa")


def register_backend(cls: Type[Backend], auto: bool = False, config_name: bool = False) -> Type[Backend]:
    """Register ``cls`` under ``cls.name``. ``auto=True`` appends it to the "auto" order of its device type
    (earlier registrations are preferred); ``config_name=True`` lets ``long_context.attention.kernel`` name
    it: config.KERNEL_NAMES lists the names a config accepts (config.py is a leaf: it imports no op), so a name
    missing there is refused here)."""
    if config_name and cls.name not in KERNEL_NAMES:
        raise ValueError(f"register_backend: {cls.name!r} is not in ds_longctx.config.KERNEL_NAMES; add it there for "
                         "long_context.attention.kernel to accept it")
    BACKENDS[cls.name] = cls
    if config_name and cls.name not in _CONFIG_NAMES:
        _CONFIG_NAMES.append(cls.name)
    if auto:
        _AUTO_ORDER[cls.device_type] = _AUTO_ORDER.get(cls.device_type, ()) + (cls.name,)
    return cls


@contextlib.contextmanager
def overridden(device_type: str, cls: Type[Backend]):
    """Inside the block every kernel name resolves to ``cls`` for tensors on ``device_type`` (the planner's
    meta stand-in device: a config naming a CUDA kernel means that kernel's memory on the GPU)."""
    if device_type in _OVERRIDES:
        raise RuntimeError(f"attention kernels for {device_type!r} are already overridden")
    _OVERRIDES[device_type] = cls
    try:
        yield
    finally:
        _OVERRIDES.pop(device_type, None)
        _INSTANCES.pop(cls, None)


def _instance(cls: Type[Backend]) -> Backend:
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]


def flash_window(window: int) -> Tuple[int, int]:
    """flash's (window_size_left, window_size_right) for transformers' sliding ``window`` with causal attention:
    query i sees keys (i - window, i], i.e. window - 1 keys to its left and none to its right (what
    transformers' own flash path passes, modeling_flash_attention_utils: (window - 1, window - 1) with causal,
    whose right part flash sets to 0 under causal). (-1, -1): no window."""
    return (int(window) - 1, 0) if window and window > 0 else (-1, -1)


def torch_flash_window_kwargs(window: int) -> Dict[str, int]:
    """Keyword arguments of aten._flash_attention_forward/_backward for a sliding ``window`` ({} for none)."""
    if not window or window <= 0:
        return {}
    left, right = flash_window(window)
    return {"window_size_left": left, "window_size_right": right}
