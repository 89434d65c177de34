"""Issue 37, item 5: every token-choice MoE block of transformers 5 runs under tiled_mlp, recognised by what it does
(models.moe: an experts module with transformers' experts contract or experts stacked in 3-D parameters, then a
probe of the block's own forward), and
SP training with the whole memory stack equals one process; capacity-limited, non-token-local and random blocks
are refused naming them."""
import pytest
import torch

from arch_cases import isclose, max_delta_error
from dist_utils import result_or_raise, runs_per_degree
from moe_cases import AUX, SEQ, batch, build_moe, reference, sp_step

# PhiMoE is not here: its sparse mixer samples experts in training (refused below, tiled in eval)
FAMILIES = ("glm4_moe", "deepseek_v3", "minimax_m2", "hunyuan_v1_moe", "ernie4_5_moe", "exaone_moe", "granitemoe",
            "qwen3_5_moe", "llama4_text", "mixtral", "qwen3_moe")
# under SP (mixtral and qwen3_moe are in test_arch_batches.py); deepseek_v3's multi-head latent attention under
# 'ulysses' and untied (issue 37, item 1: value heads padded to the query/key head dim for the all-to-all)
SP_FAMILIES = tuple(f for f in FAMILIES if f not in ("mixtral", "qwen3_moe"))


def _patched(model, shards=3):
    from ds_longctx.config import parse
    from tiny_models import patch

    lc = parse({"sequence_parallel_size": 1, "long_context": {"attention": {"implementation": "none"},
                                                              "tiled_mlp": {"enabled": True, "shards": shards}}})
    return patch(model, lc)


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_block_tiled_is_exact_one_process(name):
    """One process, training mode: 3 row tiles over 16 tokens give HF's loss and gradients; every decoder layer's
    MLP child is tiled (the MoE block as a whole, a first dense layer by its LlamaMLP source)."""
    from ds_longctx.memory import tiling

    b = batch("plain")
    ref = build_moe(name)
    ref_loss = ref(**b).loss
    ref_loss.backward()
    model = build_moe(name)
    handle = _patched(model)
    tiled = [type(m).__name__ for m in handle.memory.tiled_mlps]
    calls = []
    real = tiling.TiledRowsFunction.apply
    tiling.TiledRowsFunction.apply = lambda *a: calls.append(a[3]) or real(*a)
    try:
        loss = model(**b).loss
        loss.backward()
    finally:
        tiling.TiledRowsFunction.apply = real
        handle.remove()
    assert len(tiled) == model.config.num_hidden_layers and any("Mo" in t for t in tiled), tiled
    assert calls == [3] * model.config.num_hidden_layers, calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if grads[n].grad is None:  # e.g. a correction bias buffer-like parameter HF never differentiates
            assert p.grad is None, n
            continue
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def _switch_block(capacity):
    import transformers as tf
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

    torch.manual_seed(0)
    cfg = tf.SwitchTransformersConfig(d_model=32, d_ff=48, num_experts=4, expert_capacity=capacity,
                                      router_jitter_noise=0.0, dropout_rate=0.0)
    return SwitchTransformersSparseMLP(cfg)


def test_probe_refuses_a_capacity_limited_block_and_the_refusal_can_fail():
    """Switch Transformers' block drops tokens beyond an expert's capacity: the probe sees a token's row change
    when other rows overload its expert; with a capacity above the probe's rows it cannot see it, so a capacity
    attribute is refused by itself at install (below). The probe passes a token-choice block (can fail both ways)."""
    from ds_longctx.memory.tiling import _batched_class_forward_3d
    from ds_longctx.models.moe import capacity_limit, is_moe_candidate, token_locality_problem

    small = _switch_block(4)
    assert is_moe_candidate(small)
    problem = token_locality_problem(small, _batched_class_forward_3d, 32, torch.float32, "cpu")
    assert problem is not None and "depends on the other tokens" in problem
    assert token_locality_problem(_switch_block(64), _batched_class_forward_3d, 32, torch.float32, "cpu") is None
    assert capacity_limit(small) == "SwitchTransformersTop1Router.expert_capacity=4"
    mixtral = build_moe("mixtral").model.layers[0].mlp
    assert capacity_limit(mixtral) is None
    assert token_locality_problem(mixtral, _batched_class_forward_3d, 32, torch.float32, "cpu") is None


