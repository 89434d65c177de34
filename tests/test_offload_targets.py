"""Offload targets at module level (one process, real tiny HF models): the exact-size host arena and
the NVMe target (DeepSpeed's async I/O op against a temporary directory). Each is bit-equal to
checkpointing without offload, holds exactly what the planner says, does not grow over 20 steps,
and the NVMe target removes its files at the end and on error."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tiny_models import build, memory_stack, tiny_config

from ds_longctx.config import ConfigError, parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, B, S = 3, 2, 24


def _lc(**ac):
    return parse({"long_context": {"activation_checkpointing": dict({"enabled": True}, **ac)}})


def _step(model, ids, opt=None):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if opt is not None:
        opt.step()
    return loss.detach(), grads


def _ids(cfg, seed=2):
    return torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def _layer_bytes(cfg):
    return B * S * cfg.hidden_size * 4


def _aio_available():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


needs_aio = pytest.mark.skipif(not _aio_available(), reason="DeepSpeed's async_io op needs libaio-dev "
                               "(apt-get install libaio-dev, then bash tools/setup.sh builds the op)")


def _compare_over_steps(target_ac, steps, reentrant, offload_target=None):
    """Train the reference (checkpointing, no offload) and the offloaded model side by side with SGD:
    losses and every gradient bit-equal at every step. Returns the offload handle's stats per step."""
    cfg = tiny_config(layers=LAYERS)
    ref = build(cfg)
    memory_stack(ref, _lc(use_reentrant=reentrant))
    model = build(cfg)
    handle = memory_stack(model, _lc(use_reentrant=reentrant, **target_ac), offload_target=offload_target)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per_step = []
    try:
        for step in range(steps):
            ids = _ids(cfg, seed=step)
            ref_loss, ref_grads = _step(ref, ids, opt_ref)
            loss, grads = _step(model, ids, opt)
            assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
            for n in ref_grads:
                assert torch.equal(grads[n], ref_grads[n]), (step, n)
            per_step.append(handle.stats())
    except BaseException:
        handle.remove()
        raise
    return cfg, handle, per_step


# ---------------------------------------------------------------------------------------------
# exact-size host arena
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_arena_bit_exact_exact_size_and_no_growth_over_20_steps(reentrant):
    cfg, handle, per_step = _compare_over_steps({"offload": "cpu"}, 20, reentrant)
    lb = _layer_bytes(cfg)
    for i, st in enumerate(per_step):
        assert st["offloaded_tensors"] == LAYERS * (i + 1) and st["restored_tensors"] == LAYERS * (i + 1)
        # one exact-size block per layer input (no power-of-two rounding), allocated in step 1 only
        assert st["arena_bytes"] == LAYERS * lb, (i, st)
        assert st["arena_blocks"] == LAYERS and st["arena_allocations"] == LAYERS
        assert st["arena_reuses"] == LAYERS * i
        assert st["arena_in_use_bytes"] == 0 and st["host_bytes"] == 0  # all back after backward
        assert st["pinned_bytes"] == 0  # CPU: nothing can be pinned; same accounting
    assert lb & (lb - 1), "pick a layer size that is not a power of two, so rounding would show"
    handle.remove()
    assert handle.offloader.target.arena.allocated_bytes == 0


@pytest.mark.parametrize("keep", [1, LAYERS])
def test_keep_on_device_skips_the_last_layers_bit_exact(keep):
    cfg, handle, per_step = _compare_over_steps({"offload": "cpu", "keep_on_device": keep}, 2, False)
    st = per_step[-1]
    assert st["offloaded_tensors"] == 2 * (LAYERS - keep) and st["arena_bytes"] == (LAYERS - keep) * _layer_bytes(cfg)
    handle.remove()


def test_arena_bytes_equal_the_planners_host_figure():
    """What the arena holds after a real step == the planner's 'offloaded activations' host bytes for
    the same model, batch and length (the planner runs the same code on fake tensors)."""
    from ds_longctx.planner import Planner

    cfg = tiny_config(layers=LAYERS)
    model = build(cfg)
    handle = memory_stack(model, _lc(offload="cpu"))
    _step(model, _ids(cfg))
    measured = handle.stats()["arena_bytes"]
    handle.remove()
    ds = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 0},
          "long_context": {"activation_checkpointing": {"enabled": True, "offload": "cpu"}}}
    # reserve 0: the reserve stands for CUDA context/NCCL/fragmentation, none of which a CPU run has
    r = Planner(ds, cfg, 1, "1GiB", reserve="0", device="cpu", full_depth=True).run(S)
    assert r.host["offloaded activations"] == measured == LAYERS * _layer_bytes(cfg), (r.host, measured)


