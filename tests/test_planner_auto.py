""""auto" resolution (planner/search.py): keep_attention_output / keep_on_device are reinvested only
where the budgets allow, and every choice is by fit and predicted step time."""
import copy

import pytest

from ds_longctx.planner import Planner, load_model_config, resolve_auto

SMALL = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 8, "vocab_size": 32000,
         "tie_word_embeddings": False}  # 8 layers: auto's full-depth candidates (keep_on_device = most layers) cost half of 16
SEQ = 65536
GPU = 80 * 2**30
CFG = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "sequence_parallel_size": 8,
       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
       "long_context": {"sequence_length": SEQ,
                        "attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
                        "activation_checkpointing": {"enabled": True, "offload": "cpu",
                                                     "keep_attention_output": "auto"},
                        "tiled_mlp": {"enabled": True, "shards": 4}, "tiled_loss": {"enabled": True, "shards": 4}}}


def _ac(cfg):
    return cfg["long_context"]["activation_checkpointing"]


KAO, KOD = "activation_checkpointing.keep_attention_output", "activation_checkpointing.keep_on_device"


def _host_node(keep: bool) -> int:
    cfg = copy.deepcopy(CFG)
    _ac(cfg)["keep_attention_output"] = keep
    return Planner(cfg, load_model_config(SMALL), 8, GPU, "2TiB", "2GiB").run(SEQ).host_bytes_per_node


