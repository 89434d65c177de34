"""Issue 19, items 4-6: the architectures users bring train exactly at SP=2 or get a clear error (heads, KV
heads and head_dim through one helper); a bad batch on one rank is the same error on every rank before any
collective; a full-length eval batch is sharded like training and gives the one-process eval loss (plain
loop and the HF Trainer's evaluate()); train.py checks world vs SP before building the model."""
import os
import subprocess
import sys

import pytest
import torch

from arch_cases import arch_config, isclose, max_delta_error
from dist_utils import result_or_raise, run_distributed_side_by_side
from eco_cases import config_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("mixtral", "gpt_neox", "phi3", "olmo2", "qwen2_moe")


def test_attention_shape_reads_every_spelling():
    from transformers import FalconConfig

    from ds_longctx.models import attention_shape

    got = {n: attention_shape(arch_config(n)) for n in ARCHS}
    assert arch_config("mixtral").head_dim is None and got["mixtral"].head_dim == 8  # hidden 32 / 4 heads
    assert not hasattr(arch_config("gpt_neox"), "num_key_value_heads") and got["gpt_neox"].kv_heads == 4
    assert [(s.heads, s.kv_heads, s.head_dim) for s in got.values()] == [(4, 2, 8), (4, 4, 8), (4, 2, 8), (4, 2, 8),
                                                                         (4, 2, 8)]
    assert attention_shape(FalconConfig(hidden_size=32, num_attention_heads=4)).kv_heads == 1  # multi_query
    import types

    e = config_error(attention_shape, types.SimpleNamespace(model_type="x", hidden_size=30, num_attention_heads=4))
    assert e.startswith("model.config.head_dim") and "set head_dim" in e


def test_launch_world_must_be_a_multiple_of_sp(monkeypatch):
    from ds_longctx.dist.launch import check_launch

    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    e = config_error(check_launch, 8)
    assert e.startswith("sequence_parallel_size: 8 does not divide the world size 1")
    assert "plain `python` start" in e and "deepspeed --num_gpus 8" in e
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "12")
    assert "world size 12 (the launcher started 12 processes)" in config_error(check_launch, 8)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "16")
    assert check_launch(8) == 16


@pytest.mark.distributed  # a train.py subprocess (the marker: CLI subprocesses)
def test_train_py_sp8_config_on_one_process_fails_before_the_model():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                            "SLURM_NTASKS")}
    # --allow-beyond-max-position: 5M tokens on the 8B config's 8192 positions is refused first otherwise
    p = subprocess.run([sys.executable, "train.py", "--deepspeed_config", "ds_configs/5m.json", "--model-config",
                        "ds_configs/models/llama3-8b.json", "--allow-beyond-max-position"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "sequence_parallel_size: 8 does not divide the world size 1" in p.stdout + p.stderr, p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# SP=2, real engines (ZeRO-3, gloo)
# ---------------------------------------------------------------------------------------------

UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
ULYSSES = {"attention": {"implementation": "ulysses"}}
# the memory stack: offloaded checkpointing, tiled MLP (the MoE block as a whole), tiled loss, RMSNorm
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 3}, "tiled_loss": {"enabled": True, "shards": 2},
         "rms_norm": {"enabled": True}}