def test_llama4_block_is_a_candidate_by_its_stacked_experts_and_the_probe_decides():
    """Llama 4's block: its experts module takes only the routed rows (not transformers' experts contract), its experts
    stacked in 3-D parameters make it a candidate; it returns (out, router_logits) and the probe passes it (every token
    through every expert, scaled per token). A variant that subtracts the call's mean row is refused by the probe."""
    from ds_longctx.memory.tiling import _batched_class_forward_3d
    from ds_longctx.models.moe import (has_stacked_experts, is_experts_module, is_moe_candidate, returns_tuple,
                                       token_locality_problem)

    model = build_moe("llama4_text")
    dense, block = model.model.layers[0].feed_forward, model.model.layers[1].feed_forward
    assert type(block).__name__ == "Llama4TextMoe" and is_moe_candidate(block) and returns_tuple(block)
    assert has_stacked_experts(block.experts) and not any(is_experts_module(m) for m in block.modules())
    assert not is_moe_candidate(dense) and not returns_tuple(dense)
    assert token_locality_problem(block, _batched_class_forward_3d, 32, torch.float32, "cpu") is None

    class Centred(type(block)):
        def forward(self, hidden_states):
            out, logits = super().forward(hidden_states)
            return out - out.mean(0, keepdim=True), logits

    block.__class__ = Centred
    problem = token_locality_problem(block, _batched_class_forward_3d, 32, torch.float32, "cpu")
    assert problem is not None and "depends on the other tokens" in problem

    class Widened(type(block)):  # an output that is not the block's rows (twice the hidden size): named by the probe
        def forward(self, hidden_states):
            out, logits = super().forward(hidden_states)
            return torch.cat([out, out], dim=-1), logits

    block.__class__ = Widened
    problem = token_locality_problem(block, _batched_class_forward_3d, 32, torch.float32, "cpu")
    assert problem == "its forward returns (16, 64), not one tensor shaped like its input [1, 16, 32]", problem


def test_capacity_block_refused_at_install_naming_it():
    from ds_longctx.errors import ConfigError

    model = build_moe("mixtral")
    for layer in model.model.layers:
        layer.mlp = _switch_block(64)
    with pytest.raises(ConfigError) as e:
        _patched(model)
    msg = str(e.value)
    assert msg.startswith("long_context.tiled_mlp") and "SwitchTransformersSparseMLP" in msg, msg
    assert "SwitchTransformersTop1Router.expert_capacity=64" in msg and "tiled_mlp.enabled=false" in msg, msg


@pytest.mark.parametrize("name,block,overrides", [("minimax_m2", "MiniMaxM2SparseMoeBlock", {"router_jitter_noise": 0.1}),
                                                   ("phimoe", "PhimoeSparseMoeBlock", {})])
