"""TRL's fused LM head fields (log_probs, entropy, is_top1) tile by tile (memory/tiling.tiled_token_fields):
SFTTrainer calls model(..., fused_lm_head=True) on every training step, so these must not build [seq, vocab]
logits at long context. Against the untiled formula (loss.fused_token_fields on full logits): values, and the
gradients of a loss that weights tokens (TRL's DFT) and uses the entropy; peak bytes against the untiled path;
a patched model without tiled_loss against TRL's own fused head."""
import pytest
import torch

from ds_longctx.loss import IGNORE_INDEX, fused_token_fields, lm_logits
from ds_longctx.measure.live_bytes import LiveBytesTracker
from ds_longctx.memory.tiling import tiled_token_fields

B, S, H, V = 2, 24, 16, 96


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float32)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float32))
    return hidden, labels, head


def _softcap(x):  # Gemma-style final logit soft-capping
    return 3.0 * torch.tanh(x / 3.0)


@pytest.mark.parametrize("logit_fn", [None, _softcap], ids=["plain", "softcap"])
@pytest.mark.parametrize("shards", [1, 5, B * S])
def test_tiled_fields_and_gradients_equal_the_untiled_formula(shards, logit_fn):
    hidden, labels, head = _inputs()
    w = torch.rand(B, S, generator=torch.Generator().manual_seed(1), dtype=torch.float32)

    def run(tiled):
        x = hidden.clone().requires_grad_(True)
        head.weight.grad = None
        if tiled:
            f = tiled_token_fields(x, head, labels, shards, logit_fn)
        else:
            f = fused_token_fields(lm_logits(head, x, logit_fn), labels)
        # a token-weighted loss (TRL's DFT weights by exp(log_probs)) plus an entropy term
        (-(f["log_probs"] * w).sum() + 0.1 * f["entropy"].sum()).backward()
        return f, x.grad, head.weight.grad.clone()

    (ft, xt, wt), (fu, xu, wu) = run(True), run(False)
    # one tile: the same calls, equal. More tiles: a row's logits come from a matmul over fewer rows (BLAS picks
    # another kernel and summation order for another M) and lm_head's weight gradient is summed tile by tile
    assert torch.equal(ft["label_mask"], fu["label_mask"]) and torch.equal(ft["is_top1"], fu["is_top1"])
    assert (ft["log_probs"][~ft["label_mask"]] == 0).all() and not ft["is_top1"].requires_grad
    if shards == 1:
        for a, b in ((ft["log_probs"], fu["log_probs"]), (ft["entropy"], fu["entropy"]), (xt, xu), (wt, wu)):
            assert torch.equal(a, b)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(ft[k], fu[k], rtol=1e-6, atol=1e-5, msg=k)
    torch.testing.assert_close(xt, xu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wt, wu, rtol=1e-5, atol=1e-6)
    assert xt.abs().max() > 0 and wt.abs().max() > 0


def test_only_log_probs_used_and_only_lm_head_trains():
    """The entropy unused (no gradient reaches it) and a frozen input: lm_head still gets its gradient."""
    hidden, labels, head = _inputs(2)
    f = tiled_token_fields(hidden, head, labels, 4)
    (-f["log_probs"].sum()).backward()
    got = head.weight.grad.clone()
    head.weight.grad = None
    (-fused_token_fields(lm_logits(head, hidden), labels)["log_probs"].sum()).backward()
    torch.testing.assert_close(got, head.weight.grad, rtol=1e-5, atol=1e-6)  # summed over 4 tiles


def test_peak_bytes_hold_one_tile_of_logits_not_the_sequence():
    seq, vocab, shards = 512, 2048, 8
    head = torch.nn.Linear(32, vocab, bias=False)
    hidden = torch.randn(1, seq, 32)
    labels = torch.randint(0, vocab, (1, seq))
    logits_bytes = seq * vocab * 4

    def peak(tiled):
        x = hidden.clone().requires_grad_(True)
        with LiveBytesTracker() as t:
            if tiled:
                f = tiled_token_fields(x, head, labels, shards)
            else:
                f = fused_token_fields(lm_logits(head, x), labels)
            (-f["log_probs"].sum() + f["entropy"].sum()).backward()
        return t.peak

    untiled, tiled = peak(False), peak(True)
    assert untiled > 2 * logits_bytes, untiled          # logits, log_softmax (+ its exp) for the whole shard
    assert tiled < 0.75 * logits_bytes, (tiled, logits_bytes)  # a few tiles' worth (1/8 each)


def test_patched_model_without_tiled_loss_equals_trls_fused_head():
    """SFTTrainer's path at SP=1 with tiled_loss off: still tiled (TRL's own head never builds the logits),
    and equal to TRL's head in values and gradients."""
    from trl.trainer.utils import add_fused_lm_head

    from arch_cases import build_arch, sample
    from ds_longctx.config import parse
    from tiny_models import patch

    batch = sample(16)
    ref_model = build_arch("llama")
    add_fused_lm_head(ref_model, outputs=("log_probs", "entropy", "is_top1"))
    ref = ref_model(**batch, fused_lm_head=True)
    model = build_arch("llama")
    patch(model, parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"}}}))
    got = model(**batch, fused_lm_head=True)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, k), getattr(ref, k), rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(got.is_top1, ref.is_top1)
    got.loss.backward()
    ref.loss.backward()
    ref_grads = dict(ref_model.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)
