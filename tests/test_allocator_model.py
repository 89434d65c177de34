"""The caching-allocator model (measure/allocator.py) on traces whose reserved bytes follow by hand from the
allocator's rules (c10/cuda/CUDACachingAllocator.cpp)."""
import pytest

from ds_longctx.measure.allocator import (CachingAllocatorModel, check_step, events_from_snapshot, replay, round_size,
                                        segment_size)

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(4096) == 2 * MiB            # small pool: 2 MiB segments
    assert segment_size(3 * MiB) == 20 * MiB        # 1-10 MiB: a 20 MiB segment
    assert segment_size(11 * MiB + 1) == 12 * MiB   # >= 10 MiB: rounded up to 2 MiB


def test_classic_segments_reuse_split_and_grow():
    a = CachingAllocatorModel(expandable_segments=False)
    a.alloc("x", 100 * MiB)
    assert a.reserved == 100 * MiB
    a.free("x")
    a.alloc("y", 50 * MiB)                 # best fit: the cached 100 MiB block, split (rest 50 MiB > 1 MiB)
    assert a.reserved == 100 * MiB and a.allocated == 50 * MiB
    a.alloc("z", 60 * MiB)                 # the 50 MiB rest does not fit: a new 60 MiB segment
    assert a.reserved == 160 * MiB
    a.free("y")
    a.alloc("w", 100 * MiB)                # y's 50 MiB merged back with its free 50 MiB neighbour: fits
    assert a.reserved == 160 * MiB
    a.alloc("s", 1000)                     # small request: a 2 MiB small-pool segment
    assert a.reserved == 162 * MiB and a.allocated == 160 * MiB + 1024
    a.alloc("s2", 1000)                    # the same small segment
    assert a.reserved == 162 * MiB


def test_classic_no_split_of_a_rest_up_to_1mib():
    a = CachingAllocatorModel(expandable_segments=False)
    a.alloc("x", 20 * MiB)
    a.free("x")
    a.alloc("y", 19 * MiB + 512 * 1024)    # rest 0.5 MiB <= 1 MiB: the whole block is handed out
    assert a.allocated == 20 * MiB


def test_expandable_maps_pages_and_keeps_holes():
    a = CachingAllocatorModel(expandable_segments=True)
    a.alloc("A", 100 * MiB)                # 5 pages of 20 MiB
    a.alloc("B", 30 * MiB)                 # 2 more pages (40 MiB mapped), 10 MiB free behind B
    assert a.reserved == 140 * MiB
    a.free("A")                            # a 100 MiB hole before B
    a.alloc("C", 120 * MiB)                # no free block of 120 MiB: the end grows by 120 - 10 -> 6 pages
    assert a.reserved == 260 * MiB
    a.alloc("D", 90 * MiB)                 # fits the hole
    assert a.reserved == 260 * MiB
    assert a.peak_allocated == 240 * MiB


def test_expandable_grows_its_free_end_block():
    a = CachingAllocatorModel(expandable_segments=True)
    a.alloc("A", 100 * MiB)
    a.free("A")                            # the end block is free: growing it maps only the shortfall
    a.alloc("B", 150 * MiB)
    assert a.reserved == 160 * MiB         # 100 + 3 pages


def test_expandable_prefers_a_block_that_cannot_grow():
    a = CachingAllocatorModel(expandable_segments=True)
    a.alloc("A", 60 * MiB)
    a.alloc("B", 20 * MiB)
    a.alloc("C", 40 * MiB)                 # exactly 6 pages
    a.free("A")                            # 60 MiB hole at the start
    a.free("C")                            # 40 MiB free block at the end (can grow)
    a.alloc("D", 30 * MiB)                 # best fit by size is the 40 MiB end block; the 60 MiB hole is taken
    a.alloc("E", 40 * MiB)                 # so the end block still holds 40 MiB: no new page
    assert a.reserved == 120 * MiB


def test_replay_events_and_errors():
    r = replay([("+", 1, 100 * MiB), ("+", 2, 30 * MiB), ("-", 1), ("+", 3, 120 * MiB)])
    assert (r.peak_allocated, r.peak_reserved, r.events) == (150 * MiB, 260 * MiB, 4)
    assert r.slack == 110 * MiB
    with pytest.raises(ValueError, match="already live"):
        replay([("+", 1, 10), ("+", 1, 10)])


