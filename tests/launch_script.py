"""A minimal ZeRO-3 job for launcher tests (started by tests/test_reliability.py, not collected).

    <launcher> tests/launch_script.py ok             # 2 ZeRO-3 steps, then ds_longctx.shutdown()
    <launcher> tests/launch_script.py fail RANK      # RANK raises while the others wait in a collective

Plain DeepSpeed + torch (no transformers) to keep each launch cheap; every ZeRO-3 step ends with the
persistent-parameter all-gather whose gloo work made rank exits abort before ds_longctx.shutdown().
"""
import os
import sys

import torch


def main(mode, fail_rank=None):
    import deepspeed
    import torch.distributed as dist

    from ds_longctx.initialize import init_distributed

    init_distributed()
    rank = dist.get_rank()
    print(f"rank {rank} MASTER_PORT={os.environ['MASTER_PORT']}", flush=True)
    if mode == "fail":
        if rank == fail_rank:
            raise RuntimeError(f"rank {rank} fails on purpose")
        dist.barrier()  # the others wait here for the rank that failed
        raise AssertionError("the barrier returned although a rank failed")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    for _ in range(2):
        loss = engine(torch.ones(1, 8)).sum()
        engine.backward(loss)
        engine.step()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    from ds_longctx import run

    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    run(main, args[0], int(args[1]) if len(args) > 1 else None)
