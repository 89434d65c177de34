"""Unit tests (no processes spawned) for the batch checks of ds_longctx's SP data loader adapter
(ds_longctx/hf/loader.py): what it accepts from TRL's padding-free collator, how it pads a row to a
multiple of SP, and the batches it refuses; enable() routing skip_first_batches (resume) to it. The adapter's
collectives (and its skips) run in tests/test_ecosystem.py, whole resumed runs in tests/test_trainer_resume.py."""
import pytest
import torch

from ds_longctx.errors import BatchError
from ds_longctx.data import shard_batch
from ds_longctx.data.turns import checked_batch as _checked_batch


def trl_padding_free(doc_lens, seed=0):
    """What trl.trainer.sft_trainer.DataCollatorForLanguageModeling(padding_free=True) returns for one row."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (sum(doc_lens),), generator=g).tolist()
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
        [{"input_ids": ids, "seq_lengths": list(doc_lens)}])


def test_trl_padding_free_row_keeps_its_documents():
    batch = trl_padding_free([5, 11, 16])  # 32 tokens, a boundary on the SP=2 shard edge (16)
    assert "cu_seq_lens_q" in batch and "seq_idx" in batch
    out = _checked_batch(batch, 2)
    assert not any(k in out for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"))
    shards = [shard_batch(out, r, 2) for r in range(2)]
    assert shards[0]["doc_cu_seqlens"].tolist() == [[0, 5, 16, 32]] == shards[1]["doc_cu_seqlens"].tolist()
    # TRL ignores each document's first label; the last target of shard 0 is token 16's label (-100)
    assert shards[0]["shift_labels"][0, -1] == -100 and shards[0]["shift_labels"][0, 4] == -100
    assert torch.equal(torch.cat([s["input_ids"] for s in shards], 1), batch["input_ids"])


def test_odd_row_is_padded_with_one_ignored_document():
    batch = trl_padding_free([5, 10])  # 15 tokens
    out = _checked_batch(batch, 2)
    assert out["input_ids"].shape == (1, 16) and out["attention_mask"][0].tolist() == [1] * 15 + [0]
    s1 = shard_batch(out, 1, 2)
    assert s1["doc_cu_seqlens"].tolist() == [[0, 5, 15, 16]]
    assert s1["shift_labels"][0, -2:].tolist() == [-100, -100]  # last real token's target is padding
    even = trl_padding_free([5, 11])  # a multiple of SP: unchanged
    checked = _checked_batch(even, 2)
    assert torch.equal(checked["input_ids"], even["input_ids"]) and "attention_mask" not in checked


def test_batches_the_adapter_cannot_take_are_named():
    batch = trl_padding_free([5, 11])
    with pytest.raises(BatchError, match=r"batch.cu_seq_lens_q: gives document boundaries \[0, 4, 16\]"):
        _checked_batch(dict(batch, cu_seq_lens_q=torch.tensor([0, 4, 16], dtype=torch.int32)), 2)
    with pytest.raises(BatchError, match="batch.cu_seq_lens_q: .*without position_ids"):
        _checked_batch({k: v for k, v in batch.items() if k != "position_ids"}, 2)
    with pytest.raises(BatchError, match=r"batch.token_type_ids: has the sequence dimension"):
        _checked_batch(dict(batch, token_type_ids=torch.zeros_like(batch["input_ids"])), 2)
    with pytest.raises(BatchError, match=r"batch.input_ids: expected a \[batch, seq\] tensor"):
        _checked_batch({"input_ids": torch.zeros(8, dtype=torch.long)}, 2)
    with pytest.raises(BatchError, match="batch.attention_mask: sample 0 is not right-padded"):
        _checked_batch({"input_ids": torch.ones(1, 4, dtype=torch.long),
                        "attention_mask": torch.tensor([[0, 1, 1, 1]])}, 2)


def test_enable_routes_skip_first_batches_and_disable_puts_it_back():
    """The Trainer (transformers.trainer), Accelerator.skip_first_batches (accelerate.accelerator) and scripts
    (accelerate, accelerate.data_loader) look skip_first_batches up at call time: while enabled each name sends an
    SP adapter to ds_longctx (counted in SP turns) and anything else to Accelerate's function."""
    import importlib

    import ds_longctx
    from ds_longctx.hf import integration
    from ds_longctx.hf.loader import SPTurnsAdapter

    sites = {m: importlib.import_module(m) for m in integration._SKIP_SITES}
    before = {m: mod.skip_first_batches for m, mod in sites.items()}
    calls = []

    def accelerate_skip(dl, num_batches=0):  # stands in for Accelerate's function on the wrapped loader
        calls.append((dl, num_batches))
        return dl[num_batches:]

    try:
        ds_longctx.enable()
        assert all(mod.skip_first_batches is integration._skip_first_batches for mod in sites.values())
        integration._ORIGINALS["skip:accelerate.data_loader"] = accelerate_skip
        loader = ["b0", "b1", "b2"]
        skipped = sites["transformers.trainer"].skip_first_batches(SPTurnsAdapter(loader, 0, None, 2, "cpu"), 3)
        assert isinstance(skipped, SPTurnsAdapter) and skipped.skipped == (3, 1) and len(skipped) == 3
        assert calls == [(loader, 1)]  # one whole batch of the loader; the next batch's first turn is dropped
        assert integration._skip_first_batches(loader, 2) == ["b2"] and calls[-1] == (loader, 2)
    finally:
        integration._ORIGINALS["skip:accelerate.data_loader"] = before["accelerate.data_loader"]
        ds_longctx.disable()
    assert all(sites[m].skip_first_batches is before[m] for m in sites)