def test_events_from_a_snapshot_trace():
    snap = {"device_traces": [[
        {"action": "segment_map", "addr": 0, "size": 20 * MiB},
        {"action": "alloc", "addr": 0, "size": 4 * MiB},
        {"action": "alloc", "addr": 4 * MiB, "size": 2 * MiB},
        {"action": "free_requested", "addr": 0, "size": 4 * MiB},
        {"action": "free_completed", "addr": 0, "size": 4 * MiB},
        {"action": "alloc", "addr": 0, "size": 1 * MiB},
    ]]}
    ev = events_from_snapshot(snap)
    assert [e[0] for e in ev] == ["+", "+", "-", "+"]
    assert replay(ev).peak_allocated == 6 * MiB


def test_check_step_rebuilds_the_start_and_replays_the_step():
    start = {"segments": [{"device": 0, "address": 0, "total_size": 100 * MiB, "blocks": [
        {"size": 40 * MiB, "state": "active_allocated"}, {"size": 20 * MiB, "state": "inactive"},
        {"size": 40 * MiB, "state": "active_allocated"}]}]}
    end = {"device_traces": [[
        {"action": "alloc", "addr": 1 << 40, "size": 20 * MiB},   # takes the 20 MiB hole
        {"action": "alloc", "addr": 2 << 40, "size": 30 * MiB},   # grows the range by 2 pages
        {"action": "free_completed", "addr": 1 << 40, "size": 20 * MiB},
    ]]}
    r = check_step(start, end)
    assert (r["seed_reserved"], r["real_start_reserved"], r["seed_allocated"]) == (100 * MiB, 100 * MiB, 80 * MiB)
    assert (r["peak_allocated"], r["peak_reserved"]) == (130 * MiB, 140 * MiB)
    assert (r["seed_events"], r["step_events"]) == (4, 3)


def test_profile_allocator_check_needs_cuda():
    from ds_longctx.job.profiler import StepProfiler

    with pytest.raises(ValueError, match="allocator_check .*needs a CUDA device"):
        StepProfiler({"allocator_check": True, "steps": [1]}, device="cpu")
    assert StepProfiler({"steps": [1]}, device="cpu").allocator_check is False


def test_streams_keep_their_own_pools():
    # a block freed on the copy stream is not reused by the compute stream: the compute stream maps its own
    r = replay([("+", "a", 100 * MiB, 7), ("-", "a"), ("+", "b", 100 * MiB, 0)])
    assert r.peak_reserved == 200 * MiB
    r = replay([("+", "a", 100 * MiB, 0), ("-", "a"), ("+", "b", 100 * MiB, 0)])
    assert r.peak_reserved == 100 * MiB


def test_growth_names_the_requests_that_strand_memory():
    # expandable: A (100) then a small long-lived B above it; A freed leaves a 100 MiB hole; C (120) cannot use it:
    # the end grows by 120 - the free tail, while 100 MiB sat free: C strands min(mapped, free) of them
    r = replay([("+", "A", 100 * MiB, 0, "a"), ("+", "B", 30 * MiB, 0, "b"), ("-", "A"),
                ("+", "C", 120 * MiB, 0, "c")])
    grown = [(g.label, g.mapped, g.free, g.largest, g.reserved) for g in r.growth]
    # A: 5 pages; B: 2 pages (10 MiB free tail); C: 6 more pages (the 10 MiB tail absorbed, not counted as free)
    assert grown == [("a", 100 * MiB, 0, 0, 100 * MiB), ("b", 40 * MiB, 0, 0, 140 * MiB),
                     ("c", 120 * MiB, 100 * MiB, 100 * MiB, 260 * MiB)]
    # above the live peak (150 MiB) C's mapping left 110 MiB, the hole was 100: C strands 100 of the 110 MiB slack
    assert r.stranded_by_label() == {"c": 100 * MiB}
    assert r.reserved_by_stream == {0: 260 * MiB}
    s = r.summary()
    assert s["stranded"] == 100 * MiB and s["stranded_by_label"] == [["c", 100 * MiB]]
    assert s["ratio"] == round(260 / 150, 4)


def test_growth_with_a_fitting_hole_strands_nothing_and_streams_count_apart():
    r = replay([("+", "A", 100 * MiB, 0, "a"), ("+", "B", 30 * MiB, 0, "b"), ("-", "A"),
                ("+", "C", 90 * MiB, 0, "c"), ("+", "D", 40 * MiB, 1, "d")])
    assert r.stranded_by_label() == {}
    assert r.reserved_by_stream == {0: 140 * MiB, 1: 40 * MiB}


