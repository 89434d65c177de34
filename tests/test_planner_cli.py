"""ds-longctx plan: exit codes (0 fits, 1 not, 2 bad input with a clear message) and the --json schema."""
import json

import pytest

from ds_longctx.planner.cli import main

MODEL = "ds_configs/models/llama3-8b.json"
# a 1B-class Llama: same code paths as 8B, fewer bytes to push through the tiled loops on 2 shared cores
SMALL = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 16, "vocab_size": 32000,
         "tie_word_embeddings": False}
BASE = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "sequence_parallel_size": 8,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "long_context": {"attention": {"implementation": "ulysses"},
                         "activation_checkpointing": {"enabled": True, "offload": "cpu"},
                         "tiled_mlp": {"enabled": True}, "tiled_loss": {"enabled": True}}}


# host RAM of the node being planned for (the default, this machine's RAM, is a CI box's)
HOST = ["--host-mem", "2TiB"]


def _cfg(tmp_path, cfg=None, name="ds.json"):
    p = tmp_path / name
    p.write_text(json.dumps(BASE if cfg is None else cfg))
    return str(p)


def test_json_schema_and_fits(tmp_path, capsys):
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", MODEL, "--gpus", "8", "--gpu-mem", "80GiB",
               "--seq-len", "131072", "--json"] + HOST)
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    for key in ("fits", "peak_device_bytes", "host_bytes", "breakdown", "sequence_length", "device_budget_bytes"):
        assert key in out
    assert set(out["breakdown"]) == {"model_states", "attention", "mlp", "loss", "other"}
    assert out["activation_peak_bytes"] == sum(out["breakdown"].values())
    assert out["peak_device_bytes"] == max(out["activation_peak_bytes"], out["step_peak_bytes"])
    assert out["host"]["offloaded activations"] > 0 and out["host"]["optimizer"] > 0


def _small(tmp_path, **changes):
    p = tmp_path / "small.json"
    p.write_text(json.dumps(dict(SMALL, **changes)))
    return str(p)


def test_does_not_fit_exits_1(tmp_path, capsys):
    # 5 GiB less the 2 GiB reserve: above the model states (2.44 GiB), below the step's peak at 64K tokens (3.36
    # GiB); the other tests plan the same step at 64K (simulated once: the planner's memo)
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", _small(tmp_path), "--gpus", "8",
               "--gpu-mem", "5GiB", "--seq-len", "65536", "--json"] + HOST)
    assert rc == 1 and json.loads(capsys.readouterr().out)["fits"] is False


@pytest.mark.parametrize("args,cfg,needle", [
    (["--gpus", "8"], None, "model config"),                                   # missing model config
    (["--gpus", "12", "--model-config", MODEL], None, "does not divide the world size 12"),
    # 3GiB: above the default 2GiB reserve, below the model states
    (["--gpus", "8", "--gpu-mem", "3GiB", "--model-config", MODEL], None, "no sequence length can fit"),
    (["--gpus", "8", "--gpu-mem", "1GiB", "--model-config", MODEL], None, "leaves nothing after the reserve"),
    (["--gpus", "8", "--gpu-mem", "lots", "--model-config", MODEL], None, "byte size"),
    (["--gpus", "8", "--model-config", "nope/config.json"], None, "does not exist"),
    # a hub id: the planner reads local configs only, and says so with the fixes
    (["--gpus", "8", "--model", "meta-llama/Llama-3.1-8B"], None, "--model: 'meta-llama/Llama-3.1-8B' is not a "
     "local model directory (the planner reads a local config.json and does not download"),
    (["--gpus", "8", "--model-config", MODEL], dict(BASE, long_context={"tiled_mpl": {}}), "unknown key"),
])
def test_bad_input_exits_2(tmp_path, capsys, args, cfg, needle):
    rc = main(["plan", "--config", _cfg(tmp_path, cfg), "--seq-len", "65536"] + HOST + args)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err


