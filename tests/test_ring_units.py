"""Ring attention's arithmetic without processes (issue 47): the zigzag layout, the rectangles a ring step runs,
and the causal load balance counted with torch's FLOP counter on the kernels those rectangles call."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from ds_longctx.attention.kernels import get_backend
from ds_longctx.attention.ring import rectangles, ring_work
from ds_longctx.dist.layout import gathered_order, ring_length_multiple, ring_segments, shard_index, shard_spans


def test_zigzag_shards_partition_the_sequence():
    for seq, sp, ring in ((48, 4, 2), (48, 8, 8), (48, 8, 4), (24, 6, 2), (16, 4, 1)):
        assert seq % ring_length_multiple(sp, ring) == 0
        shards = [shard_index(seq, sp, ring, r) for r in range(sp)]
        assert sorted(i for s in shards for i in s) == list(range(seq))
        assert all(len(s) == seq // sp for s in shards)
        assert gathered_order(seq, sp, ring).tolist() == [i for s in shards for i in s]
    # ring rank r holds chunks r and 2R-1-r; its Ulysses ranks cut that in order
    assert shard_index(16, 4, 2, 1) == [12, 13, 14, 15] and shard_index(16, 4, 2, 2) == [4, 5, 6, 7]
    assert shard_spans(24, 6, 2, 1) == [(4, 6), (18, 20)]  # a shard straddling the ring rank's two chunks
    assert ring_length_multiple(4, 2) == 4 and ring_length_multiple(4, 4) == 8 and ring_length_multiple(6, 2) == 12


def test_rectangles_skip_what_no_document_or_window_reaches():
    seg = lambda r: ring_segments(16, 2, r)  # noqa: E731  chunks of 4: rank 0 [0,4)+[12,16), rank 1 [4,8)+[8,12)
    own = rectangles(seg(0), seg(0), [(0, 16)])
    assert [(r.kind, r.q0, r.q1, r.k0, r.k1) for r in own] == [("diag", 0, 4, 0, 4), ("full", 4, 8, 0, 4),
                                                               ("diag", 4, 8, 4, 8)]
    # rank 1's block at rank 0: only its late chunk [12,16) sees both of rank 1's chunks
    assert [(r.kind, r.q0, r.k0, r.k1) for r in rectangles(seg(0), seg(1), [(0, 16)])] == [("full", 4, 0, 4),
                                                                                          ("full", 4, 4, 8)]
    # documents [0, 6) and [6, 16): rank 0's early chunk and rank 1's second chunk [8, 12) share no document
    docs = rectangles(seg(0), seg(1), [(0, 6), (6, 16)])
    assert [(r.q0, r.q1, r.k0, r.k1) for r in docs] == [(4, 8, 2, 4), (4, 8, 4, 8)]
    # a window of 3: [12, 16) reaches back to 10 only: keys [10, 12) of rank 1's second chunk, a band
    win = rectangles(seg(0), seg(1), [(0, 16)], window=3)
    assert [(r.kind, r.q0, r.q1, r.k0, r.k1, r.offset) for r in win] == [("band", 4, 6, 6, 8, 2)]


def _counted_flops(seq, ring, rank, segments, d=16, h=2):
    """FLOPs (torch's counter, through the kernel ops' formulas) of the kernel calls ring rank ``rank`` makes."""
    kernel = get_backend("auto", "cpu")
    q = torch.randn(1, seq // ring, h, d)
    counter = FlopCounterMode(display=False)
    with counter:
        for step in range(ring):
            for rc in rectangles(segments(rank), segments((rank - step) % ring), [(0, seq)]):
                kernel.forward(q[:, rc.q0:rc.q1], q[:, rc.k0:rc.k1], q[:, rc.k0:rc.k1], rc.kind == "diag", 0.25)
    return counter.get_total_flops()


def test_zigzag_balances_causal_attention_across_8_ranks():
    """Per-rank attention FLOPs of a causal 8-rank ring, counted: zigzag within 10% of each other (exactly equal
    here); contiguous shards range from half a block (rank 0) to 7.5 blocks (rank 7)."""
    seq, ring = 256, 8
    zig = [_counted_flops(seq, ring, r, lambda x: ring_segments(seq, ring, x)) for r in range(ring)]
    n = seq // ring
    contiguous = [_counted_flops(seq, ring, r, lambda x: [(0, x * n, n)]) for r in range(ring)]
    assert max(zig) <= 1.10 * min(zig), zig
    assert max(contiguous) >= 10 * min(contiguous), contiguous  # 15x in query-key pairs
    assert sum(zig) == sum(contiguous)  # the same attention, split differently
    assert [ring_work(seq, ring, r) for r in range(ring)] == [ring_work(seq, ring, 0)] * ring


def test_mixers_past_their_heads_are_refused_naming_the_layer():
    """Past the attention heads a ring runs; a recurrent layer past its own heads runs where its channels split (Gated
    DeltaNet, KDA: tests/test_ring.py) and is one error naming the layer elsewhere: MiniMax's lightning attention has
    the attention's 2 heads, which SP=4 cannot give each rank whole."""
    import pytest

    from ds_longctx.config import ConfigError, parse
    from ds_longctx.patching.checks import check_against
    from test_hybrid import hybrid_config

    cfg = hybrid_config("minimax")
    cfg.num_attention_heads, cfg.num_key_value_heads = 2, 2
    with pytest.raises(ConfigError) as e:
        check_against(parse({"sequence_parallel_size": 4, "long_context": {"attention": {"implementation": "ulysses"}}}),
                      cfg, world_size=4)
    assert str(e.value).startswith("sequence_parallel_size: the minimax model's linear_attention layers "
                                   "(MiniMaxLightningAttention) have 2 heads"), str(e.value)
