"""Hybrid models' sequence mixers that are not softmax attention, as far as ds_longctx runs them under SP:
which module class a layer type is, which of its tensors are per head (key heads vs value heads), what it
projects on the sequence shard before the per-head core and what it does after (gated norm, out projection).

The SP plumbing (all-to-all, conv slice, documents) is shared in ``attention/mixers.py``; this module holds only
the per-family facts. Families not listed here keep the refusal of ``checks.check_sp_attention_pattern``.

Short convolutions (``lfm2``, ``lfm2_moe``, ``lfm3``): B * x through a depthwise causal conv over the hidden channels,
gated by C: every channel is its own head.

Gated DeltaNet (``qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``, ``olmo_hybrid``): per layer a depthwise causal conv over
the q|k|v channels (key-head-major: q channel h*dk + i is key head h), then transformers' chunked gated-delta rule per
value head; value head j reads key head j // (value heads / key heads). The decay ``g`` and ``beta`` are per value
head and elementwise over tokens, so they are computed on the sequence shard from the full per-head parameters.

Kimi Delta Attention (``kimi_linear``): Gated DeltaNet's layout and plumbing with key heads = value heads, a decay per
key channel (fp32 [b, s, heads, head_dim], moved with its heads) and transformers' ``chunk_kimi_delta_attention``;
its full-attention layers are MLA, which only 'ulysses' splits (checks.py refuses it under 'untied_ulysses').

Lightning attention (``minimax``): per head q|k|v (head-major after act(qkv_proj)), a linear-attention recurrence
in blocks with a fixed per-head decay (the layer's slope buffers); the RMSNorm after it spans all heads, so it runs
after the output all-to-all. transformers has no core function for it: attention/mixers.py replays its block loop.

Mamba2 mixers (``falcon_h1``: every 'hybrid' layer runs full causal attention and a Mamba2 mixer side by side;
``granitemoehybrid``, ``bamba`` and ``nemotron_h``: their 'linear_attention' layers, the same mixer code in
transformers 5.24; nemotron_h names its groups ``n_groups`` and its heads ``mamba_num_heads``): ``in_proj`` gives z (the gate) | x | B | C | dt; x is
head-major (channel h*head_dim + i is head h), B and C are ``n_groups`` groups of ``d_state`` channels, head h reads
group h // (heads / groups). The depthwise conv runs over x|B|C, then transformers' ``mamba2_chunk_scan`` per head
(dt_bias, A_log, D per head). The gated RMSNorm after the scan normalises over whole groups of heads (granite:
``group_size`` = d_inner / n_groups; falcon: ``n_groups`` groups): it runs after the output all-to-all, on the
sequence shard over every head, so it is exactly transformers' norm whatever the groups. SP must divide the heads and
either divide the groups (each rank its groups) or be a multiple of them (each rank's heads lie in one group, whose
B/C every rank of that group receives: autograd sums their gradients back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ._common import text_config


def _decay(m, a):
    """transformers' own formula (every GDN family): g = -exp(A_log) * softplus(a + dt_bias), in fp32."""
    return -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)


def _project_qwen3_5(m, h):
    qkv = m.in_proj_qkv(h)
    z = m.in_proj_z(h)
    return qkv, z, _decay(m, m.in_proj_a(h)), m.in_proj_b(h).sigmoid()


def _project_qwen3_next(m, h):
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    qkv = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
    return qkv, z, _decay(m, a), b.sigmoid()


def _project_olmo_hybrid(m, h):
    qkv = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    beta = m.b_proj(h).sigmoid()
    if m.allow_neg_eigval:
        beta = beta * 2.0
    return qkv, m.g_proj(h), _decay(m, m.a_proj(h)), beta


def _project_kimi_linear(m, h):
    """Kimi Delta Attention: GDN's layout with as many key as value heads, and a decay per key channel (its forget
    gate, fp32 [b, s, heads, head_dim]); the output gate is per channel too."""
    qkv = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    gate = m.g_b_proj(m.g_a_proj(h)).view(h.shape[0], h.shape[1], -1, m.head_dim)
    return qkv, gate, m.forget_gate(h), m.b_proj(h).sigmoid()


def _finish_kimi_linear(m, core, gate):
    b, s = core.shape[:2]
    return m.o_proj(m.o_norm(core, gate).reshape(b, s, -1))


def _project_lightning(m, h):
    """MiniMax's lightning attention: act(qkv_proj) per head (q|k|v of head_dim each, head-major); the hidden states
    are the output gate's input."""
    return m.act_fn(m.qkv_proj(h)), h


def _finish_lightning(m, y, h):
    """transformers' forward after the block loop: RMSNorm over all heads, sigmoid output gate, out_proj."""
    return m.out_proj(torch.sigmoid(m.output_gate(h)) * m.norm(y))


def _finish_norm_out(norm: str, out: str):
    def finish(m, core, gate):
        b, s = core.shape[:2]
        x = getattr(m, norm)(core.reshape(-1, m.head_v_dim), gate.reshape(-1, m.head_v_dim))
        return getattr(m, out)(x.reshape(b, s, -1))
    return finish