def test_classic_growth_counts_free_segments():
    a = CachingAllocatorModel(expandable_segments=False)
    r = a.replay([("+", "x", 30 * MiB, 0, "x"), ("-", "x"), ("+", "y", 40 * MiB, 0, "y")])
    assert [(g.label, g.mapped, g.free) for g in a.growth] == [("x", 30 * MiB, 0), ("y", 40 * MiB, 30 * MiB)]
    assert r.stranded_by_label() == {"y": 30 * MiB} and r.slack == 30 * MiB
    # a mapping the step grows into later strands nothing
    r = replay([("+", "x", 30 * MiB, 0, "x"), ("-", "x"), ("+", "y", 40 * MiB, 0, "y"), ("+", "z", 30 * MiB, 0, "z")],
               expandable_segments=False)
    assert r.slack == 0 and r.stranded_by_label() == {}


def test_frame_labels_skip_torch_frames():
    from ds_longctx.measure.allocator import frame_label

    frames = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"},
              {"filename": "/x/site-packages/deepspeed/runtime/zero/stage3.py", "line": 1620, "name": "add_grad"}]
    assert frame_label(frames) == "zero/stage3.py:1620 add_grad"
    assert frame_label([]) is None and frame_label(None) is None


def test_check_step_explains_by_stream_and_frame():
    start = {"segments": [{"device": 0, "address": 0, "total_size": 40 * MiB, "stream": 0, "blocks": [
        {"size": 40 * MiB, "state": "active_allocated"}]}]}
    fr = [{"filename": "/w/ds_longctx/memory/tiling.py", "line": 9, "name": "tile"}]
    end = {"segments": [{"device": 0, "total_size": 60 * MiB, "stream": 0}, {"device": 0, "total_size": 20 * MiB,
                                                                             "stream": 7}],
           "device_traces": [[
               {"action": "alloc", "addr": 1, "size": 20 * MiB, "stream": 7, "frames": fr},
               {"action": "free_completed", "addr": 1, "size": 20 * MiB},
               {"action": "alloc", "addr": 2, "size": 20 * MiB, "stream": 0, "frames": fr}]]}
    r = check_step(start, end)
    assert r["real_reserved_by_stream_start"] == {"0": 40 * MiB}
    assert r["real_reserved_by_stream_end"] == {"0": 60 * MiB, "7": 20 * MiB}
    # the compute stream could not use stream 7's freed block: the model maps 20 MiB on each stream
    assert r["explain"]["reserved_by_stream"] == {"0": 60 * MiB, "7": 20 * MiB}
    assert r["peak_reserved"] == 80 * MiB and r["explain"]["stranded"] == 0


def test_floor_is_what_no_retry_can_release():
    # expandable: live blocks pin the 20 MiB pages they touch; the free hole's pages could be unmapped
    a = CachingAllocatorModel(expandable_segments=True)
    a.replay([("+", "A", 100 * MiB), ("+", "B", 30 * MiB), ("-", "A"), ("+", "C", 120 * MiB)])
    # at the allocated peak (B + C = 150 MiB): B [100, 130) MiB touches pages 5-6, C [130, 250) pages 6-12: 8 pages
    assert a.peak_allocated == 150 * MiB and a.floor_at_peak == 160 * MiB and a.peak_reserved == 260 * MiB
    # classic: a segment with any live block stays; free whole segments go back
    c = CachingAllocatorModel(expandable_segments=False)
    c.replay([("+", "A", 100 * MiB), ("+", "B", 30 * MiB), ("-", "A"), ("+", "C", 120 * MiB)])
    assert c.peak_reserved == 250 * MiB and c.floor_at_peak == 150 * MiB


def test_events_round_trip_through_a_file(tmp_path):
    from ds_longctx.measure.allocator import load_events, save_events

    ev = [("+", ("a", 1), 100 * MiB, 7, "x.py:1 f"), ("+", "b", 10, 0), ("-", ("a", 1)), ("+", "c", 3 * MiB, 7, None)]
    save_events(ev, str(tmp_path / "t.json.gz"), {"seed_events": 1})
    back, meta = load_events(str(tmp_path / "t.json.gz"))
    assert meta == {"seed_events": 1}
    assert [e[0] for e in back] == ["+", "+", "-", "+"] and back[0][2:] == (100 * MiB, "7", "x.py:1 f")
    a, b = replay(back), replay(ev)  # (streams come back as their names)
    assert (a.peak_allocated, a.peak_reserved, a.floor, a.stranded_by_label()) == \
        (b.peak_allocated, b.peak_reserved, b.floor, b.stranded_by_label())