def test_auto_keeps_attention_output_when_host_memory_allows_and_not_when_it_does_not():
    off, on = _host_node(False), _host_node(True)
    assert on > off  # the kept outputs go to host with the layer inputs
    logs = []
    values = resolve_auto(CFG, SMALL, 8, GPU, host_mem="2TiB", reserve="2GiB", log=logs.append)
    assert values == {KAO: True}, logs  # the values of the "auto" keys, nothing else
    assert any("keep_attention_output=True: predicted step" in m for m in logs), logs
    # room for the layer inputs and half of the kept outputs: the first layers that fit keep theirs
    logs = []
    n = resolve_auto(CFG, SMALL, 8, GPU, host_mem=str((off + on) // 2), reserve="2GiB", log=logs.append)[KAO]
    assert not isinstance(n, bool) and n == SMALL["num_hidden_layers"] // 2, logs
    assert any("it does not fit" in m and "host memory" in m and f"the first {n} of {SMALL['num_hidden_layers']}" in m for m in logs), logs
    # (room for the layer inputs only: off, tests/test_planner_auto.py's initialize case, on a tiny model)
    # no host budget given: not reinvested blind
    logs = []
    values = resolve_auto(CFG, SMALL, 8, GPU, host_mem=None, reserve="2GiB", log=logs.append)
    assert values[KAO] is False and any("no host budget" in m for m in logs), logs


def test_auto_keep_on_device_takes_the_device_headroom():
    cfg = copy.deepcopy(CFG)
    _ac(cfg).update(keep_attention_output=False, keep_on_device="auto")
    logs = []
    k = resolve_auto(cfg, SMALL, 8, GPU, host_mem="2TiB", reserve="2GiB", log=logs.append)[KOD]
    assert isinstance(k, int) and k > 0, logs  # 80 GiB holds several 32 MiB layer inputs
    out = copy.deepcopy(cfg)
    _ac(out)["keep_on_device"] = k
    r = Planner(out, load_model_config(SMALL), 8, GPU, "2TiB", "2GiB").run(SEQ)
    assert r.fits and r.offload["keep_on_device"] == k
    # a device with no headroom beyond the step keeps none
    tight = r.peak_device_bytes - (k * r.offload["layer_input_bytes"]) + 2 * 2**30 + r.offload["layer_input_bytes"] // 2
    assert resolve_auto(cfg, SMALL, 8, tight, host_mem="2TiB", reserve="2GiB", log=logs.append)[KOD] == 0, logs[-1]


def test_initialize_resolves_keep_attention_output_auto_with_this_machines_host_budget(monkeypatch, caplog):
    """ds_longctx.initialize's resolution (initialize._resolve_auto: rank 0 of no process group here) of a
    config that says "auto": the host budget is DS_LONGCTX_HOST_MEM (else this machine's RAM) shared by the
    local ranks, the device budget this device's; where the host budget holds the kept outputs too it is
    turned on, where it holds part of them the first layers that fit keep theirs, where it holds only the layer
    inputs it is off, and each choice is logged with its reason."""
    import logging

    from tiny_models import tiny_config

    import importlib

    init = importlib.import_module("ds_longctx.initialize")
    from ds_longctx.config import parse

    mc = tiny_config(heads=4, kv_heads=2, head_dim=8, layers=2)
    seq = 256
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "sequence_parallel_size": 1,
           "long_context": {"sequence_length": seq,
                            "attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1},
                            "activation_checkpointing": {"enabled": True, "offload": "cpu",
                                                         "keep_attention_output": "auto"}}}
    assert parse(cfg).activation_checkpointing.keep_attention_output == "auto"

    def host_node(keep):
        c = copy.deepcopy(cfg)
        _ac(c)["keep_attention_output"] = keep
        return Planner(c, mc, 1, 2**40, "1TiB", "0", gpus_per_node=1).run(seq).host_bytes_per_node

    off, on = host_node(False), host_node(True)
    assert on > off > 0
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # room for every kept output, for one layer's of two, for none
    for budget, want in ((str(4 * on), True), (str((off + on) // 2), 1), (str(off + (on - off) // 8), False)):
        monkeypatch.setenv(init.HOST_MEM_ENV, budget)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ds_longctx"):
            out = init._resolve_auto(cfg, mc, 1)
        msgs = [r.getMessage() for r in caplog.records]
        got = out[KAO]
        assert got == want and isinstance(got, bool) == isinstance(want, bool), msgs
        assert any(f"{init.HOST_MEM_ENV}={budget}" in m and "1 local rank" in m for m in msgs), msgs
        assert any(f"keep_attention_output={want}:" in m for m in msgs), msgs
        if want is not True:
            assert any("it does not fit" in m and "host memory" in m for m in msgs), msgs
    monkeypatch.setenv(init.HOST_MEM_ENV, "lots")
    with pytest.raises(Exception, match="DS_LONGCTX_HOST_MEM.*not a size"):
        init._resolve_auto(cfg, mc, 1)


def test_auto_keep_values_are_refused_where_nothing_resolves_them():
    from tiny_models import tiny_config

    from ds_longctx.config import ConfigError, parse

    cfg = {"long_context": {"attention": {"implementation": "untied_ulysses"},
                            "activation_checkpointing": {"enabled": True, "keep_attention_output": "auto"}}}
    with pytest.raises(ConfigError, match="keep_attention_output.*sequence_length is not set"):
        parse(cfg)
    cfg["long_context"]["sequence_length"] = 64
    with pytest.raises(ConfigError, match="keep_attention_output.*a choice the planner makes"):
        Planner(cfg, tiny_config(), 1, 2**40)
    from tiny_models import spec_for

    with pytest.raises(ConfigError, match="keep_attention_output.*unresolved"):
        spec_for(tiny_config(), parse(cfg))


def test_resolve_builds_each_configuration_as_a_new_value_and_walks_ties():
    """planner/search.resolve over a table of (fits, predicted seconds) per (heads_per_chunk, tiled_mlp shards)
    (the planner's answers stand in for simulations here: what is under test is the search): every configuration
    it hands the planner is a new ds_config that nothing changes afterwards, the input is untouched, and the
    choices and log lines follow the speed order (first fitting value, then the next ones while predicted
    faster by more than TIE)."""
    from ds_longctx.planner.search import TIE, resolve

    cfg = copy.deepcopy(CFG)
    lc = cfg["long_context"]
    lc["attention"]["heads_per_chunk"] = "auto"
    lc["tiled_mlp"]["shards"] = "auto"
    before = copy.deepcopy(cfg)
    # 16 heads / SP 8: heads_per_chunk in [2, 1]; 8192 local tokens / hidden 2048: mlp shards in [1, 2, 4]
    fast = 8.0 * (1 - 2 * TIE)  # (2, 4): fits first for heads_per_chunk; for the shards, faster than (2, 2)
    table = {(1, 4): (True, 10.0), (2, 4): (True, fast), (2, 1): (False, 1.0), (2, 2): (True, 8.0)}

    class Result:
        binding_detail, host_budget_bytes, offload = "table", None, None

        def __init__(self, fits, seconds):
            self.fits, self.time = fits, {"seconds": seconds}

    handed = []

    class Planner_:
        def __init__(self, c):
            handed.append((c, copy.deepcopy(c)))
            self.c = c

        def run(self, seq):
            a = self.c["long_context"]
            return Result(*table[(a["attention"]["heads_per_chunk"], a["tiled_mlp"]["shards"])])

    logs = []
    out = resolve(Planner_, cfg, load_model_config(SMALL), 8, SEQ, logs.append)
    assert cfg == before
    # the chosen values only (tiled_loss is not "auto": not among them)
    assert out == {"attention.heads_per_chunk": 2, "tiled_mlp.shards": 4, KAO: False}
    assert [(c["long_context"]["attention"]["heads_per_chunk"], c["long_context"]["tiled_mlp"]["shards"])
            for c, _ in handed] == [(1, 4), (2, 4), (1, 4), (2, 1), (2, 2), (2, 4)]
    assert all(c == snap for c, snap in handed)  # nothing edited a configuration after handing it over
    assert len({id(c) for c, _ in handed} | {id(cfg)}) == len(handed) + 1
    assert logs == [
        "ds_longctx auto: long_context.attention.heads_per_chunk=2: the first in speed order whose step fits at "
        f"65536 tokens on 8 ranks (predicted step {fast:.4g} s; candidates in speed order: [2, 1])",
        "ds_longctx auto: long_context.tiled_mlp.shards=4: predicted faster than the values before it in speed order "
        f"at 65536 tokens on 8 ranks (predicted step {fast:.4g} s; candidates in speed order: [1, 2, 4])",
        "ds_longctx auto: long_context.activation_checkpointing.keep_attention_output=False: the kept outputs go to "
        "host memory with the layer inputs and no host budget was given to check them against"]