def _project_short_conv(m, h):
    """LFM2's gated short conv: B * x goes through the conv, C gates its output (transformers' forward)."""
    B, C, x = m.in_proj(h).chunk(3, dim=-1)
    return B * x, C


def _finish_short_conv(m, conv, C):
    return m.out_proj(C * conv)


def _project_mamba2(m, h):
    """A Mamba2 mixer's in_proj on the sequence shard (falcon_h1 first scales it by its muP multipliers):
    (z [b, s, d_inner], x|B|C before the conv [b, s, conv_dim], dt [b, s, heads])."""
    if hasattr(m, "mup_vector"):  # FalconH1Mixer
        p = m.in_proj(h * m.ssm_in_multiplier) * m.mup_vector
    else:
        p = m.in_proj(h)
    return p.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)


def _finish_mamba2(m, y, z):
    """After the scan, on the sequence shard with every head: the gated norm (or falcon's plain silu gate when
    mamba_rms_norm is off), then the out projection, as transformers' forward."""
    if getattr(m, "mamba_rms_norm", True):
        y = m.norm(y, z)
    else:
        y = y * F.silu(z)
    return m.out_proj(y.to(z.dtype))


def _mamba2_heads(tc) -> Tuple[int, int]:
    return int(tc.mamba_n_groups), int(tc.mamba_n_heads)


def _gdn_heads(tc) -> Tuple[int, int]:
    return int(tc.linear_num_key_heads), int(tc.linear_num_value_heads)


def _gdn_dims(m) -> Tuple[int, int, int, int]:
    return m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim


@dataclass(frozen=True)
class MixerFamily:
    """One family's sequence mixer: ``kind`` (the plumbing of attention/mixers.py that runs it: 'gated_deltanet' or
    'short_conv'), the layer type in ``config.layer_types``, the module class (by name), the projections on the
    sequence shard and what follows the per-head core.

    gated_deltanet: ``project(module, hidden) -> (q|k|v before the conv [b, s, 2*kd + vd], gate, g [b, s, Hv] fp32,
    beta [b, s, Hv])``, ``finish(module, core [b, s, Hv, dv], gate)``; ``heads``: (key heads, value heads).
    short_conv: ``project(module, hidden) -> (conv input [b, s, hidden], gate)``, ``finish(module, conv output,
    gate)``; ``heads``: (channels, channels) (the conv is depthwise: a channel is a head)."""
    kind: str  # gated_deltanet, short_conv, lightning or mamba2 (project -> (z, x|B|C, dt); heads: (groups, heads))
    module_class: str
    layer_type: str
    project: Callable
    finish: Callable
    heads: Callable = _gdn_heads
    units: Tuple[str, str] = ("key heads", "value heads")
    dims: Callable = _gdn_dims  # gated_deltanet: module -> (key heads, value heads, key head dim, value head dim)
    core: str = "torch_chunk_gated_delta_rule"  # gated_deltanet: transformers' core function (of the model's module)


_QWEN_FINISH = _finish_norm_out("norm", "out_proj")
MIXERS: Dict[str, MixerFamily] = {
    "qwen3_5_text": MixerFamily("gated_deltanet", "Qwen3_5GatedDeltaNet", "linear_attention", _project_qwen3_5,
                                _QWEN_FINISH),
    "qwen3_5_moe_text": MixerFamily("gated_deltanet", "Qwen3_5MoeGatedDeltaNet", "linear_attention",
                                    _project_qwen3_5, _QWEN_FINISH),
    "qwen3_next": MixerFamily("gated_deltanet", "Qwen3NextGatedDeltaNet", "linear_attention", _project_qwen3_next,
                              _QWEN_FINISH),
    "olmo_hybrid": MixerFamily("gated_deltanet", "OlmoHybridGatedDeltaNet", "linear_attention",
                               _project_olmo_hybrid, _finish_norm_out("o_norm", "o_proj")),
    "kimi_linear": MixerFamily("gated_deltanet", "KimiLinearDeltaAttention", "linear_attention", _project_kimi_linear,
                               _finish_kimi_linear, lambda tc: (int(tc.linear_num_heads),) * 2, ("heads", "heads"),
                               lambda m: (m.num_heads, m.num_heads, m.head_dim, m.head_dim),
                               "chunk_kimi_delta_attention"),
    "minimax": MixerFamily("lightning", "MiniMaxLightningAttention", "linear_attention", _project_lightning,
                           _finish_lightning, lambda tc: (int(tc.num_attention_heads),) * 2, ("heads", "heads")),
}
for _t, _cls, _lt, _heads in (("falcon_h1", "FalconH1Mixer", "hybrid", _mamba2_heads),
                              ("granitemoehybrid", "GraniteMoeHybridMambaLayer", "linear_attention", _mamba2_heads),
                              ("bamba", "BambaMixer", "linear_attention", _mamba2_heads),
                              ("nemotron_h", "NemotronHMamba2Mixer", "linear_attention",
                               lambda tc: (int(tc.n_groups), int(tc.mamba_num_heads)))):
    MIXERS[_t] = MixerFamily("mamba2", _cls, _lt, _project_mamba2, _finish_mamba2, _heads, ("B/C groups", "heads"))
