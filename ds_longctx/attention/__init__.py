"""Untied Ulysses (UPipe) attention: kernel backends, the staged autograd Functions, HF hooking.

Entry points for ``patch.patch_model``: ``install_untied(model, spec)`` and
``ulysses.install_ulysses(model, spec)`` (a ``ds_longctx.patching.spec.LongContextSpec``, trusted as built); both write
transformers' attention table only through ``registry`` (its one writer).
"""
from .hf import install_untied
from .kernels import available_backends, get_backend
from .untied import Schedule, untied_attention_fused, untied_attention_qkv

__all__ = ["install_untied", "untied_attention_fused", "untied_attention_qkv", "Schedule", "get_backend",
           "available_backends"]
