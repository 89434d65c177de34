""""auto" resolution (planner/search.py): keep_attention_output / keep_on_device are reinvested only
where the budgets allow, and every choice is by fit and predicted step time."""
import copy

from ds_longctx.planner import Planner, load_model_config, resolve_auto

SMALL = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 16, "vocab_size": 32000,
         "tie_word_embeddings": False}
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


def _host_node(keep: bool) -> int:
    cfg = copy.deepcopy(CFG)
    _ac(cfg)["keep_attention_output"] = keep
    return Planner(cfg, load_model_config(SMALL), 8, GPU, "2TiB", "2GiB").run(SEQ).host_bytes_per_node


def test_auto_keeps_attention_output_when_host_memory_allows_and_not_when_it_does_not():
    off, on = _host_node(False), _host_node(True)
    assert on > off  # the kept outputs go to host with the layer inputs
    logs = []
    cfg = resolve_auto(CFG, SMALL, 8, GPU, host_mem="2TiB", reserve="2GiB", log=logs.append)
    assert _ac(cfg)["keep_attention_output"] is True, logs
    assert any("keep_attention_output=True: predicted step" in m for m in logs), logs
    # room for the layer inputs but not for the kept outputs as well
    logs = []
    cfg = resolve_auto(CFG, SMALL, 8, GPU, host_mem=str((off + on) // 2), reserve="2GiB", log=logs.append)
    assert _ac(cfg)["keep_attention_output"] is False, logs
    assert any("it does not fit" in m and "host memory" in m for m in logs), logs
    # no host budget given: not reinvested blind
    logs = []
    cfg = resolve_auto(CFG, SMALL, 8, GPU, host_mem=None, reserve="2GiB", log=logs.append)
    assert _ac(cfg)["keep_attention_output"] is False and any("no host budget" in m for m in logs), logs


def test_auto_keep_on_device_takes_the_device_headroom():
    cfg = copy.deepcopy(CFG)
    _ac(cfg).update(keep_attention_output=False, keep_on_device="auto")
    logs = []
    out = resolve_auto(cfg, SMALL, 8, GPU, host_mem="2TiB", reserve="2GiB", log=logs.append)
    k = _ac(out)["keep_on_device"]
    assert isinstance(k, int) and k > 0, logs  # 80 GiB holds several 32 MiB layer inputs
    r = Planner(out, load_model_config(SMALL), 8, GPU, "2TiB", "2GiB").run(SEQ)
    assert r.fits and r.offload["keep_on_device"] == k
    # a device with no headroom beyond the step keeps none
    tight = r.peak_device_bytes - (k * r.offload["layer_input_bytes"]) + 2 * 2**30 + r.offload["layer_input_bytes"] // 2
    out = resolve_auto(cfg, SMALL, 8, tight, host_mem="2TiB", reserve="2GiB", log=logs.append)
    assert _ac(out)["keep_on_device"] == 0, logs[-1]
