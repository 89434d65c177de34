"""Issue 51, item 1: ``ds_longctx.token_logprobs`` (per-token log-probabilities of given tokens on this rank's sequence
shard, over row tiles through the lm_head, temperature as TRL applies it, entropy, KL to a reference) and its
reductions over the SP group, equal to one process's ``log_softmax(logits / T).gather`` at SP=2 and SP=4 (ulysses and
untied, the whole memory stack, ZeRO-3, fp32), for a plain, a padded (TRL's prompt + completion: left and right
padding, a completion masked whole) and a packed batch (documents crossing the shard edges); a GRPO-style loss built
on the reductions trains the same SGD deltas; Llama, a hybrid (Qwen3-Next) and an MLA model (DeepSeek-V3); a 2-head
Llama at SP=4 (Ulysses 2 x ring 2: zigzag shards, the per-token values put back in token order).

Tolerance: per-token values rel 1e-6 of the largest (measured 1e-7 on the 2-core box: the tiles' log-softmax against
the whole row's); losses rel 1e-5 and deltas elementwise (rtol 1e-4, atol 1e-6), as tests/test_trainer_families.py."""
import math

import pytest
import torch

import rl_cases
from rl_cases import KINDS

# {SP degree: [(family, implementation)]}: each family under ulysses at one degree and untied (the whole stack for
# Llama and the hybrid) at the other; Llama under both at each
CASES = {2: [("llama", "ulysses"), ("llama", "untied+stack"), ("qwen3_next", "untied+stack"),
             ("deepseek_v3", "untied")],
         4: [("llama", "untied+stack"), ("llama", "ulysses+stack"), ("qwen3_next", "ulysses"),
             ("deepseek_v3", "ulysses"), ("llama_2h", "untied+stack"), ("llama_2h", "ulysses")]}


def _worker(rank, world, cases):
    return {case: rl_cases.sp_run(*case, rank, world) for case in cases}


@pytest.fixture(scope="module")
def runs():
    from dist_utils import runs_per_degree

    return runs_per_degree(_worker, CASES)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.distributed
@pytest.mark.parametrize("sp,case", [(sp, c) for sp, cs in CASES.items() for c in cs])
def test_token_logprobs_equal_one_process(sp, case, runs):
    from dist_utils import result_or_raise

    family, impl = case
    ref, ref_deltas, params = rl_cases.reference(family)
    for rank, got in enumerate(result_or_raise(runs[sp])):
        out, deltas = got[case]
        for kind in KINDS:
            lp, ent, kl, loss = out[kind]
            rlp, rent, rkl, rloss = ref[kind]
            print(f"RESULT sp={sp} {family} {impl} {kind} rank={rank} lp={_rel(lp, rlp):.1e} ent={_rel(ent, rent):.1e} "
                  f"kl_abs={float((kl - rkl).abs().max()):.1e} loss={loss:.7f} ref={rloss:.7f}")
            assert _rel(lp, rlp) < 1e-6 and _rel(ent, rent) < 1e-6, (sp, case, kind)
            assert float((kl - rkl).abs().max()) < 1e-6 * float(rlp.abs().max()), (sp, case, kind)
            assert math.isclose(loss, rloss, rel_tol=1e-5), (sp, case, kind, loss, rloss)
        print(f"RESULT sp={sp} {family} {impl} rank={rank} delta_err="
              f"{max(float((deltas[n] - ref_deltas[n]).abs().max()) for n in ref_deltas):.1e} delta_max="
              f"{max(float(d.abs().max()) for d in ref_deltas.values()):.1e}")
        bad = {n: float((deltas[n] - ref_deltas[n]).abs().max()) for n in ref_deltas
               if not torch.allclose(deltas[n], ref_deltas[n], rtol=1e-4, atol=1e-6)}
        assert not bad, (sp, case, bad)
        assert max(float(d.abs().max()) for d in ref_deltas.values()) > 0


def _tiled_step_peak(shards: int, seq: int = 256, hidden: int = 64, vocab: int = 4096, temperature: float = 0.7):
    """Peak live bytes above what is held before (hidden states, lm_head) of the per-token log-prob + entropy step and
    its backward through ``memory.tiling.tiled_token_fields`` with TRL's temperature (patching.patch.with_temperature),
    or untiled (``shards`` 0: log_softmax of the whole [seq, vocab] logits)."""
    from ds_longctx.loss import fused_token_fields, lm_logits
    from ds_longctx.measure.live_bytes import LiveBytesTracker
    from ds_longctx.memory.tiling import tiled_token_fields
    from ds_longctx.patching.patch import with_temperature

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    x = torch.randn(1, seq, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, seq))
    fn = with_temperature(None, temperature)
    with LiveBytesTracker() as t:
        if shards:
            f = tiled_token_fields(x, head, labels, shards, fn)
        else:
            f = fused_token_fields(lm_logits(head, x, fn), labels)
        (-(f["log_probs"].sum() + 0.01 * f["entropy"].sum())).backward()
    return t.peak, seq * vocab * 4


def test_tiled_logprob_step_peak_is_below_the_logits_by_the_tile_factor():
    """Measured with the live-bytes tracker (bytes, not time: the same on any machine): the untiled step's peak holds
    about five [seq, vocab] fp32 tensors (logits, log-softmax, probabilities, their products and gradient: 5,246,348 B
    for 1,048,576 B of logits); the tiled step the same for one tile's rows, plus what does not scale with the logits
    (lm_head's fp32 gradient, the hidden states' gradient): 1,592,176 B at 4 tiles, 609,632 B at 16 (2026-11-29)."""
    seq, hidden, vocab = 128, 32, 2048
    untiled, logits = _tiled_step_peak(0, seq, hidden, vocab)
    fixed = 2 * (vocab * hidden + seq * hidden) * 4  # lm_head's and the hidden states' fp32 gradients, twice
    tiled = {k: _tiled_step_peak(k, seq, hidden, vocab)[0] for k in (4, 16)}
    print(untiled, logits, tiled)
    assert untiled > 4 * logits
    for k, peak in tiled.items():
        assert peak < untiled / k + fixed, (k, peak, untiled)
    assert tiled[16] < logits  # below even the logits alone
