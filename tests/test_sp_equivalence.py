"""Ulysses SP through ds_longctx.initialize equals single-process training: loss and SGD parameter
deltas (lr=1, no clipping) under ZeRO-1, 2 and 3, for MHA, GQA, MQA and KV replication; and, as every shipped
config trains, with gradient clipping that bites and two accumulated micro-batches (Ulysses at ZeRO-1; untied
attention with the whole memory stack at ZeRO-3): the global norm over the SP ranks' and ZeRO partitions' gradients and the
accumulation scale equal one process's (SP=2). (Clipping that bites hides a uniform gradient scale error, which the
unclipped cases catch; it exposes a wrong norm.)"""
import math

import pytest
import torch

from dist_utils import result_or_raise, runs_per_degree
from sp_cases import reference_step, sample, sp_step

pytestmark = pytest.mark.distributed  # every test here spawns processes

SHAPES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "mqa": dict(heads=4, kv_heads=1),  # replicated KV for SP>1
    "gqa_repl": dict(heads=8, kv_heads=2, head_dim=4),  # SP=4 > 2 KV heads: replication x2
}
SEQ, VOCAB = 16, 64
CLIP = 0.25  # the reference's gradient norm is several times this: the clip coefficient is far from 1 (checked)
ULYSSES = {"attention": {"implementation": "ulysses"}}
STACK = {"attention": {"implementation": "untied_ulysses"},
         "activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2}}
# (label, long_context section, clip and accumulate): the accumulated step's micro-batches are sample() and a second
# sample of another seed
LCS = {"ulysses": (ULYSSES, False), "clip_accumulate": (ULYSSES, True), "stack_clip_accumulate": (STACK, True)}


def _cases(sp):
    shapes = ["mha", "gqa", "mqa"] if sp == 2 else ["mha", "gqa_repl", "mqa"]
    cases = [(s, z, "ulysses") for s in shapes for z in (1, 2, 3)]
    if sp == 2:  # the SP=4 spawn, 4 processes on the CI's 2 cores, is the longer one: the added cases go here
        cases += [("gqa", 1, "clip_accumulate"), ("gqa", 3, "stack_clip_accumulate")]
    return cases


def _more(label):
    return (sample(SEQ, VOCAB, seed=7),) if LCS[label][1] else ()


def _worker(rank, world, cases):
    out = {}
    for shape, stage, label in cases:
        lc, clipped = LCS[label]
        out[(shape, stage, label)] = sp_step(dict(SHAPES[shape], vocab=VOCAB), sample(SEQ, VOCAB), stage, world, lc=lc,
                                             clip=CLIP if clipped else 0.0, more=_more(label))
    return out


def _check(results, cases):
    for shape, stage, label in cases:
        clipped = LCS[label][1]
        ref = reference_step(dict(SHAPES[shape], vocab=VOCAB), sample(SEQ, VOCAB), clip=CLIP if clipped else 0.0,
                             more=_more(label))
        ref_loss, ref_deltas, ref_init = ref[:3]
        if clipped:
            assert ref[3] > 4 * CLIP, (shape, stage, label, ref[3])  # the clip bites
        for rank_out in results:
            loss, deltas, init = rank_out[(shape, stage, label)]
            for n in ref_init:  # same seed -> same initial weights in every layout
                assert torch.equal(init[n], ref_init[n]), (shape, stage, n)
            for a, b in zip(loss if clipped else [loss], ref_loss if clipped else [ref_loss]):
                assert math.isclose(a, b, rel_tol=1e-6), (shape, stage, label, loss, ref_loss)
            for n, ref_d in ref_deltas.items():
                torch.testing.assert_close(deltas[n], ref_d, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{shape} zero{stage} {label} {n}: {m}")


@pytest.fixture(scope="module")
def sp_results():
    """The SP 2 and SP 4 spawns started side by side, once; each test below checks its own."""
    return runs_per_degree(_worker, {sp: _cases(sp) for sp in (2, 4)})


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_matches_single_process(sp, sp_results):
    cases = _cases(sp)
    results = result_or_raise(sp_results[sp])
    _check(results, cases)