def test_compare_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "stack.png"
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", _small(tmp_path), "--gpus", "8",
               "--gpu-mem", "80GiB", "--seq-len", "65536", "--compare", "--json", "--plot", str(png)] + HOST)
    out = json.loads(capsys.readouterr().out)
    labels = [c["label"] for c in out["configs"]]
    assert labels == ["no SP", "Ulysses", "+checkpointing", "+offload", "+tiled MLP and loss", "+untied attention",
                      "+memory-efficient RMSNorm"]
    peaks = [c["peak_device_bytes"] for c in out["configs"]]
    assert peaks[2] < peaks[1] and peaks[4] < peaks[3]  # checkpointing and tiling each save memory
    assert rc == 0 and png.stat().st_size > 1000


def test_host_budget_picks_the_offload_target(tmp_path, capsys):
    """--host-mem per node is checked: with room for the NVMe staging ring but not for every layer input
    in host memory, the plan does not fit (exit 1) and recommends offload='nvme'; per-node host and NVMe
    bytes are stated for each target."""
    args = ["plan", "--config", _cfg(tmp_path), "--model-config", _small(tmp_path), "--gpus", "8",
            "--gpu-mem", "80GiB", "--seq-len", "65536", "--json"]
    assert main(args + HOST) == 0
    out = json.loads(capsys.readouterr().out)
    off = out["offload"]
    layer = 65536 // 8 * SMALL["hidden_size"] * 2
    assert off["target"] == "cpu" and off["layer_input_bytes"] == layer and off["offloaded_layers"] == 16
    assert out["host"]["offloaded activations"] == 16 * layer
    opts = {(o["target"], o["keep_on_device"]): o for o in off["options"]}
    cpu, nvme = opts[("cpu", 0)], opts[("nvme", 0)]
    states_node = (out["host_bytes"] - 16 * layer) * 8
    assert cpu["host_bytes_per_node"] == states_node + 8 * 16 * layer
    assert nvme["host_bytes_per_node"] == states_node + 8 * 3 * layer and nvme["nvme_bytes_per_node"] == 8 * 16 * layer
    budget = (cpu["host_bytes_per_node"] + nvme["host_bytes_per_node"]) // 2
    # HBM headroom for 2.5 layer inputs over what must fit (the allocator's floor, expandable segments: "fits" uses it):
    # the last 2 can stay on the device
    need = out["allocator"]["need_bytes"]
    assert out["reserved_device_bytes"] >= need >= out["peak_device_bytes"]
    args[args.index("80GiB")] = str(need + out["reserve_bytes"] + int(2.5 * layer))
    assert main(args + ["--host-mem", str(budget)]) == 1
    out = json.loads(capsys.readouterr().out)
    rec = out["offload"]["recommended"]
    assert out["fits"] is False and rec["target"] == "nvme" and rec["keep_on_device"] == 2, rec
    assert rec["keys"]["offload"] == "nvme" and rec["keys"]["keep_on_device"] == 2
    # (an option's peak is what must fit: the activation peak's floor + the inputs it keeps)
    assert rec["nvme_bytes_per_node"] == 8 * 14 * layer and \
        rec["peak_device_bytes"] == out["allocator"]["need_bytes"] + 2 * layer
    assert any(n.startswith("host memory per node: ") and " over " in n and "(--host-mem)" in n and "'nvme'" in n
               for n in out["notes"]), out["notes"]
    # and a config that asks for nvme fits there, its host figure being the ring
    cfg = json.loads(json.dumps(BASE))
    cfg["long_context"]["activation_checkpointing"].update(offload="nvme", nvme_path=str(tmp_path))
    assert main(["plan", "--config", _cfg(tmp_path, cfg, "nvme.json")] + args[3:] + ["--host-mem", str(budget)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_bytes_per_node"] == nvme["host_bytes_per_node"]
    assert out["nvme_bytes_per_node"] == nvme["nvme_bytes_per_node"]


def test_too_small_host_mem_exits_2(tmp_path, capsys):
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", _small(tmp_path), "--gpus", "8",
               "--seq-len", "65536", "--host-mem", "1GiB"])
    err = capsys.readouterr().err
    assert rc == 2 and "--host-mem" in err and "model states alone" in err, err


