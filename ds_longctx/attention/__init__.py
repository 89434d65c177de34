"""Untied Ulysses (UPipe) attention: kernel backends, the staged autograd Functions, HF hooking.

Entry point for the engine: ``install_untied(model, attn_cfg, group)``.
"""
from .hf import install_untied
from .kernels import available_backends, get_backend
from .untied import Schedule, untied_attention_fused, untied_attention_qkv

__all__ = ["install_untied", "untied_attention_fused", "untied_attention_qkv", "Schedule", "get_backend",
           "available_backends"]
