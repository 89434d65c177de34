"""Issue 52, item 2: DeepSpeed's CPU Adam (FusedAdam on the CPU accelerator, DeepSpeedCPUAdam) updates a resumed
run's weights exactly as the uninterrupted run's (job/adam.py). Without it the bias correction of a run resumed at
step K is pow(beta, K+1) where the run that went on has a running product of K+1 float multiplications: the weights
differ in the last bit (the control below)."""
import pytest
import torch

from ds_longctx.job.adam import step_only_bias_correction

N, K, D = 40, 30, 4096  # 40 steps; the "resume" after step 30


def _grad(s):
    return torch.randn(D, generator=torch.Generator().manual_seed(100 + s))


def _optimizer(cls, p, fix):
    opt = cls([p], lr=1e-2, betas=(0.9, 0.99))
    if fix:
        assert step_only_bias_correction(opt)
        assert step_only_bias_correction(opt)  # once only: a second call changes nothing
    return opt


def _uninterrupted_and_resumed(cls, fix):
    """(weights after N steps in one optimizer, weights after K steps then a new optimizer given the state)."""
    a = torch.nn.Parameter(torch.randn(D, generator=torch.Generator().manual_seed(0)))
    oa = _optimizer(cls, a, fix)
    for s in range(K):
        a.grad = _grad(s)
        oa.step()
    w, state = a.detach().clone(), {k: (v.clone() if torch.is_tensor(v) else v) for k, v in oa.state[a].items()}
    for s in range(K, N):
        a.grad = _grad(s)
        oa.step()
    # a new optimizer object with the checkpoint's state: what a resumed process builds (the CPU FusedAdam's C++
    # object is one per process: the stepping of `oa` past K is this process's history, as a fresh start's first
    # step has none)
    b = torch.nn.Parameter(w)
    ob = _optimizer(cls, b, fix)
    ob.state[b] = state
    for s in range(K, N):
        b.grad = _grad(s)
        ob.step()
    return a.detach(), b.detach()


@pytest.fixture(scope="module")
def cpu_info_once():
    """py-cpuinfo's answer read once: DeepSpeedCPUAdam's constructor asks it for the CPU vendor, and each call starts a
    Python subprocess (~1.1 s on the 2-core box; 4 optimizers here). The machine does not change between them."""
    import copy

    import cpuinfo

    info = cpuinfo.get_cpu_info()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpuinfo, "get_cpu_info", lambda: copy.deepcopy(info))
        yield


@pytest.mark.parametrize("name", ["FusedAdam", "DeepSpeedCPUAdam"])
def test_a_resumed_cpu_adam_steps_as_the_uninterrupted_one(name, cpu_info_once):
    from deepspeed.ops import adam

    cls = getattr(adam, name)
    a, b = _uninterrupted_and_resumed(cls, fix=True)
    assert torch.equal(a, b)
    a, b = _uninterrupted_and_resumed(cls, fix=False)  # the control: DeepSpeed's own bias correction
    assert not torch.equal(a, b) and (a - b).abs().max() < 1e-5


def test_other_optimizers_are_left_as_they_are():
    p = torch.nn.Parameter(torch.zeros(3))
    for opt in (torch.optim.AdamW([p]), torch.optim.SGD([p], lr=0.1), None):
        assert step_only_bias_correction(opt) is False