def _engines(rank, world):
    import ds_longctx
    from arch_cases import build_arch, reference, sample, sp_step
    from ds_longctx.data import shard_batch
    from sp_cases import ds_config

    out = {"exact": {}}
    batch = sample(16)
    # Gemma3 (q/k-norm, query_pre_attn_scalar, sliding-window layers): exact when every sample fits the window,
    # which long_context.sequence_length declares (else refused: test_sp_attention_refusals.py)
    # + Qwen3-MoE's block and Gemma's MLP (LlamaMLP's forward, recognised by its source) tiled under ZeRO-3
    for name, seq in [(n, None) for n in ARCHS + ("qwen3_moe", "gemma")] + [("gemma3", 16)]:
        ref = reference(name, batch)
        for impl, lc in (("ulysses", ULYSSES), ("untied", UNTIED), ("untied+stack", {**UNTIED, **STACK})):
            loss, deltas = sp_step(name, dict(lc, sequence_length=seq) if seq else lc, batch, rank)
            moved = min(float(d.abs().max()) for d in ref[1].values())  # the test can fail: every parameter moved
            out["exact"][name, impl] = (ref[0], loss, max_delta_error(ref[1], deltas, ref[2]), moved)
    # batch faults: each a ConfigError on BOTH ranks, before any collective (else the test hangs)
    model = build_arch("mixtral")
    engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=ds_config(3, 2, UNTIED))
    ids = sample(33)["input_ids"]
    cut = slice(0, 17) if rank == 0 else slice(17, 33)
    out["unequal"] = config_error(lambda: engine(input_ids=ids[:, cut], position_ids=torch.arange(33)[None, cut],
                                                 shift_labels=ids[:, cut]))
    full = sample(16)
    shard = shard_batch(full, rank, 2)
    left_padded = dict(shard, attention_mask=torch.ones(1, 8, dtype=torch.long))
    if rank == 0:
        left_padded["attention_mask"][:, :2] = 0
    out["left_pad_rank0"] = config_error(lambda: engine(**left_padded))
    hand_cut = {k: v for k, v in shard.items() if k != "doc_cu_seqlens"}
    mask4d = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    out["mask_4d"] = config_error(lambda: engine(**hand_cut, attention_mask=mask4d))
    # a full batch in training: refused where the ranks hold different ones; the same on every rank (after generation)
    # is sharded by the forward itself (objectives/replicated.py)
    own_full = sample(16, seed=20 + rank)
    out["full_train"] = config_error(lambda: engine(**dict(own_full, position_ids=torch.arange(16)[None])))
    out["full_same_train"] = engine(**dict(full, position_ids=torch.arange(16)[None])).loss.item()
    out["full_no_labels"] = config_error(lambda: engine(input_ids=full["input_ids"],
                                                        position_ids=torch.arange(16)[None]))
    # evaluation, plain loop: every rank its own full-length batch, sharded over the group in turns
    engine.eval()
    own = sample(16, seed=10 + rank)
    out["eval_with_grad"] = config_error(lambda: engine(**own))
    from ds_longctx.patching import sp_batch

    real, seen = sp_batch.shard_in_turns, []  # data.turns', as sp_batch.eval_in_turns calls it

    def recording(*a, **k):
        shards, mine = real(*a, **k)
        seen.append([tuple(s["input_ids"].shape) for s in shards])
        return shards, mine

    sp_batch.shard_in_turns = recording
    try:
        with torch.no_grad():
            out["eval_own"] = engine(**own).loss.item()
            out["eval_same"] = engine(**full).loss.item()  # replicated: one turn
    finally:
        sp_batch.shard_in_turns = real
    out["eval_turns"] = seen
    ref_model = build_arch("mixtral")
    with torch.no_grad():
        out["eval_ref"] = [ref_model(**sample(16, seed=10 + r)).loss.item() for r in range(2)]
        out["eval_ref_same"] = ref_model(**full).loss.item()
    return out


@pytest.fixture(scope="module")
def spawns():
    """The two SP=2 spawns of this file (_engines, _trainers), independent, started side by side once; each test
    re-raises its own spawn's failure."""
    return dict(zip(('engines', 'trainers'), run_distributed_side_by_side((_engines, 2), (_trainers, 2), return_exceptions=True)))


@pytest.mark.distributed
def test_architectures_and_batch_faults_at_sp2(spawns):
    res = result_or_raise(spawns["engines"])
    for rank, r in enumerate(res):
        for (name, impl), (ref, loss, (delta, where), moved) in r["exact"].items():
            print(rank, name, impl, ref, loss, delta, where)
            assert isclose(ref, loss, 1e-5), (name, impl, ref, loss)
            assert delta < 1e-5 and moved > 0, (name, impl, delta, where, moved)
        assert "the SP ranks hold shards of [batch, tokens] [(1, 17), (1, 16)]" in r["unequal"]
        assert r["left_pad_rank0"].startswith("batch.attention_mask: (SP rank 0's shard) has padding"), r
        assert "custom 4-D masks are not supported" in r["mask_4d"]
        assert "full-length batch, not this rank's sequence shard" in r["full_train"]
        assert "torch.no_grad()" in r["full_train"].split("Fix:")[1]
        assert "every SP rank holds positions 0..15: a full-length (unsharded) batch" in r["full_no_labels"]
        assert "packed" not in r["full_no_labels"]  # the old misleading message
        assert "gradients are enabled" in r["eval_with_grad"]
        # each rank's own batch: two turns of 8-token shards; the same batch on both: one turn
        assert r["eval_turns"] == [[(1, 8), (1, 8)], [(1, 8)]], r["eval_turns"]
        assert isclose(r["eval_own"], r["eval_ref"][rank], 1e-5), (rank, r["eval_own"], r["eval_ref"])
        assert isclose(r["eval_same"], r["eval_ref_same"], 1e-5)
        assert isclose(r["full_same_train"], r["eval_ref_same"], 1e-5)
    assert res[0]["eval_own"] != res[1]["eval_own"]