def test_arena_reuses_best_fit_and_grows_only_for_larger_inputs():
    from ds_longctx.memory.arena import HostArena

    a = HostArena()
    b1, b2 = a.take(1000), a.take(3000)
    a.give(b1), a.give(b2)
    assert a.take(900) is b1 and a.take(2000) is b2 and a.allocated_bytes == 4000  # best fit, no new block
    a.give(b1)
    b3 = a.take(1001)  # larger than any free block: exactly 1001 more
    assert b3 is not b1 and a.allocated_bytes == 5001 and a.allocations == 3
    view = b3.view(torch.float32, (10, 25))
    assert view.data_ptr() == b3.data.data_ptr() and view.numel() * 4 <= b3.nbytes


# ---------------------------------------------------------------------------------------------
# NVMe target (DeepSpeed async I/O) against a temporary directory
# ---------------------------------------------------------------------------------------------


def _act_dirs(path):
    return [d for d in os.listdir(path) if d.startswith("ds_longctx_act_")]


@needs_aio
@pytest.mark.parametrize("reentrant,chunk", [(False, None), (True, None), (False, 4096)])
def test_nvme_bit_exact_no_growth_and_cleanup(tmp_path, reentrant, chunk):
    """chunk=4096: each 6 KiB layer input streams through the staging ring in two chunks (one partial)."""
    from ds_longctx.memory.nvme import ALIGN, NVMeTarget

    target = NVMeTarget(str(tmp_path), chunk_bytes=chunk) if chunk else None
    cfg, handle, per_step = _compare_over_steps({"offload": "nvme", "nvme_path": str(tmp_path)}, 20, reentrant,
                                                offload_target=target)
    target = handle.offloader.target
    lb = _layer_bytes(cfg)
    span = -(-lb // ALIGN) * ALIGN
    staging = 3 * (chunk or span)
    assert len(_act_dirs(tmp_path)) == 1 and os.path.getsize(target.file) == LAYERS * span
    for i, st in enumerate(per_step):
        assert st["nvme_bytes"] == LAYERS * span, (i, st)          # one slot per layer, reused every step
        assert st["staging_bytes"] == staging, (i, st)             # the ring: 3 chunks of host memory
        assert st["offloaded_tensors"] == LAYERS * (i + 1) and st["restored_tensors"] == LAYERS * (i + 1)
        assert st["nvme_reads"] == LAYERS * (i + 1)               # every restore came from the file
        assert st["host_bytes"] == 0
    handle.remove()
    assert _act_dirs(tmp_path) == [] and not target._state["thread"].is_alive()


def test_nvme_keys_are_checked_at_parse():
    with pytest.raises(ConfigError, match="nvme_path.*needs a directory"):
        _lc(offload="nvme")
    with pytest.raises(ConfigError, match="nvme_path: is set but offload is 'cpu'"):
        _lc(offload="cpu", nvme_path="/tmp")
    with pytest.raises(ConfigError, match="nvme_buffer_count"):
        _lc(offload="nvme", nvme_path="/tmp", nvme_buffer_count=1)


@needs_aio
def test_nvme_bad_path_fails_before_training(tmp_path):
    cfg = tiny_config(layers=1)
    with pytest.raises(ConfigError, match="nvme_path: .*does not exist"):
        memory_stack(build(cfg), _lc(offload="nvme", nvme_path=str(tmp_path / "missing")))
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        memory_stack(build(cfg), _lc(offload="nvme", nvme_path=str(f)))
    if os.getuid() == 0:
        readonly = "/proc/self"  # root passes permission bits; procfs refuses writes to everyone
    else:
        readonly = tmp_path / "ro"
        readonly.mkdir()
        readonly.chmod(0o500)
    with pytest.raises(ConfigError, match="not writable"):
        memory_stack(build(cfg), _lc(offload="nvme", nvme_path=str(readonly)))


def _run_child(code, env=None, timeout=300):
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def test_a_killed_builds_lock_is_reported_with_its_path_age_and_fix(tmp_path, monkeypatch):
    """torch's JIT build leaves <build dir>/lock when it is killed, and every later load of the op waits on it
    silently forever (15 min seen, twice). A lock with no process building next to it is refused within the window
    (20 s by default; 0.5 s here), naming the file, its age and the fix, through the NVMe install as the ConfigError
    of the offload key; a lock with a live build next to it (a process working in that directory) is waited for."""
    import time

    from ds_longctx.memory import nvme

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    build_dir = nvme.op_build_directory("async_io")
    assert build_dir.startswith(str(tmp_path))
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # an hour old
    monkeypatch.setattr(nvme, "STALE_LOCK_WINDOW_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        memory_stack(build(tiny_config(layers=1)), _lc(offload="nvme", nvme_path=str(tmp_path)))
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert msg.startswith("long_context.activation_checkpointing.offload: DeepSpeed's async_io op is locked by "
                          f"{lock} (made 36") and f"Fix: remove it (rm {lock}) and run again" in msg, msg
    live = subprocess.Popen(["sleep", "60"], cwd=build_dir)  # stands for ninja / the compiler of a live build
    try:
        nvme.check_op_build_lock("async_io", window_s=5.0)  # returns: the build is waited for (torch's own wait)
    finally:
        live.kill()
        live.wait()
    os.remove(lock)
    nvme.check_op_build_lock("async_io", window_s=5.0)  # no lock: nothing to wait for


@pytest.mark.distributed  # spawns a process
def test_aio_op_unavailable_is_a_clear_config_error(tmp_path):
    """With no usable C compiler DeepSpeed's builder cannot link libaio (the check is DeepSpeed's own
    ``AsyncIOBuilder.is_compatible``): building the model's memory stack fails with the key and the fix."""
    code = f"""
        from tiny_models import build, tiny_config
        from ds_longctx.config import ConfigError, parse
        from tiny_models import memory_stack
        lc = parse({{"long_context": {{"activation_checkpointing": {{"enabled": True, "offload": "nvme",
                                                                   "nvme_path": {str(tmp_path)!r}}}}}}})
        try:
            memory_stack(build(tiny_config(layers=1)), lc)
        except ConfigError as e:
            print("CONFIGERROR", e)
    """
    proc = _run_child(code, env={"CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false"})
    assert "CONFIGERROR long_context.activation_checkpointing.offload: 'nvme' needs DeepSpeed's async_io op" \
        in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "libaio-dev" in proc.stdout
    assert _act_dirs(tmp_path) == []


@needs_aio
def test_nvme_files_removed_on_error(tmp_path):
    # in-process: a step that raises mid-forward, then the handle is removed
    cfg = tiny_config(layers=LAYERS)
    model = build(cfg)
    handle = memory_stack(model, _lc(offload="nvme", nvme_path=str(tmp_path)))
    boom = handle.checkpointed_layers[1].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(
        RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        _step(model, _ids(cfg))
    assert len(_act_dirs(tmp_path)) == 1 and handle.stats()["nvme_writes"] + 1 >= 1
    boom.remove()
    handle.remove()
    assert _act_dirs(tmp_path) == []


@needs_aio
@pytest.mark.distributed  # spawns a process
def test_nvme_files_removed_when_the_process_dies_of_an_error(tmp_path):
    code = f"""
        import torch
        from tiny_models import build, tiny_config
        from ds_longctx.config import parse
        from tiny_models import memory_stack
        cfg = tiny_config(layers=3)
        model = build(cfg)
        lc = parse({{"long_context": {{"activation_checkpointing": {{"enabled": True, "offload": "nvme",
                                                                   "nvme_path": {str(tmp_path)!r}}}}}}})
        h = memory_stack(model, lc)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (2, 24))
        loss = model(input_ids=ids, labels=ids).loss
        import os
        print("DIRS", os.listdir({str(tmp_path)!r}))
        raise RuntimeError("crash before backward")
    """
    proc = _run_child(code)
    assert proc.returncode != 0 and "crash before backward" in proc.stderr
    assert "DIRS ['ds_longctx_act_rank0_" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert _act_dirs(tmp_path) == []
