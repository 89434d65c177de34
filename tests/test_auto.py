""""auto" values (heads_per_chunk, tiled shards, keep_attention_output) are resolved at initialize time by the
planner on rank 0, identically on every rank."""
from dist_utils import run_distributed
from sp_cases import ds_config, sample
from tiny_models import build, tiny_config
import pytest

pytestmark = pytest.mark.distributed  # every test here spawns processes


def _auto(rank, world):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch

    lc = {"sequence_length": 64, "attention": {"implementation": "untied_ulysses", "heads_per_chunk": "auto"},
          "tiled_mlp": {"enabled": True, "shards": "auto"},
          "activation_checkpointing": {"enabled": True, "keep_attention_output": "auto"}}
    cfg = ds_config(3, world, lc, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    model = build(tiny_config(heads=8, kv_heads=2, head_dim=4))
    engine, *_ = ds_longctx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loss = engine(**shard_batch(sample(64, 64), sp_rank(sp_group()), world)).loss
    engine.backward(loss)
    engine.step()
    lc = engine.long_context
    return lc.attention.heads_per_chunk, lc.tiled_mlp.shards, lc.activation_checkpointing.keep_attention_output, \
        loss.item()


def test_auto_resolves_to_the_same_integers_on_every_rank():
    results = run_distributed(_auto, 2, timeout=600)
    assert results[0] == results[1]
    hpc, shards, keep, loss = results[0]
    # on the device (no offload), a CPU device's budget is this machine's RAM: it fits, and skipping the
    # recompute's attention forward is predicted faster
    assert keep is True
    assert isinstance(hpc, int) and 4 % hpc == 0  # 8 heads / SP 2 = 4 per rank
    assert isinstance(shards, int) and shards >= 1 and loss > 0
