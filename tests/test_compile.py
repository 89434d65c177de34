"""One torch.compile'd training step (forward + backward) of a tiny patched model on CPU: fused untied
attention (the ds_longctx attention ops and their fakes), activation checkpointing, tiled MLP, tiled loss and
the memory-efficient RMSNorm. ``aot_eager`` traces forward and backward with fake tensors (the ops'
``register_fake``) without inductor's C++ build time; inductor itself was checked by hand (same result,
~55 s on 2 cores). It compiles with graph breaks, not as one graph: ``.item()``/``bool()`` reads of the mask
check (attention/hf.py _check_mask, on the [s, s] mask HF builds under tracing), the tiled backwards'
``torch.autograd.backward`` (memory/tiling.py), and the loss-only output class (compat.py)."""
import pytest
import torch

from tiny_models import build, tiny_config

LC = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": True},
      "activation_checkpointing": {"enabled": True}, "tiled_mlp": {"enabled": True, "shards": 2},
      "tiled_loss": {"enabled": True, "shards": 2}, "rms_norm": {"enabled": True}}


@pytest.mark.distributed  # ~15 s of tracing on 2 cores
def test_compiled_step_matches_eager():
    from ds_longctx.config import parse
    from tiny_models import patch

    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    model = build(tiny_config(), seed=0)
    handle = patch(model, parse({"long_context": LC}))
    model.train()
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    try:
        loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, ref)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], msg=n)
    finally:
        torch._dynamo.reset()
        handle.remove()