_CHANNELS = (lambda tc: (int(tc.hidden_size), int(tc.hidden_size)), ("channels", "channels"))
for _t, _cls in (("lfm2", "Lfm2ShortConv"), ("lfm2_moe", "Lfm2MoeShortConv"), ("lfm3", "Lfm3ShortConv")):
    MIXERS[_t] = MixerFamily("short_conv", _cls, "conv", _project_short_conv, _finish_short_conv, *_CHANNELS)


def mixer_for(model_config) -> Optional[MixerFamily]:
    """The family of the model's non-attention sequence mixer that ds_longctx runs under SP (None: none)."""
    return MIXERS.get(getattr(text_config(model_config), "model_type", None))


def runs_layer_type(model_config, layer_type: str) -> bool:
    fam = mixer_for(model_config)
    return fam is not None and fam.layer_type == layer_type


def attends_fully(model_config, layer_type: str) -> bool:
    """A layer type whose attention is plain causal attention beside a mixer ds_longctx splits (falcon_h1's
    'hybrid' layers: attention and a Mamba2 mixer side by side); the SP attention paths run its attention."""
    fam = mixer_for(model_config)
    return fam is not None and fam.kind == "mamba2" and fam.layer_type == "hybrid" == layer_type


def gdn_split_ok(key_heads: int, value_heads: int, sp: int) -> bool:
    """A Gated DeltaNet / KDA layer splits over ``sp`` ranks: whole key heads per rank, or each rank's value channels
    inside one key head (``sp`` a multiple of the key heads; a value head split into channel slices when ``sp`` is
    past the value heads: each value channel's recurrence is its own, attention/mixers.py)."""
    return (key_heads % sp == 0 or sp % key_heads == 0) and (value_heads % sp == 0 or sp % value_heads == 0)


def mamba2_groups_ok(groups: int, heads: int, sp: int) -> bool:
    """Each rank runs whole heads and either whole B/C groups or heads of one group only."""
    return heads % sp == 0 and (groups % sp == 0 or sp % groups == 0)


def check_mixer_heads(model_config, sp: int, key: str) -> None:
    """Key and value heads of the mixer divide by the SP degree (each rank runs whole heads), else one error naming
    the counts and the degrees that work. Pure."""
    fam = mixer_for(model_config)
    if fam is None or sp <= 1:
        return
    tc = text_config(model_config)
    hk, hv = fam.heads(tc)
    if fam.kind == "mamba2":
        if not mamba2_groups_ok(hk, hv, sp):
            ok = [d for d in range(1, hv + 1) if mamba2_groups_ok(hk, hv, d)]
            raise ConfigError(key, f"the {tc.model_type} model's {fam.layer_type} layers ({fam.module_class}) have "
                              f"{hv} heads in {hk} B/C groups; sequence_parallel_size {sp} must divide the heads and "
                              "divide the groups or be a multiple of them (each rank runs whole heads over the "
                              "gathered sequence, with whole groups or within one group)",
                              f"use a sequence_parallel_size of {', '.join(map(str, ok[:12]))}"
                              f"{', ...' if len(ok) > 12 else ''}")
        return
    if fam.kind == "gated_deltanet":
        if not gdn_split_ok(hk, hv, sp):
            ok = [d for d in range(1, 4 * max(hk, hv) + 1) if gdn_split_ok(hk, hv, d)]
            counts = f"{hk} {fam.units[0]} and {hv} {fam.units[1]}" if fam.units[0] != fam.units[1] else \
                f"{hk} {fam.units[0]}"
            raise ConfigError(key, f"the {tc.model_type} model's {fam.layer_type} layers ({fam.module_class}) have "
                              f"{counts}; sequence_parallel_size {sp} must divide them or be a multiple of them "
                              "(each rank runs whole key heads, or its value channels inside one key head)",
                              f"use a sequence_parallel_size of {', '.join(map(str, ok[:12]))}"
                              f"{', ...' if len(ok) > 12 else ''}")
        return
    if hk % sp or hv % sp:
        ok = [d for d in range(1, max(hk, hv) + 1) if hk % d == 0 and hv % d == 0]
        counts = f"{hk} {fam.units[0]} and {hv} {fam.units[1]}" if fam.units[0] != fam.units[1] else \
            f"{hk} {fam.units[0]}"
        raise ConfigError(key, f"the {tc.model_type} model's {fam.layer_type} layers ({fam.module_class}) have "
                          f"{counts}, which sequence_parallel_size {sp} does not divide (each rank runs whole "
                          "heads over the gathered sequence)",
                          f"use a sequence_parallel_size dividing {'both' if fam.units[0] != fam.units[1] else 'it'}: "
                          f"{', '.join(map(str, ok[:12]))}{', ...' if len(ok) > 12 else ''}")


__all__ = ["MIXERS", "MixerFamily", "attends_fully", "check_mixer_heads", "gdn_split_ok", "mamba2_groups_ok", "mixer_for",
           "runs_layer_type"]
