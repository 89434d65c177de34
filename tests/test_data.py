"""SP data sharding: shards, position_ids and shifted labels exact, incl. the last ignored label."""
import pytest
import torch

from ds_longctx.errors import BatchError
from ds_longctx.data import LongRangeCopy, SPDataLoader, shard_batch


def test_shards_are_exact():
    ids = torch.arange(100, 108).view(1, 8)
    labels = ids.clone()
    labels[0, 2] = -100
    shards = [shard_batch({"input_ids": ids, "labels": labels}, r, 4) for r in range(4)]
    assert [s["input_ids"].tolist() for s in shards] == [[[100, 101]], [[102, 103]], [[104, 105]], [[106, 107]]]
    assert [s["position_ids"].tolist() for s in shards] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    # token t's target is labels[t+1]; the shard boundary keeps it; the very last target is ignored
    assert [s["shift_labels"].tolist() for s in shards] == [[[101, -100]], [[103, 104]], [[105, 106]],
                                                            [[107, -100]]]
    assert all("labels" not in s and "attention_mask" not in s for s in shards)


def test_explicit_position_ids_and_batch_of_two():
    ids = torch.arange(12).view(2, 6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]])
    s1 = shard_batch({"input_ids": ids, "position_ids": pos, "attention_mask": torch.ones(2, 6)}, 1, 2)
    assert s1["input_ids"].tolist() == [[3, 4, 5], [9, 10, 11]]
    assert s1["position_ids"].tolist() == [[0, 1, 2], [8, 9, 10]]
    assert s1["shift_labels"].tolist() == [[4, 5, -100], [10, 11, -100]]


def test_indivisible_sequence_is_rejected():
    with pytest.raises(BatchError, match=r"batch.input_ids: sequence length 7 is not divisible by "
                                          r"sequence_parallel_size=2"):
        shard_batch({"input_ids": torch.zeros(1, 7, dtype=torch.long)}, 0, 2)


def test_right_padding_is_an_ignored_document_and_left_padding_is_rejected():
    mask = torch.ones(1, 4)
    mask[0, -1] = 0
    s = shard_batch({"input_ids": torch.arange(4).view(1, 4), "attention_mask": mask}, 1, 2)
    assert s["doc_cu_seqlens"].tolist() == [[0, 3, 4]] and s["shift_labels"].tolist() == [[-100, -100]]
    with pytest.raises(BatchError, match="batch.attention_mask: sample 0 is not right-padded"):
        shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": mask.flip(1)}, 0, 2)


def test_loader_gives_each_sp_rank_the_same_sample_and_replicas_different_ones():
    ds = LongRangeCopy(seq_len=8, vocab_size=16, num_samples=8, seed=3)
    full = [ds[i]["input_ids"] for i in range(8)]
    for dp_rank in range(2):
        parts = [list(SPDataLoader(ds, 1, sp_rank=r, sp_size=2, dp_rank=dp_rank, dp_size=2)) for r in range(2)]
        for step in range(4):
            joined = torch.cat([parts[0][step]["input_ids"], parts[1][step]["input_ids"]], dim=1)[0]
            assert torch.equal(joined, full[step * 2 + dp_rank])


def test_copy_task_scores_only_the_copy():
    ds = LongRangeCopy(seq_len=10, vocab_size=16, seed=0)
    item = ds[5]
    ids, labels = item["input_ids"], item["labels"]
    assert torch.equal(ids[1:5], ids[6:10]) and ids[0] == ids[5] == 1
    assert (labels[:6] == -100).all() and torch.equal(labels[6:], ids[6:])
    assert torch.equal(ds[5]["input_ids"], LongRangeCopy(seq_len=10, vocab_size=16, seed=0)[5]["input_ids"])
