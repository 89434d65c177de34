"""Under ds_longctx's own attention transformers builds no [s, s] mask: the forward hands it a zero-memory 4-D
placeholder (attention.documents.no_mask) and the attention applies causality, windows and documents itself.
Before, a windowed layer (Mistral's sliding_window shorter than the shard) got HF's [b, 1, s, s] sliding mask on
every forward, plus the untied path's check of it: s_local^2 bytes and more (16 GiB at 128K tokens per rank)."""
import pytest
import torch

from tiny_models import build, tiny_config

SEQ, WINDOW = 2048, 64


def _run(window, impl, monkeypatch):
    from ds_longctx.attention import hf
    from ds_longctx.attention.documents import is_no_mask
    from ds_longctx.config import parse
    from ds_longctx.measure.live_bytes import LiveBytesTracker
    from tiny_models import patch

    model = build(tiny_config("mistral", heads=2, kv_heads=1, head_dim=8, vocab=32, intermediate=16,
                              sliding_window=window), seed=0)
    attention = {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": impl == "fused"}
    handle = patch(model, parse({"sequence_parallel_size": 1, "long_context": {"attention": attention}}))
    masks = []
    check = hf._check_mask

    def spy(mask, s_local, w=None):
        masks.append("no_mask" if is_no_mask(mask) and mask.stride() == (0, 0, 0, 0) else mask)
        return check(mask, s_local, w)

    monkeypatch.setattr(hf, "_check_mask", spy)
    ids = torch.randint(0, 32, (1, SEQ), generator=torch.Generator().manual_seed(0))
    try:
        with LiveBytesTracker() as t:
            out = model(input_ids=ids, position_ids=torch.arange(SEQ).unsqueeze(0), shift_labels=ids)
            out.loss.backward()
    finally:
        handle.remove()
    return t.peak, masks, out.loss.detach()


def _hf_loss(window):
    """transformers' own loss of the same model and tokens (its [s, s] sliding mask included)."""
    model = build(tiny_config("mistral", heads=2, kv_heads=1, head_dim=8, vocab=32, intermediate=16,
                              sliding_window=window), seed=0)
    ids = torch.randint(0, 32, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(SEQ).unsqueeze(0), use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


@pytest.mark.parametrize("impl", ["fused", "function"])
def test_windowed_layers_get_no_hf_mask_and_no_quadratic_bytes(impl, monkeypatch):
    peak_full, masks_full, loss_full = _run(None, impl, monkeypatch)
    peak_win, masks_win, loss_win = _run(WINDOW, impl, monkeypatch)
    assert masks_win and all(m == "no_mask" for m in masks_win), masks_win
    assert masks_full and all(m == "no_mask" for m in masks_full)
    # HF's sliding mask alone would be SEQ^2 = 4 MiB of bools; a windowed step costs no more than a causal one
    assert peak_win <= peak_full + SEQ * SEQ // 8, (peak_win, peak_full)
    # and computes what transformers computes with its mask (the window applied by our kernel, not dropped: the
    # windowed loss differs from the full-causal one by more than 3x the tolerance: 6.8e-5 relative measured)
    for window, got in ((None, loss_full), (WINDOW, loss_win)):
        want = _hf_loss(window)
        assert abs(float(got) - float(want)) <= 1e-5 * float(want), (impl, window, float(got), float(want))
    assert abs(float(loss_win) - float(loss_full)) > 3e-5 * float(loss_full), (float(loss_win), float(loss_full))