def test_probe_refuses_randomness_in_training_and_tiles_it_in_eval(name, block, overrides):
    """MiniMax-M2's router jitter and PhiMoE's sparse mixer (Gumbel sampling of experts and a random gradient
    estimator in training, even where its forward output happens not to change: the probe sees the generator move)
    draw random numbers in training: refused at the first tiled forward, naming the block, the generator left as it
    was; in eval tiled and exact."""
    from ds_longctx.errors import ConfigError

    b = batch("plain")
    model = build_moe(name, **overrides)
    handle = _patched(model)
    try:
        with pytest.raises(ConfigError) as e:
            model(**b)
        assert block in str(e.value) and "random numbers" in str(e.value), str(e.value)
        model.eval()
        with torch.no_grad():
            got = model(**b).loss
    finally:
        handle.remove()
    ref = build_moe(name, **overrides).eval()
    with torch.no_grad():
        torch.testing.assert_close(got, ref(**b).loss, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# SP, real engines (ZeRO-3, gloo): the whole memory stack with the MoE blocks tiled
# ---------------------------------------------------------------------------------------------

STACK = {"attention": {"implementation": "ulysses"},
         "activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 3}, "tiled_loss": {"enabled": True, "shards": 2},
         "rms_norm": {"enabled": True}}
UNTIED_STACK = dict(STACK, attention={"implementation": "untied_ulysses", "heads_per_chunk": 1,
                                      "fuse_projections": False})
# (family, batch kind, attention, router aux loss on) per SP degree: every family of SP_FAMILIES once, packed but
# one; the auxiliary loss (its sums over the SP group and through the tiles) on four
SP_CASES = {
    2: [(f, "packed", "ulysses", False) for f in ("glm4_moe", "hunyuan_v1_moe", "ernie4_5_moe", "exaone_moe",
                                                  "deepseek_v3")] +
       [("granitemoe", "packed", "ulysses", True), ("minimax_m2", "plain", "ulysses", True),
        ("qwen3_5_moe", "packed", "untied", True), ("deepseek_v3", "plain", "untied", False),
        ("llama4_text", "packed", "ulysses", False)],
    4: [("ernie4_5_moe", "packed", "ulysses", True), ("deepseek_v3", "packed", "untied", False)],
}
FOUR_KV = {"num_key_value_heads": 4}  # SP=4 splits 4 KV heads


def _overrides(aux, sp):
    return dict(AUX if aux else {}, **(FOUR_KV if sp == 4 else {}))


def _sp_worker(rank, world, cases):
    out = {}
    for name, kind, impl, aux in cases:
        lc = STACK if impl == "ulysses" else UNTIED_STACK
        out[name, kind, impl, aux] = sp_step(name, lc, batch(kind), world, **_overrides(aux, world))
    return out


@pytest.fixture(scope="module")
def sp_results():
    return runs_per_degree(_sp_worker, SP_CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", sorted(SP_CASES))
def test_moe_families_whole_stack_equal_one_process(sp, sp_results):
    """ZeRO-3, checkpointing with CPU offload, MoE blocks in 3 row tiles, tiled loss, RMSNorm; ulysses or untied:
    the loss and SGD deltas of one process (HF's packed path for packed samples), router auxiliary loss included."""
    results = result_or_raise(sp_results[sp])
    for name, kind, impl, aux in SP_CASES[sp]:
        ref_loss, ref_deltas, params = reference(name, batch(kind), **_overrides(aux, sp))
        if aux:  # the test can fail: the auxiliary loss moves the one-process loss
            assert abs(reference(name, batch(kind), **_overrides(False, sp))[0] - ref_loss) > 0.1
        for rank, r in enumerate(results):
            loss, deltas, tiled = r[name, kind, impl, aux]
            err, where = max_delta_error(ref_deltas, deltas, params)
            print(sp, rank, name, kind, impl, aux, ref_loss, loss, err, where, tiled)
            assert any("Mo" in t for t in tiled), tiled
            assert isclose(ref_loss, loss, 1e-5), (name, kind, impl, aux, ref_loss, loss)
            assert err < 1e-5, (name, kind, impl, aux, err, where)


@pytest.mark.parametrize("name", ["minimax_m2", "qwen3_5_moe"])
def test_router_aux_loss_one_process_through_tiles(name):
    """output_router_logits with a non-zero weight: ds_longctx's loss (HF's load-balancing sums taken per tile by the
    router tap, no router logits kept) equals HF's, gradients included; the aux loss moves the loss and the router's
    gradient (the test can fail), and HF's own recorder is off (no router logits kept)."""
    b = batch("plain")
    ref = build_moe(name, **AUX)
    ref_loss = ref(**b, use_cache=False).loss
    ref_loss.backward()
    plain = build_moe(name)
    plain(**b, use_cache=False).loss.backward()
    model = build_moe(name, **AUX)
    handle = _patched(model)
    try:
        assert any("router auxiliary loss" in s for s in handle.swapped), handle.swapped
        loss = model(**b).loss
        loss.backward()
    finally:
        handle.remove()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads, without = dict(ref.named_parameters()), dict(plain.named_parameters())
    router = [n for n in grads if "gate.weight" in n and "proj" not in n and "shared" not in n]
    assert router and all(not torch.allclose(grads[n].grad, without[n].grad) for n in router), router
    for n, p in model.named_parameters():
        if grads[n].grad is not None:
            torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("checkpointing", ["transformers", "ds_longctx"])
def test_router_aux_loss_under_checkpointing_without_tiles(checkpointing):
    """The router tap inside a checkpointed layer whose MLP is not tiled (HF's gradient checkpointing: TRL's default;
    or ours with tiled_mlp off): the recompute in backward saves what the forward saved (torch.utils.checkpoint
    counts them; before, backward stopped with a CheckpointError), and loss, aux_loss and gradients are HF's."""
    from ds_longctx.config import parse
    from tiny_models import patch

    b = batch("plain")
    ref = build_moe("minimax_m2", **AUX)
    ref.gradient_checkpointing_enable()
    ref_out = ref(**b, use_cache=False)
    ref_out.loss.backward()
    model = build_moe("minimax_m2", **AUX)
    lc = {"attention": {"implementation": "none"}}
    if checkpointing == "ds_longctx":
        lc["activation_checkpointing"] = {"enabled": True}
    else:
        model.gradient_checkpointing_enable()
    handle = patch(model, parse({"long_context": lc}))
    try:
        out = model(**b, use_cache=False)
        out.loss.backward()
    finally:
        handle.remove()
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, rtol=1e-6, atol=1e-6)  # carried, as HF's (TRL logs it)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if grads[n].grad is not None:
            torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("stack", [False, True])
def test_router_aux_loss_leaves_out_the_padding_shard_batch_drops(stack):
    """A right-padded sample through shard_batch (its attention_mask becomes an ignored tail document): the router
    auxiliary loss weights the padding out as HF does with the mask (shard_batch's doc_real_tokens); counting the
    padded rows (the batch without it) gives another loss, so the test can fail. ``stack``: MoE blocks in 3 row
    tiles inside checkpointed layers: the backward's tile recomputes weight their sums as the forward did."""
    from ds_longctx.data.batch import REAL_KEY
    from ds_longctx.config import parse
    from ds_longctx.data import shard_batch
    from tiny_models import patch

    b = batch("plain")
    mask = torch.ones_like(b["input_ids"])
    mask[:, -3:] = 0
    b["labels"][:, -3:] = -100  # no targets on the padding (shard_batch ignores them itself)
    ref = build_moe("minimax_m2", **AUX)
    ref_loss = ref(**b, attention_mask=mask, use_cache=False).loss
    ref_loss.backward()
    model = build_moe("minimax_m2", **AUX)
    lc = {"attention": {"implementation": "none"}}
    if stack:
        lc.update(activation_checkpointing={"enabled": True}, tiled_mlp={"enabled": True, "shards": 3})
    handle = patch(model, parse({"long_context": lc}))
    try:
        sharded = shard_batch(dict(b, attention_mask=mask), 0, 1)
        assert sharded[REAL_KEY].tolist() == [SEQ - 3]
        counted = model(**{k: v for k, v in sharded.items() if k != REAL_KEY}).loss.item()
        loss = model(**sharded).loss
        loss.backward()
    finally:
        handle.remove()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert abs(counted - ref_loss.item()) > 1e-4, (counted, ref_loss.item())
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if grads[n].grad is not None:
            torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_router_aux_loss_with_another_balancing_function_is_refused(monkeypatch):
    """A load-balancing function other than Mixtral's (the one reproduced per shard): ConfigError naming the key."""
    import transformers.models.granitemoe.modeling_granitemoe as gm

    from ds_longctx.errors import ConfigError

    def other(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return 0

    monkeypatch.setattr(gm, "load_balancing_loss_func", other)
    with pytest.raises(ConfigError) as e:
        _patched(build_moe("granitemoe", **AUX))
    assert str(e.value).startswith("model.config.output_router_logits") and "not Mixtral's" in str(e.value)


def test_mla_checks_ulysses_splits_untied_refused_and_the_sparse_indexer_named():
    """Multi-head latent attention passes the SP check under 'ulysses' and untied (exact at SP=2 and 4 in the spawn
    above; untied at the function level, its values zero-padded to the query/key head dim); the fused untied path
    refuses it (no fused DeepSeek attention); DeepSeek-V3.2's sparse indexer is refused by name."""
    import transformers as tf

    from ds_longctx.patching.checks import check_against
    from ds_longctx.config import parse
    from eco_cases import config_error
    from moe_cases import moe_config

    def check(impl, cfg):
        cfg._attn_implementation = "sdpa"
        lc = parse({"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": impl}}})
        return config_error(check_against, lc, cfg, 2)

    assert check("ulysses", moe_config("deepseek_v3")) is None
    assert check("untied_ulysses", moe_config("deepseek_v3")) is None
    cfg = moe_config("deepseek_v3")
    cfg._attn_implementation = "sdpa"
    lc = parse({"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "untied_ulysses",
                                                                            "fuse_projections": True}}})
    e = config_error(check_against, lc, cfg, 2)
    assert e is not None and "has no fused untied attention" in e, e
    v32 = tf.DeepseekV32Config(**{k: v for k, v in vars(moe_config("deepseek_v3")).items()
                                  if k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                           "num_hidden_layers", "vocab_size", "qk_rope_head_dim", "qk_nope_head_dim",
                                           "v_head_dim", "kv_lora_rank")})
    e = check("ulysses", v32)
    assert e is not None and "sparse attention indexer (index_topk=" in e, e