def _trainers(rank, world):
    import arch_cases
    from eco_cases import ProcessState

    from ds_longctx.data import turns
    from ds_longctx.patching import sp_batch

    state = ProcessState()
    real, seen = turns.shard_in_turns, []

    def recording(*a, **k):
        shards, mine = real(*a, **k)
        seen.append(len(shards))
        return shards, mine

    turns.shard_in_turns = sp_batch.shard_in_turns = recording  # the name each module calls
    out = {}
    memory = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
              "tiled_loss": {"enabled": True, "shards": 2}}
    for key, name, lc in (("llama_untied_memory", "llama", {**UNTIED, **memory}),
                          ("mixtral_ulysses", "mixtral", ULYSSES), ("gpt_neox_ulysses", "gpt_neox", ULYSSES)):
        seen.clear()
        out[key] = arch_cases.trainer_eval(name, 2, lc, rank) + (list(seen),)
        state.reset()
    turns.shard_in_turns = sp_batch.shard_in_turns = real
    return out


@pytest.mark.distributed
def test_trainer_evaluate_under_sp_equals_one_process(spawns):
    """The Trainer's evaluate() after one SP=2 training step equals the one-process eval loss of the same
    weights; every eval batch went through the sharded turns. Mixtral (head_dim None) and GPT-NeoX (no
    num_key_value_heads) also pass DeepSpeed's register_with_transformers, which Accelerate calls."""
    res = result_or_raise(spawns["trainers"])
    for r in res:
        for key, (got, ref, turns) in r.items():
            print(key, got, ref, turns)
            assert isclose(got, ref, 1e-5), (key, got, ref)
            assert turns and all(t in (1, 2) for t in turns), (key, turns)


# ---------------------------------------------------------------------------------------------
# tiled MLP over more architectures (models/gemma.py, models/others.py)
# ---------------------------------------------------------------------------------------------

MLP_ARCHS = ("gemma2", "gemma3", "phi3", "olmo2", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
             # recognised by their MLP's source (models.pointwise_mlp_form): LlamaMLP's, Phi3MLP's, NemotronMLP's,
             # PhiMLP's forward
             "gemma", "granite", "cohere", "olmo", "glm4", "nemotron", "phi", "starcoder2",
             # FalconH1MLP's, Llama4TextMLP's, Lfm2MLP's forward
             "falcon_h1", "llama4_text", "lfm2")


@pytest.mark.parametrize("name", MLP_ARCHS)
def test_tiled_mlp_is_exact_per_architecture(name):
    """One process: the tiled MLP (3 tiles over 16 tokens, one of them uneven) gives HF's loss and gradients;
    every decoder layer's MLP (the MoE block as a whole) is tiled."""
    from arch_cases import build_arch, sample

    from ds_longctx.config import parse
    from ds_longctx.memory import tiling
    from tiny_models import patch

    batch = sample(16)
    ref = build_arch(name)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    model = build_arch(name)
    lc = parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"},
                                                              "tiled_mlp": {"enabled": True, "shards": 3}}})
    handle = patch(model, lc)
    calls = []
    real = tiling.TiledRowsFunction.apply
    tiling.TiledRowsFunction.apply = lambda *a: calls.append(a[3]) or real(*a)
    try:
        loss = model(**batch).loss
        loss.backward()
    finally:
        tiling.TiledRowsFunction.apply = real
        handle.remove()
    assert len(handle.memory.tiled_mlps if handle.memory else []) == 0  # removed
    assert calls == [3] * model.config.num_hidden_layers, calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert p.grad is not None and grads[n].grad.abs().max() > 0, n
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_phimoe_window_is_read_and_applied_through_its_mask():
    """PhiMoE (no layer_types) applies a set sliding_window through the mask it builds and passes no sliding_window to
    the attention function: every layer reads as windowed, the window transformers passes is None (the SP paths'
    agreement check expects that, not the window), and the window changes the one-process loss. (Its exactness
    under SP is the sweep's, bench/results/arch_sweep_sp2_*.json: PhiMoE's sparse mixer samples its routes in
    training, so a training step under SP cannot equal one process draw for draw, and tiled_mlp refuses it.)"""
    from arch_cases import arch_config, build_arch, sample
    from ds_longctx.models.windows import layer_attention

    facts = layer_attention(arch_config("phimoe"))
    assert [(f.window, f.kind, f.passed_window) for f in facts] == [(8, "sliding_attention", None)] * 2
    assert all(f.passed_window == f.window for f in layer_attention(arch_config("gemma3")))
    batch = sample(16)
    windowed = build_arch("phimoe")
    full = build_arch("phimoe")
    full.config.sliding_window = None
    assert abs(windowed(**batch).loss.item() - full(**batch).loss.item()) > 1e-4


