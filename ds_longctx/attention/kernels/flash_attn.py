"""flash-attn 2 and 3 as backends: their private forward/backward functions bound by signature (the installed
release's names and arguments), windows and soft-caps as far as the release takes them, probed once against the
banded kernel before they are trusted (:func:`verify_native_pattern`)."""
from __future__ import annotations

import importlib.util
import torch
from typing import Dict, Tuple

from .banded import verify_native_pattern
from .base import Backend, KernelError
from .base import flash_window


_FLASH_DEFAULTS = dict(dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, return_softmax=False, deterministic=False, rng_state=None)






def _params(fn):
    """The parameters of a flash-attn function; its private fwd/bwd are torch custom ops in current
    releases (CustomOpDef, whose own signature is (*args, **kwargs)): the wrapped function's."""
    import inspect

    return inspect.signature(getattr(fn, "_init_fn", fn)).parameters


def flash_pattern_kwargs(fn, window: int, softcap: float, name: str) -> Dict[str, object]:
    """Keyword arguments that give flash-attn's ``fn`` a sliding ``window`` and ``softcap`` (both 0: none), by
    the parameter names of the installed release: ``window_size_left/right`` (FA2 >= 2.7), ``window_size``
    (left, right) (FA2 2.3-2.6, FA3), ``softcap`` (FA2 >= 2.6, FA3). A release without the parameter is an
    error (never a dropped window or cap)."""
    params = _params(fn)
    kw: Dict[str, object] = {}
    if window and window > 0:
        left, right = flash_window(window)
        if "window_size_left" in params and "window_size_right" in params:
            kw.update(window_size_left=left, window_size_right=right)
        elif "window_size" in params:
            kw["window_size"] = (left, right)
        else:
            raise KernelError(f"{name}: the installed {getattr(fn, '__name__', fn)} takes no window size",
                              "upgrade flash-attn (>= 2.3) or use kernel 'auto'")
    if softcap and softcap > 0:
        if "softcap" not in params:
            raise KernelError(f"{name}: the installed {getattr(fn, '__name__', fn)} takes no softcap",
                              "upgrade flash-attn (>= 2.6) or use kernel 'auto'")
        kw["softcap"] = float(softcap)
    return kw


def _takes(module: str, fns: Tuple[str, ...], any_of: Tuple[str, ...]) -> bool:
    """Whether every one of ``fns`` of the installed ``module`` takes one of the parameters ``any_of``."""
    if not torch.cuda.is_available() or importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        mod = importlib.import_module(module)
        return all(any(p in _params(getattr(mod, f)) for p in any_of) for f in fns)
    except Exception:  # noqa: BLE001 - a broken install applies nothing (check_kernel reports it unavailable)
        return False


class _Capability:
    """A class attribute read from the installed library's signatures at its first read (cached)."""

    def __init__(self, module: str, fns: Tuple[str, ...], any_of: Tuple[str, ...]):
        self.args, self.value = (module, fns, any_of), None

    def __get__(self, obj, cls=None) -> bool:
        if self.value is None:
            self.value = _takes(*self.args)
        return self.value


def call_by_name(fn, **known):
    """flash-attn's private fwd/bwd signatures change between releases: bind by parameter name."""
    import inspect

    kwargs = {}
    for name, p in _params(fn).items():
        if name in known:
            kwargs[name] = known[name]
        elif name in _FLASH_DEFAULTS:
            kwargs[name] = _FLASH_DEFAULTS[name]
        elif p.default is inspect.Parameter.empty:
            kwargs[name] = None  # cu_seqlens_*, page tables, descales, ...: unused for dense batches
    return fn(**kwargs)


def _lse_from(res, q):
    # the LSE's position in the returned tuple differs by release; it is the [b, h, s_q] fp32 tensor
    b, s, h, _ = q.shape
    for t in res[1:]:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (b, h, s):
            return t
    raise RuntimeError("flash-attn forward returned no [b, h, s] float32 LSE; unsupported flash-attn version")


_FA2_FNS = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


_FA3_FNS = ("_flash_attn_forward", "_flash_attn_backward")


class _FlashAttnPrivate(Backend):
    """flash-attn's private ``_flash_attn_forward/_backward`` (FA2 and FA3 alike), the window and soft-cap passed
    by the argument names the installed release takes (flash_pattern_kwargs). ``_module`` imports the release."""
    native_gqa = True
    device_type = "cuda"

    @staticmethod
    def _module():
        raise NotImplementedError

    def _fwd(self, q, k, v, causal, scale):
        return self._fwd_pattern(q, k, v, causal, scale, 0, 0.0)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        return self._bwd_pattern(dout, q, k, v, out, lse, causal, scale, 0, 0.0)

    def _fwd_pattern(self, q, k, v, causal, scale, window, softcap):
        fn = self._module()._flash_attn_forward
        if window > 0 or softcap > 0:
            verify_native_pattern(self, q, window, softcap)
        res = call_by_name(fn, q=q, k=k, v=v, softmax_scale=scale, causal=causal,
                            **flash_pattern_kwargs(fn, window, softcap, self.name))
        return res[0], _lse_from(res, q)

    def _bwd_pattern(self, dout, q, k, v, out, lse, causal, scale, window, softcap):
        fn = self._module()._flash_attn_backward
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        call_by_name(fn, dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                      softmax_scale=scale, causal=causal, **flash_pattern_kwargs(fn, window, softcap, self.name))
        return dq, dk, dv


class FlashAttn2(_FlashAttnPrivate):
    """flash_attn 2.x private fwd/bwd (the public autograd wrapper does not expose a backward from the LSE).
    Sliding windows and soft-capping natively where the installed release takes them (window_size: 2.3,
    softcap: 2.6), dense and varlen (attention/documents.py)."""
    name = "flash_attention_2"
    supports_window = _Capability("flash_attn.flash_attn_interface", _FA2_FNS, ("window_size", "window_size_left"))
    supports_softcap = _Capability("flash_attn.flash_attn_interface", _FA2_FNS, ("softcap",))

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None

    @staticmethod
    def _module():
        from flash_attn import flash_attn_interface

        return flash_attn_interface


class FlashAttn3(_FlashAttnPrivate):
    """flash_attn_interface (FA3, Hopper) private fwd/bwd; window_size and softcap natively."""
    name = "flash_attention_3"
    supports_window = _Capability("flash_attn_interface", _FA3_FNS, ("window_size", "window_size_left"))
    supports_softcap = _Capability("flash_attn_interface", _FA3_FNS, ("softcap",))

    @staticmethod
    def available() -> bool:
        if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn_interface") is None:
            return False
        return torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def _module():
        import flash_attn_interface

        return flash_attn_interface