def test_text_output_states_budget_and_reserve(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", _small(tmp_path), "--gpus", "8",
               "--seq-len", "65536"] + HOST)
    out = capsys.readouterr().out
    assert rc == 0
    assert "79.10 GiB per device (nominal H100-80GB" in out and "reserve of 2.00 GiB for CUDA context" in out
    assert "the step may use 77.10 GiB" in out


def test_readme_command_uses_the_shipped_targets_host_and_says_what_binds(capsys):
    """README's own command (no --host-mem) on a machine with little RAM: a shipped config is checked
    against its stated node (ds_configs/targets.json, through the 5m.json link), not this machine's RAM."""
    rc = main(["plan", "--deepspeed_config", "ds_configs/5m.json", "--model-config", MODEL, "--gpus", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["host_budget_bytes"] == 2 * 2**40, out["host_budget_bytes"]
    assert "targets.json" in out["host_budget_source"] and "llama3-8b-5m.json" in out["host_budget_source"]
    assert out["binding"] == "device" and set(out["limits"]) == {"device", "host", "nvme"}
    assert out["limits"]["host"]["budget"] == 2 * 2**40 and out["limits"]["nvme"]["budget"] is None


def test_unshipped_config_host_not_checked_by_default_and_binding_printed(tmp_path, capsys):
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", _small(tmp_path), "--gpus", "8",
               "--gpu-mem", "80GiB", "--seq-len", "65536"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "limits: fits; tightest: device memory" in text and "host memory not checked" in text, text
    assert "NVMe not checked" in text and " binds" not in text  # nothing binds a plan that fits


def test_max_context_says_which_limit_binds(tmp_path, capsys):
    """Device-bound at 8 GiB per GPU; host-bound when --host-mem leaves room for ~half of the 64K
    tokens' offloaded layer inputs (and the device has plenty)."""
    # 8 layers: the answer's full-depth re-check simulates half the layers of 16; two tiles (MLP, loss) at any length:
    # which limit binds does not depend on the tile count, the simulated step's op count does ('auto' grows with S)
    two = {"enabled": True, "shards": 2}
    cfg = dict(BASE, long_context=dict(BASE["long_context"], tiled_mlp=two, tiled_loss=two))
    args = ["plan", "--config", _cfg(tmp_path, cfg, "two_tiles.json"), "--model-config",
            _small(tmp_path, num_hidden_layers=8), "--gpus", "8", "--json"]
    assert main(args + ["--gpu-mem", "8GiB", "--max-context"] + HOST) == 0
    dev = json.loads(capsys.readouterr().out)
    assert dev["max_sequence_length"] % 8 == 0 and dev["max_sequence_length"] > 0  # the --max-context JSON
    assert dev["fits"] and dev["sequence_length"] == dev["max_sequence_length"]
    assert dev["binding"] == "device" and "bound by device memory" in dev["binding_detail"], dev["binding_detail"]
    assert main(args + ["--gpu-mem", "80GiB", "--seq-len", "65536"] + HOST) == 0
    full = json.loads(capsys.readouterr().out)
    acts = full["host"]["offloaded activations"] * 8
    budget = full["host_bytes_per_node"] - acts // 2
    rc = main(args + ["--gpu-mem", "80GiB", "--max-context", "--host-mem", str(budget)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["binding"] == "host", (out["binding"], out["binding_detail"])
    assert "bound by host memory" in out["binding_detail"]
    assert 16384 < out["max_sequence_length"] < 65536 and out["host_bytes_per_node"] <= budget
    # the device had room: the answer is not device-bound
    assert out["reserved_device_bytes"] + out["reserve_bytes"] < out["device_budget_bytes"] // 2


def test_planner_words_show_the_excess_and_say_binds_only_for_a_binding_limit():
    """The over-budget line shows the digits that tell need from budget (it said "2.00 TiB > 2.00 TiB"), and the
    device is compared as the budget line states it (the peak against the usable memory: it compared peak +
    reserve with the whole budget); a plan that fits names its tightest limit, not a limit that "binds"; times read
    as times; a max-context answer says what bounds it once."""
    from types import SimpleNamespace

    from ds_longctx.planner.core import _bound_by, binding_limit
    from ds_longctx.planner.units import fmt_seconds

    tib, gib = 2**40, 2**30
    over = {"device": {"need": int(77.104 * gib), "budget": int(77.1 * gib), "per": "device"},
            "host": {"need": 2 * tib + 450 * 2**20, "budget": 2 * tib, "per": "node"},
            "nvme": {"need": 0, "budget": None, "per": "node"}}
    key, words = binding_limit(over)
    # the larger overshoot first (host: 2.1e-4 of its budget, device 5.3e-5)
    assert key == "host" and words == ("over host memory: 2.0004 TiB, 450.00 MiB over 2.0000 TiB per node; device "
                                       "memory: 77.104 GiB, 4.10 MiB over 77.100 GiB usable per device; NVMe not "
                                       "checked (0 B/node)"), words
    within = dict(over, device={"need": 54 * gib, "budget": int(77.1 * gib), "per": "device"},
                  host={"need": tib, "budget": 2 * tib, "per": "node"})
    key, words = binding_limit(within)
    assert key == "device" and words.startswith("fits; tightest: device memory 70% used (54.00 GiB of 77.10 GiB "
                                                "usable per device); host memory 50% used") and "binds" not in words
    stop = SimpleNamespace(limits=over, binding="device", binding_detail="", sequence_length=5_242_888)
    best = _bound_by(SimpleNamespace(binding="", binding_detail=""), stop, 5_242_880)
    assert best.binding_detail == ("bound by device memory: at 5,242,888 tokens 77.104 GiB, 4.10 MiB over 77.100 GiB "
                                   "usable per device"), best.binding_detail
    assert [fmt_seconds(x) for x in (7470, 314.8, 17.5, 3599.9)] == ["2 h 04 min", "5 min 15 s", "17.5 s",
                                                                     "1 h 00 min"]


def test_plot_without_matplotlib_is_refused_before_the_simulation(tmp_path, capsys, monkeypatch):
    import sys

    import ds_longctx.planner.cli as plan_cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as in an install without the test extra

    def no_simulation(*args, **kwargs):
        raise AssertionError("the planner ran before --plot was refused")

    monkeypatch.setattr(plan_cli, "Planner", no_simulation)
    rc = main(["plan", "--config", _cfg(tmp_path), "--model-config", MODEL, "--gpus", "8", "--seq-len", "65536",
               "--plot", str(tmp_path / "p.png")] + HOST)
    err = capsys.readouterr().err
    assert rc == 2 and "--plot: needs matplotlib, which is not installed" in err and "pip install matplotlib" in err, err


def test_shipped_names_from_another_directory(capsys, monkeypatch, tmp_path):
    """From a wheel install (or any directory): the shipped names, as train.py takes them: the ds_config by name,
    the model config from ds_configs/models/ (before: "file 'tiny-cpu.json' does not exist")."""
    from ds_longctx.cli import main as ds_longctx_main  # the `ds-longctx` command

    monkeypatch.chdir(tmp_path)
    rc = ds_longctx_main(["plan", "--deepspeed_config", "tiny-cpu.json", "--model-config", "tiny-llama.json",
                          "--gpus", "2", "--seq-len", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["sequence_length"] == 64 and out["world_size"] == 2, out
    rc = ds_longctx_main(["plan", "--deepspeed_config", "no-such.json", "--model-config", "tiny-llama.json",
                          "--gpus", "2"])
    assert rc == 2 and "'no-such.json' does not exist" in capsys.readouterr().err
