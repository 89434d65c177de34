"""Issue 19, item 5: what an eval loop gets back besides the loss. The HF Trainer asks for logits when
prediction_loss_only is False (a compute_metrics is set); TRL's SFTTrainer asks the model's fused LM head for
per-token log-probabilities (its eval loss), entropy and token accuracy. Under SP a full-length eval batch is
sharded in turns (sp_batch.eval_in_turns): the full-length outputs of each rank's own batch equal one process;
with long_context.tiled_loss the logits are never built and using them fails naming the fix."""
import pytest
import torch

from arch_cases import build_arch, isclose, sample
from dist_utils import run_distributed_side_by_side

UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
TILED = {"tiled_loss": {"enabled": True, "shards": 2}}


def _trl_reference(name, batch):
    """TRL's own fused LM head on an unpatched model (one process); the model is kept on the output."""
    from trl.trainer.utils import add_fused_lm_head

    model = build_arch(name)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    out = model(**batch, fused_lm_head=True)
    out.__dict__["_model"] = model
    return out


def ref_model_of(out):
    return out.__dict__["_model"]


def _lc(extra=None):
    from ds_longctx.config import parse

    return parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"},
                                                                **(extra or {})}})


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # gemma2: its final_logit_softcapping is applied by both
def test_fused_lm_head_fields_equal_trl(name):
    from tiny_models import patch

    batch = sample(16)
    ref = _trl_reference(name, batch)
    model = build_arch(name)
    assert name != "gemma2" or model.config.final_logit_softcapping is not None
    patch(model, _lc(TILED))
    got = model(**batch, fused_lm_head=True)
    assert got.log_probs.shape == ref.log_probs.shape == (1, 15)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, k), getattr(ref, k), rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(got.is_top1, ref.is_top1) and torch.equal(got.label_mask, ref.label_mask)
    assert got.label_mask.sum() == 13 and (got.log_probs[~got.label_mask] == 0).all()
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-6, atol=1e-6)
    # TRL trains on -log_probs (SFTTrainer at SP=1): the same gradients as through TRL's own head
    got.loss.backward()
    ref.loss.backward()
    trl_grads = {n: p.grad for n, p in ref_model_of(ref).named_parameters()}
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, n
        torch.testing.assert_close(p.grad, trl_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_tiled_loss_eval_output_refuses_logits_with_the_fix():
    """The Trainer's prediction_step takes every output value but the loss as logits; with the tiled loss the
    value there raises naming prediction_loss_only / compute_metrics (not an empty tuple to compute_metrics)."""
    from transformers.trainer_pt_utils import nested_detach

    from ds_longctx.patching.compat import LogitsNotComputed
    from tiny_models import patch

    model = build_arch("llama")
    patch(model, _lc(TILED))
    model.eval()
    with torch.no_grad():
        out = model(**sample(16))
    logits = tuple(v for k, v in out.items() if k != "loss")
    assert len(logits) == 1  # prediction_loss_only=True: taken, then dropped; no error
    with pytest.raises(LogitsNotComputed) as e:
        nested_detach(logits)
    msg = str(e.value)
    assert "prediction_loss_only" in msg and "compute_metrics" in msg and "tiled_loss.enabled=false" in msg
    model.train()
    assert "logits" not in model(**sample(16)).keys()  # training outputs unchanged


def _sp2(rank, world):
    import ds_longctx
    from arch_cases import trainer_eval
    from ds_longctx.patching.compat import LogitsNotComputed
    from eco_cases import ProcessState
    from sp_cases import ds_config

    state = ProcessState()
    out = {}
    own = sample(16, seed=10 + rank)
    for key, lc in (("plain", UNTIED), ("tiled", {**UNTIED, **TILED})):
        model = build_arch("llama")
        engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           config=ds_config(3, 2, lc))
        engine.eval()
        with torch.no_grad():
            res = engine(**own)
            fused = engine(**own, fused_lm_head=True)
        out[key] = {"loss": res.loss.item(), "fused": {k: getattr(fused, k) for k in
                                                       ("log_probs", "entropy", "is_top1", "label_mask")},
                    "fused_loss": fused.loss.item()}
        try:
            out[key]["logits"] = res.logits
        except LogitsNotComputed as e:
            out[key]["logits"] = str(e)
        engine.module._ds_longctx_patch.remove()
        state.reset()
    out["trainer"] = trainer_eval("llama", 2, UNTIED, rank, logits=True)
    state.reset()
    try:
        trainer_eval("llama", 2, {**UNTIED, **TILED}, rank, logits=True)
        out["trainer_tiled"] = "no error"
    except LogitsNotComputed as e:
        out["trainer_tiled"] = str(e)
    state.reset()
    out["trl"] = _trl_eval(2, rank)
    state.reset()
    return out


def _trl_eval(sp, rank, use_ds_longctx=True):
    """TRL's SFTTrainer, one SGD step then evaluate(): its eval loss comes from the fused LM head's log_probs."""
    __import__("eco_cases")  # puts examples/ on sys.path
    import trl_sft

    where = f"/tmp/ds_longctx_test_trl_eval{rank}{'' if use_ds_longctx else '_ref'}"  # the reference runs alongside
    out = trl_sft.train(sp=sp, use_ds_longctx=use_ds_longctx, packing=False, steps=1, eval_samples=4, seq_len=16,
                        output_dir=where)["eval"]
    return {k: out[k] for k in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy")}


def _trl_eval_reference(rank, world):
    return _trl_eval(1, rank, use_ds_longctx=False)


@pytest.mark.distributed
def test_eval_outputs_under_sp_equal_one_process():
    res, (trl_ref,) = run_distributed_side_by_side((_sp2, 2), (_trl_eval_reference, 1))
    ref_model = build_arch("llama")
    for rank, r in enumerate(res):
        own = sample(16, seed=10 + rank)
        with torch.no_grad():
            ref = ref_model(**own)
        trl = _trl_reference("llama", own)
        # plain loop: the full-length logits of this rank's own batch
        assert r["plain"]["logits"].shape == (1, 16, 64)
        torch.testing.assert_close(r["plain"]["logits"], ref.logits, rtol=1e-5, atol=1e-5)
        assert isclose(r["plain"]["loss"], ref.loss.item()) and isclose(r["tiled"]["loss"], ref.loss.item())
        assert "prediction_loss_only" in r["tiled"]["logits"] or "tiled_loss" in r["tiled"]["logits"]
        for key in ("plain", "tiled"):  # TRL's fused head fields, [1, 15], on both
            f = r[key]["fused"]
            for k in ("log_probs", "entropy"):
                torch.testing.assert_close(f[k], getattr(trl, k).detach(), rtol=1e-5, atol=1e-5, msg=(key, k))
            assert torch.equal(f["is_top1"], trl.is_top1) and torch.equal(f["label_mask"], trl.label_mask)
            assert isclose(r[key]["fused_loss"], trl.loss.item())
        # the HF Trainer's evaluate() with a compute_metrics: the logits of all 4 eval samples, as one process
        got, want = r["trainer"]
        assert got.shape == want.shape == (4, 16, 64), (got.shape, want.shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert "prediction_loss_only" in r["trainer_tiled"] and "tiled_loss.enabled=false" in r["trainer_tiled"]
    # TRL's SFTTrainer.evaluate() under SP=2 (fused LM head: loss, token accuracy, entropy) = one process
    for r in res:
        for k, v in trl_ref.items():
            assert isclose(r["trl"][k], v), (k, r["trl"][k], v)