@pytest.mark.parametrize("name,attr,what", [("mixtral", "router_jitter_noise", "jitter_noise=0.1"),
                                             ("starcoder2", "residual_dropout", "residual_dropout=0.1")])
def test_tiled_mlp_refuses_randomness_in_training(name, attr, what):
    """Mixtral's router jitter and Starcoder2's MLP residual dropout draw random numbers in training: a tile
    recomputed in backward would draw others. Refused with the fix while on; tiled in eval, and exact at 0
    (test_tiled_mlp_is_exact_per_architecture)."""
    from transformers import AutoModelForCausalLM

    from arch_cases import arch_config, sample
    from ds_longctx.config import parse
    from tiny_models import patch

    cfg = arch_config(name)
    setattr(cfg, attr, 0.1)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    lc = parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"},
                                                              "tiled_mlp": {"enabled": True, "shards": 2}}})
    handle = patch(model, lc)
    try:
        e = config_error(lambda: model(**sample(16)))
        model.eval()
        with torch.no_grad():
            assert model(**sample(16)).loss is not None  # no randomness in eval: tiled
    finally:
        handle.remove()
    assert e.startswith("long_context.tiled_mlp.enabled") and what in e, e


def test_pointwise_mlp_is_recognised_by_its_source_only():
    """An MLP with Llama's attributes is tiled only when its forward is LlamaMLP's code (or another reference
    form's) and its activation is one of transformers' elementwise ones; a model with any decoder-layer MLP
    tiled_mlp cannot tile is refused as a whole (naming it), not tiled in part."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from arch_cases import build_arch, sample
    from ds_longctx.config import parse
    from ds_longctx.models import pointwise_mlp_form
    from tiny_models import patch

    class ShiftedMLP(LlamaMLP):  # same attributes, but mixes neighbouring tokens: tiling would be wrong
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x.roll(1, dims=-2)))

    cfg = arch_config("llama")
    def form(m):
        f = pointwise_mlp_form(m)
        return f and f.reference

    assert form(LlamaMLP(cfg)) == "LlamaMLP" and form(build_arch("gemma").model.layers[0].mlp) == "LlamaMLP"
    assert form(build_arch("glm4").model.layers[0].mlp) == "Phi3MLP"
    assert form(build_arch("nemotron").model.layers[0].mlp) == "NemotronMLP"
    assert form(build_arch("phi").model.layers[0].mlp) == "PhiMLP"
    assert form(build_arch("starcoder2").model.layers[0].mlp) == "Starcoder2MLP"
    assert form(build_arch("falcon_h1").model.layers[0].feed_forward) == "FalconH1MLP"
    assert form(build_arch("llama4_text").model.layers[0].feed_forward) == "Llama4TextMLP"
    assert form(build_arch("lfm2").model.layers[0].feed_forward) == "Lfm2MLP"
    assert pointwise_mlp_form(ShiftedMLP(cfg)) is None
    softmax = LlamaMLP(cfg)
    softmax.act_fn = torch.nn.Softmax(dim=-1)  # not elementwise
    assert pointwise_mlp_form(softmax) is None
    from ds_longctx.memory.tiling import is_tileable_mlp

    patched = LlamaMLP(cfg)
    patched.forward = lambda x: x  # another library's instance forward: not the code the check read
    assert is_tileable_mlp(LlamaMLP(cfg)) and not is_tileable_mlp(patched)

    model = build_arch("llama")
    model.model.layers[1].mlp = ShiftedMLP(cfg)
    lc = parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"},
                                                              "tiled_mlp": {"enabled": True, "shards": 2}}})
    e = config_error(lambda: patch(model, lc))
    assert e.startswith("long_context.tiled_mlp.enabled") and "layer 1's mlp (ShiftedMLP)" in e, e
    assert "forward" not in model.model.layers[0].mlp.__dict__  # nothing left patched
    assert model(**sample(16)).loss is not None

