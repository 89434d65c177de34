"""The planner's reserved bytes (issue 48): the simulated step's device allocations replayed through the caching-
allocator model (measure/allocator.py), reported beside the allocated peak and used for "fits"."""
import pytest
from transformers import LlamaConfig

from ds_longctx.config import ConfigError
from ds_longctx.planner.core import Planner, allocator_mode
from ds_longctx.planner.simulate import simulate_step
from ds_longctx.config import parse
from ds_longctx.planner import host as host_plan

MODEL = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2, vocab_size=32000, tie_word_embeddings=False)
DS = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
      "long_context": {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
                       "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                       "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}}
SEQ = 8192


def _mc():
    return LlamaConfig(**MODEL)


def test_the_step_carries_its_allocator_replay():
    r = simulate_step(_mc(), DS, host_plan.simulation_lc(parse(DS)), 1, SEQ, 2)
    for mode in ("expandable", "classic"):
        a = r.allocator[mode]
        # the replay's allocated peak is the accountant's, each request rounded up to 512 B (scalars included)
        assert r.peak_device <= a["allocated"] <= r.peak_device * 1.03
        assert a["allocated"] <= a["floor"] <= a["reserved"]
        assert r.reserved_slack(mode) == a["reserved"] - a["allocated"]
        # the tiled loss's fp32 logit tiles are what strands memory at this shape: named by category/op
        assert a["stranded"] and all("/" in label and n > 0 for label, n in a["stranded"])
        assert any(label.startswith("loss/") for label, _ in a["stranded"])


def test_plan_reports_reserved_and_fits_on_it():
    p = Planner(DS, _mc(), 1, "80GiB", reserve="1GiB", allocator="expandable")
    r = p.run(SEQ)
    al = r.allocator
    assert al["mode"] == "expandable" and set(al["reserved_by_mode"]) == {"expandable", "classic"}
    assert al["activation_slack_bytes"] > 0
    assert r.reserved_device_bytes == max(r.activation_peak_bytes + al["activation_slack_bytes"], r.step_peak_bytes)
    assert r.reserved_device_bytes == al["reserved_by_mode"]["expandable"] > r.peak_device_bytes
    assert r.peak_device_bytes <= al["floor_bytes"] < r.reserved_device_bytes
    # expandable segments: what must fit is the floor (cached pages are given back when a mapping fails)
    assert r.limits["device"]["need"] == al["need_bytes"] == al["floor_bytes"] and r.fits
    assert r.to_dict()["reserved_device_bytes"] == r.reserved_device_bytes
    # a budget between the floor and the reserved peak: fits, and says the allocator will flush its cache
    budget = (al["floor_bytes"] + r.reserved_device_bytes) // 2 + (1 << 30)
    mid = Planner(DS, _mc(), 1, str(budget), reserve="1GiB", allocator="expandable").run(SEQ)
    assert mid.fits and any("over the budget" in n and "floor" in n for n in mid.notes), mid.notes
    # classic segments: the reserved peak must fit; a budget between the allocated and the reserved peak does not
    c = Planner(DS, _mc(), 1, "80GiB", reserve="1GiB", allocator="classic").run(SEQ)
    assert c.limits["device"]["need"] == c.reserved_device_bytes == c.allocator["need_bytes"]
    budget = c.peak_device_bytes + (1 << 30) + c.allocator["activation_slack_bytes"] // 2
    tight = Planner(DS, _mc(), 1, str(budget), reserve="1GiB", allocator="classic").run(SEQ)
    assert tight.peak_device_bytes + tight.reserve_bytes <= budget and not tight.fits
    assert tight.binding == "device"


def test_allocator_modes_and_the_environment(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert allocator_mode() == "expandable"  # launch/*.sh export expandable segments
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert allocator_mode() == "classic"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert allocator_mode() == "expandable" and allocator_mode("classic") == "classic"
    with pytest.raises(ConfigError, match="--allocator"):
        allocator_mode("buddy")
    c = Planner(DS, _mc(), 1, "80GiB", allocator="classic").run(SEQ)
    assert c.allocator["mode"] == "classic"
    assert c.reserved_device_bytes == c.allocator["reserved_by_mode"]["classic"]


def test_a_simulated_cpu_run_has_no_caching_allocator():
    r = Planner(DS, _mc(), 1, "80GiB", device="cpu").run(2048)
    assert r.reserved_device_bytes == r.peak_device_bytes and r.allocator["activation_slack_bytes"] == 0
