"""Issue 51, item 1: ``ds_longctx.token_logprobs`` (per-token log-probabilities of given tokens on this rank's sequence
shard, over row tiles through the lm_head, temperature as TRL applies it, entropy, KL to a reference) and its
reductions over the SP group, equal to one process's ``log_softmax(logits / T).gather`` at SP=2 and SP=4 (ulysses and
untied, the whole memory stack, ZeRO-3, fp32), for a plain, a padded (TRL's prompt + completion: left and right
padding, a completion masked whole) and a packed batch (documents crossing the shard edges); a GRPO-style loss built
on the reductions trains the same SGD deltas; Llama, a hybrid (Qwen3-Next) and an MLA model (DeepSeek-V3).

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
             ("deepseek_v3", "ulysses")]}


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
            print(sp, case, kind, rank, _rel(lp, rlp), _rel(ent, rent), _rel(kl, rkl), loss, rloss)
            assert _rel(lp, rlp) < 1e-6 and _rel(ent, rent) < 1e-6, (sp, case, kind)
            assert float((kl - rkl).abs().max()) < 1e-6 * float(rlp.abs().max()), (sp, case, kind)
            assert math.isclose(loss, rloss, rel_tol=1e-5), (sp, case, kind, loss, rloss)
        bad = {n: float((deltas[n] - ref_deltas[n]).abs().max()) for n in ref_deltas
               if not torch.allclose(deltas[n], ref_deltas[n], rtol=1e-4, atol=1e-6)}
        assert not bad, (sp, case, bad)
        assert max(float(d.abs().max()) for d in ref_deltas.values()) > 0
