"""NVMe offload of checkpointed layer inputs through ds_longctx.initialize on a real ZeRO-3 engine,
2 gloo ranks (DeepSpeed's async I/O op against a temporary directory): loss and SGD parameter
deltas bit-equal to checkpointing without offload, reentrant and not; every rank's files removed."""
import os

import pytest
import torch

from dist_utils import run_distributed

SEQ, VOCAB = 80, 64
MODEL = dict(heads=4, kv_heads=2, vocab=VOCAB, layers=2)


def _aio_available():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _step(lc):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from ds_longctx.memory import get_memory_handle
    from sp_cases import ds_config, full_params, sample
    from tiny_models import build, tiny_config

    config = ds_config(3, 2, dict(lc, attention={"implementation": "ulysses"}))
    model = build(tiny_config(**MODEL), seed=0)
    engine, _, _, _ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                            config=config)
    before = full_params(engine.module)
    shard = shard_batch(sample(SEQ, VOCAB), sp_rank(sp_group()), 2)
    loss = engine(**shard).loss
    engine.backward(loss)
    engine.step()
    after = full_params(engine.module)
    handle = get_memory_handle(engine)
    stats = handle.stats()
    handle.remove()  # closes the target: stops its I/O thread and removes this rank's directory
    engine.destroy() if hasattr(engine, "destroy") else None
    return loss.detach(), {n: after[n] - before[n] for n in after}, stats


def _worker(rank, world, path):
    out = {}
    for reentrant in (False, True):
        ac = {"enabled": True, "use_reentrant": reentrant}
        out[("ckpt", reentrant)] = _step({"activation_checkpointing": ac})
        out[("nvme", reentrant)] = _step({"activation_checkpointing": dict(ac, offload="nvme", nvme_path=path)})
    return out


@pytest.mark.distributed
@pytest.mark.skipif(not _aio_available(), reason="DeepSpeed's async_io op needs libaio-dev "
                    "(apt-get install libaio-dev, then bash tools/setup.sh builds the op)")
def test_nvme_offload_zero3_sp2_bit_equal_and_cleaned_up(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), timeout=500)
    layer_bytes = (SEQ // 2) * 32 * 4
    for rank, out in enumerate(results):
        for reentrant in (False, True):
            ref_loss, ref_deltas, _ = out[("ckpt", reentrant)]
            loss, deltas, st = out[("nvme", reentrant)]
            assert torch.equal(loss, ref_loss), (rank, reentrant, loss, ref_loss)
            assert any(d.abs().max() > 0 for d in ref_deltas.values())
            for n in ref_deltas:
                assert torch.equal(deltas[n], ref_deltas[n]), (rank, reentrant, n)
            assert st["offloaded_tensors"] == st["nvme_reads"] == MODEL["layers"], st
            assert st["nvme_bytes"] == MODEL["layers"] * -(-layer_bytes // 4096) * 4096, st
    assert os.listdir(tmp_path) == []
