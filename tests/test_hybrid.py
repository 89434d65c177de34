"""Issue 36: hybrid models under SP. Gated DeltaNet layers (Qwen3.5, Qwen3-Next, OLMo-Hybrid), Mamba2 mixers
(Falcon-H1, Granite-4 hybrid, Bamba, Nemotron-H), MiniMax's lightning attention (also with a sliding window on its
attention layer), Kimi Delta Attention (Kimi-Linear, with its MLA layers under 'ulysses') and LFM2's
gated short convolutions split by heads (attention/mixers.py) train exactly like one process: per-step loss and
SGD(lr=1) parameter deltas, ZeRO-3 through ds_longctx.initialize, at SP=2 and SP=4, plain and packed samples
(documents crossing the shard edges, each document restarting the conv and the recurrence), under 'ulysses' and
'untied_ulysses'; the MoE hybrids (qwen3_5_moe, qwen3_next, lfm2_moe, granitemoehybrid) under the whole memory stack
(offloaded checkpointing, tiled MLP over their MoE blocks, tiled loss); through the HF Trainer + enable() at SP=2
(every family but minimax_window; the second sample packed; the MoE hybrids with their MoE blocks tiled) and TRL
with packing. Heads that SP does not divide, and layer types it does not run, are one clear ConfigError."""
import math

import pytest
import torch

from dist_utils import result_or_raise, run_distributed_side_by_side
from eco_cases import config_error

SEQ, VOCAB = 16, 64
WINDOW = 3  # minimax_window's sliding window (tokens)
# row 0: boundaries at 5 and 12 (inside shards: at SP=2 the 7-token document crosses the edge at 8, at SP=4 the
# edges 8 and 12), row 1: a boundary exactly on the SP=2 edge, a one-token document
DOC_LENS = [[5, 7, 4], [8, 7, 1]]
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "lfm2", "lfm2_moe", "falcon_h1",
            "granitemoehybrid", "kimi_linear", "minimax", "minimax_window", "bamba", "nemotron_h")
UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
ULYSSES = {"attention": {"implementation": "ulysses"}}
# the memory stack under untied: offloaded checkpointing (documents reach the recompute), tiled MLP (the MoE
# blocks of qwen3_5_moe, qwen3_next, lfm2_moe and granitemoehybrid as a whole, in row tiles: models/moe.py), tiled loss
STACK = {"activation_checkpointing": {"enabled": True, "offload": "cpu", "pin_memory": False},
         "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2}}


def hybrid_config(name: str, key_heads: int = 4, value_heads: int = 8):
    """One Gated DeltaNet layer and one full-attention layer (value heads grouped 2 per key head)."""
    import transformers as tf

    kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
              intermediate_size=48, max_position_embeddings=256, tie_word_embeddings=False,
              layer_types=["linear_attention", "full_attention"], linear_num_key_heads=key_heads,
              linear_num_value_heads=value_heads, linear_key_head_dim=4, linear_value_head_dim=4,
              linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "qwen3_5":
        return tf.Qwen3_5TextConfig(**kw, head_dim=8)
    if name == "qwen3_5_moe":  # Gated DeltaNet and full attention, both with the MoE block (a shared expert)
        return tf.Qwen3_5MoeTextConfig(**kw, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=24, shared_expert_intermediate_size=24)
    if name == "qwen3_next":
        return tf.Qwen3NextConfig(**kw, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                  shared_expert_intermediate_size=24)
    if name == "olmo_hybrid":
        return tf.OlmoHybridConfig(**kw)
    if name == "nemotron_h":  # a Mamba2 layer (8 heads, 8 B/C groups: whole groups on every rank), attention
        # (no rope), an MLP layer; its own names for the Mamba2 sizes
        kw = {k: v for k, v in kw.items() if not k.startswith("linear_") and k not in ("layer_types",
                                                                                      "num_hidden_layers")}
        return tf.NemotronHConfig(**kw, head_dim=8, layers_block_type=["linear_attention", "full_attention", "mlp"],
                                  mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=8, conv_kernel=4,
                                  chunk_size=4, use_conv_bias=True, initializer_range=0.2)
    if name in ("falcon_h1", "granitemoehybrid", "bamba"):  # Mamba2 mixers: 8 heads of 8 channels, a 4-token scan chunk
        # (documents and shards cross chunks); falcon_h1: one B/C group (every rank gets it), every layer attention
        # and Mamba2 side by side; granite: 4 groups of 2 heads (two per rank at SP=2, one at SP=4), MoE
        kw = {k: v for k, v in kw.items() if not k.startswith("linear_") and k != "layer_types"}
        mamba = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                     mamba_chunk_size=4, mamba_conv_bias=True, initializer_range=0.2)
        if name == "bamba":  # granite's mixer, 2 B/C groups (one per rank at SP=2, one per two ranks at SP=4)
            return tf.BambaConfig(**kw, **mamba, mamba_n_groups=2, attn_layer_indices=[1])
        if name == "falcon_h1":
            return tf.FalconH1Config(**kw, **mamba, head_dim=8, mamba_d_ssm=64, mamba_n_groups=1,
                                     mamba_rms_norm=True, mamba_norm_before_gate=False, ssm_in_multiplier=1.5,
                                     ssm_multipliers=[1.0, 0.5, 2.0, 1.0, 1.5])
        return tf.GraniteMoeHybridConfig(**kw, **mamba, mamba_n_groups=4, num_local_experts=4,
                                         num_experts_per_tok=2, shared_intermediate_size=48,
                                         layer_types=["linear_attention", "full_attention"])
    if name == "kimi_linear":  # Kimi Delta Attention (4 heads of 4) and an MLA layer (NoPE), MoE MLPs
        kw = {k: v for k, v in kw.items() if not k.startswith("linear_")}
        return tf.KimiLinearConfig(**dict(kw, num_key_value_heads=4), linear_attn_config={
            "num_heads": 4, "head_dim": 4, "short_conv_kernel_size": 4}, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            initializer_range=0.2)
    if name == "minimax":  # lightning attention (4 heads, 4-token blocks: documents and shards cross them), MoE
        kw = {k: v for k, v in kw.items() if not k.startswith("linear_")}
        return tf.MiniMaxConfig(**kw, head_dim=8, block_size=4, num_local_experts=4, num_experts_per_tok=2,
                                output_router_logits=False, initializer_range=0.2)
    if name == "minimax_window":  # minimax with a 3-token sliding window on its full-attention layer (transformers
        # applies config.sliding_window there: models/windows.py); the window cuts every document here
        cfg = hybrid_config("minimax", key_heads, value_heads)
        cfg.sliding_window = WINDOW
        return cfg
    if name == "lfm2_moe":  # lfm2's layers, every MLP the MoE block (no first dense layers)
        kw = {k: v for k, v in kw.items() if not k.startswith("linear_")}
        return tf.Lfm2MoeConfig(**dict(kw, layer_types=["conv", "full_attention"]), conv_bias=True, conv_L_cache=3,
                                initializer_range=0.5, num_dense_layers=0, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=24)
    if name == "lfm2":  # a gated short conv (channels are heads) and full attention; a larger init, so that the
        # conv's cubic product B * conv(x) * C changes the loss visibly (test_references_see_documents...)
        kw = {k: v for k, v in kw.items() if not k.startswith("linear_")}
        return tf.Lfm2Config(**dict(kw, layer_types=["conv", "full_attention"]), conv_bias=True, conv_L_cache=3,
                             initializer_range=0.5)
    raise KeyError(name)


def build_hybrid(name: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hybrid_config(name, **kw), dtype=torch.float32, attn_implementation="sdpa")


def _positions(rows):
    return torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])


def batch(packed: bool):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (len(DOC_LENS), SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = labels[1, 9] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:
        out["position_ids"] = _positions(DOC_LENS)
    return out


def reference(name: str, b: dict, doc_lens=None):
    """One process, no DeepSpeed, unpatched HF: loss and SGD(lr=1) deltas. ``doc_lens``: every document runs
    alone (what a packed sample means: transformers' torch reference of the gated delta rule ignores cu_seqlens),
    the loss the token mean of the packed sample's shifted targets (the same targets ds_longctx trains)."""
    model = build_hybrid(name)
    if doc_lens is None:
        loss = model(**b, use_cache=False).loss
    else:
        rows = []
        for i, lens in enumerate(doc_lens):
            a, parts = 0, []
            for n in lens:
                parts.append(model(input_ids=b["input_ids"][i:i + 1, a:a + n], use_cache=False).logits)
                a += n
            rows.append(torch.cat(parts, dim=1))
        logits = torch.cat(rows)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1),
                                                 ignore_index=-100)
    loss.backward()
    return loss.item(), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, cases):
    import ds_longctx
    from ds_longctx.dist.comm import sp_group, sp_rank
    from ds_longctx.data import shard_batch
    from sp_cases import ds_config, full_params

    out = {}
    if world == 2:  # first (Accelerate builds the SP groups itself): the HF Trainer route, enable() +
        # ParallelismConfig, past Accelerate's recurrent-layer refusal
        import hf_trainer
        from eco_cases import ProcessState  # (puts examples/ on sys.path)

        from test_trainer_families import _data as packed_tokens  # the second sample packed (5, 7, 4 tokens)

        from ds_longctx.memory import tiling

        state, tokens, real = ProcessState(), hf_trainer.RandomTokens, tiling.TiledRowsFunction.apply
        hf_trainer.RandomTokens = packed_tokens
        for name, run in TRAINER_RUNS.items():  # the example's trainer, these models
            hf_trainer.tiny_model = lambda seed=0, name=name: build_hybrid(name, seed)
            tiles = []  # (block class, tiles) of every tiled MLP call
            tiling.TiledRowsFunction.apply = lambda *a: tiles.append((type(a[2]).__name__, a[3])) or real(*a)
            try:
                out["trainer", name] = hf_trainer.train(
                    sp=2, record_params=True, steps=TRAINER_STEPS, seq_len=SEQ, samples=2, sample_order=[0, 1],
                    lr=TRAINER_LR, output_dir=f"/tmp/ds_longctx_test_hybrid_trainer{rank}", **run)
            finally:
                tiling.TiledRowsFunction.apply = real
            out["trainer", name]["tiles"] = sorted(set(tiles))
            state.reset()  # the next run starts as in a fresh process (Accelerate's SP groups and attention gone)
        hf_trainer.RandomTokens = tokens
        import trl_sft

        for name in TRL_FAMILIES:  # TRL SFTTrainer, packed padding-free rows through ds_longctx's SP loader
            trl_sft.tiny_model = lambda seed=0, name=name: build_hybrid(name, seed)
            out["trl", name] = trl_sft.train(sp=2, record_params=True, output_dir=f"/tmp/ds_longctx_test_hybrid_trl{rank}",
                                             **TRL_RUN)
            state.reset()
    from ds_longctx.memory import get_memory_handle, tiling

    real_tiles = tiling.TiledRowsFunction.apply
    for name, impl, packed in cases:
        lc = {"ulysses": ULYSSES, "untied": UNTIED, "untied+stack": {**UNTIED, **STACK}}[impl]
        model = build_hybrid(name)
        engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           config=ds_config(3, world, lc))
        assert engine.module._ds_longctx_patch.mixers is not None
        before = full_params(engine.module)
        tiles = []  # (block class, tiles) of every tiled MLP call: forward, and its recompute under checkpointing
        tiling.TiledRowsFunction.apply = lambda *a: tiles.append((type(a[2]).__name__, a[3])) or real_tiles(*a)
        try:
            loss = engine(**shard_batch(batch(packed), sp_rank(sp_group()), world)).loss
            engine.backward(loss)
        finally:
            tiling.TiledRowsFunction.apply = real_tiles
        engine.step()
        after = full_params(engine.module)
        memory = get_memory_handle(engine)  # None without the memory stack
        tiled = sorted({type(m).__name__ for m in (memory.tiled_mlps if memory is not None else [])})
        engine.module._ds_longctx_patch.remove()
        out[name, impl, packed] = (loss.item(), {n: after[n] - before[n] for n in after}, tiled, sorted(set(tiles)))
    return out


SP_CASES = {  # one spawn per degree, side by side: every family under both paths, plain and packed
    2: [("qwen3_5", "ulysses", False), ("qwen3_5", "ulysses", True), ("qwen3_5", "untied+stack", True),
        ("qwen3_5_moe", "untied+stack", False), ("qwen3_5_moe", "untied+stack", True),
        ("qwen3_next", "untied+stack", True), ("olmo_hybrid", "ulysses", True), ("lfm2", "ulysses", True),
        ("lfm2_moe", "untied+stack", True), ("falcon_h1", "ulysses", True), ("granitemoehybrid", "untied+stack", True),
        ("granitemoehybrid", "ulysses", False), ("kimi_linear", "ulysses", True), ("kimi_linear", "untied", True),
        ("minimax", "ulysses", True), ("minimax_window", "ulysses", False), ("minimax_window", "ulysses", True),
        ("minimax_window", "untied", False), ("minimax_window", "untied", True), ("bamba", "untied+stack", True),
        ("bamba", "ulysses", False), ("nemotron_h", "ulysses", True), ("nemotron_h", "untied", False)],
    4: [("qwen3_next", "ulysses", False), ("olmo_hybrid", "untied", True), ("lfm2", "untied", False),
        ("falcon_h1", "untied", True), ("granitemoehybrid", "ulysses", True), ("falcon_h1", "ulysses", False),
        ("kimi_linear", "ulysses", False), ("minimax", "untied", True), ("minimax", "ulysses", False),
        ("qwen3_5_moe", "ulysses", True), ("lfm2_moe", "untied", False), ("bamba", "ulysses", True),
        ("bamba", "untied", False), ("nemotron_h", "untied", True), ("nemotron_h", "ulysses", False)],
}  # kimi_linear under untied: its MLA layers at the attention-function level
# under the memory stack, the MLPs tiled (2 row tiles of the shard's 16 rows in every forward and recompute): the
# MoE blocks as a whole (models/moe.py), granite's shared MLP beside its MoE block by its forward (models/_common.py)
TILED = {"qwen3_5": ["Qwen3_5MLP"], "qwen3_5_moe": ["Qwen3_5MoeSparseMoeBlock"],
         "qwen3_next": ["Qwen3NextSparseMoeBlock"], "lfm2_moe": ["Lfm2MoeSparseMoeBlock"],
         "granitemoehybrid": ["GraniteMoeHybridMLP", "GraniteMoeHybridMoE"], "bamba": ["BambaMLP"]}


# TRL SFTTrainer with packing (padding-free rows of the 5/10/16-token samples, at most 16 tokens: documents cross
# the SP=2 shard edge), 2 steps of SGD, at SP=2 (ulysses) against TRL's one-process run
TRL_FAMILIES = ("qwen3_5", "falcon_h1", "lfm2", "kimi_linear", "minimax")
# minimax: TRL turns its router auxiliary loss on (the model's coefficient); the 15-token row is padded to 16 by the
# SP loader with an ignored document, which the load-balancing sums must not count (shard_batch's doc_real_tokens:
# without it the router weight's delta was off by 1.3e-4 relative, the losses equal)
TRL_RUN = dict(steps=2, seq_len=SEQ, samples=8, lr=0.05)


def per_document(model):
    """``model`` whose decoder runs every document of a packed row (position_ids restarting at 0) alone and
    concatenates the hidden states: what a packed row means, in HF's own code (transformers' torch references of
    these layers carry the state across documents). lm_head and the loss stay HF's."""
    decoder = model.model
    real = decoder.forward

    def forward(input_ids=None, position_ids=None, **kwargs):
        starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [input_ids.shape[1]]
        assert position_ids.shape[0] == 1 and starts[0] == 0, position_ids
        model.documents.append(tuple(b - a for a, b in zip(starts, starts[1:])))
        outs = [real(input_ids=input_ids[:, a:b], position_ids=position_ids[:, a:b], use_cache=False,
                     **{k: v for k, v in kwargs.items() if k == "output_router_logits"})
                for a, b in zip(starts, starts[1:]) if b > a]
        outs[0].last_hidden_state = torch.cat([o.last_hidden_state for o in outs], dim=1)
        if getattr(outs[0], "router_logits", None) is not None:  # MoE (TRL asks for the router auxiliary loss):
            # every document's router logits, as the whole row's [tokens, experts] per layer
            outs[0].router_logits = tuple(torch.cat(layer, dim=0) for layer in zip(*[o.router_logits for o in outs]))
        return outs[0]

    decoder.forward, model.documents = forward, []  # documents: the lengths, per forward
    return model


def _trl_reference(rank, world):
    """One process, no ds_longctx: TRL's run of every TRL family, its documents alone (per_document)."""
    import trl_sft
    from eco_cases import ProcessState

    state, out = ProcessState(), {}
    for name in TRL_FAMILIES:
        models = []
        trl_sft.tiny_model = lambda seed=0, name=name: models.append(per_document(build_hybrid(name, seed))) or \
            models[-1]
        out[name] = trl_sft.train(sp=1, use_ds_longctx=False, record_params=True,
                                  output_dir="/tmp/ds_longctx_test_hybrid_trl_ref", **TRL_RUN)
        out[name]["documents"] = models[0].documents
        state.reset()
    return out


@pytest.fixture(scope="module")
def sp_results():
    sps = sorted(SP_CASES)
    runs = run_distributed_side_by_side(*[(_worker, sp, SP_CASES[sp]) for sp in sps], (_trl_reference, 1),
                                        return_exceptions=True)
    return dict(zip(sps + ["trl_reference"], runs))


@pytest.fixture(scope="module")
def references():
    return {(n, packed): reference(n, batch(packed), DOC_LENS if packed else None)
            for n in FAMILIES for packed in (False, True)}


@pytest.mark.distributed
@pytest.mark.parametrize("sp", sorted(SP_CASES))
def test_gated_deltanet_sp_equals_one_process(sp, sp_results, references):
    results = result_or_raise(sp_results[sp])
    for case in SP_CASES[sp]:
        name, _, packed = case
        ref_loss, ref_deltas = references[name, packed]
        assert min(float(d.abs().max()) for d in ref_deltas.values()) > 0  # every parameter moves: the test can fail
        for rank_out in results:
            loss, deltas, tiled, tiles = rank_out[case]
            want = TILED[name] if "stack" in case[1] else []
            assert tiled == want and tiles == [(t, 2) for t in want], (case, tiled, tiles)
            assert math.isclose(loss, ref_loss, rel_tol=1e-6), (case, loss, ref_loss)
            for n, ref in ref_deltas.items():
                torch.testing.assert_close(deltas[n], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {n}: {m}")


def test_references_see_documents_and_whole_sequence(references):
    """The references can fail the SP runs: documents change the one-process result (a recurrence that crossed a
    document start would differ), and so does a recurrence restarted at a shard edge (what the layer computed on
    each rank's shard alone, before this split)."""
    for name in FAMILIES:
        packed, plain = references[name, True], references[name, False]
        cut = reference(name, batch(True), [[5, 3, 4, 4], [8, 7, 1]])  # row 0 also restarted at the SP=2 edge 8
        assert abs(packed[0] - plain[0]) > 1e-4 and abs(packed[0] - cut[0]) > 1e-5, (name, packed[0], plain[0], cut[0])
    for p in (False, True):  # minimax's sliding window on its attention layer changes the one-process result
        assert abs(references["minimax_window", p][0] - references["minimax", p][0]) > 1e-3, p


TRAINER_STEPS, TRAINER_LR = 2, 0.05
# the HF Trainer + enable() at SP=2 (the first sample plain, the second packed: documents of 5, 7, 4 tokens, the 7
# crossing the shard edge; tests/test_trainer_families._data): per family the example's path (default: untied with
# the memory stack, the MoE blocks of qwen3_5_moe, qwen3_next, lfm2_moe and granitemoehybrid tiled; the MLPs of
# falcon_h1 and lfm2, and kimi_linear's MoE, are not tiled: their stack is off)
TRAINER_RUNS = {"qwen3_5": {}, "falcon_h1": dict(memory_stack=False), "minimax": {},
                "lfm2": dict(attention="ulysses", memory_stack=False),
                "kimi_linear": dict(attention="ulysses", memory_stack=False),
                "qwen3_5_moe": {}, "qwen3_next": {}, "lfm2_moe": {}, "granitemoehybrid": {}, "bamba": {},
                "olmo_hybrid": dict(attention="ulysses", memory_stack=False),
                "nemotron_h": dict(attention="ulysses", memory_stack=False)}


def trainer_reference(name="qwen3_5"):
    """One process, no Trainer: SGD(lr) on the example's samples in order (the Trainer's steps at SP=1), each
    document of the packed sample alone (per_document)."""
    from test_trainer_families import _data

    model = per_document(build_hybrid(name))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data, losses = _data(2, SEQ, VOCAB, seed=0), []
    for i in range(TRAINER_STEPS):
        sample = {k: v[None] for k, v in data[i].items()}
        sample.setdefault("position_ids", torch.arange(SEQ)[None])  # (the plain sample: one document)
        loss = model(**sample, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= TRAINER_LR * p.grad
                p.grad = None
    assert model.documents == [(SEQ,), (5, 7, 4)], model.documents  # the second sample's documents run alone
    return losses, {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_hf_trainer_with_enable_trains_hybrids_at_sp2(name, sp_results):
    losses, deltas = trainer_reference(name)
    assert min(float(d.abs().max()) for d in deltas.values()) > 0, name  # every parameter moves
    for rank_out in result_or_raise(sp_results[2]):
        got = rank_out["trainer", name]
        assert len(got["losses"]) == TRAINER_STEPS
        if TRAINER_RUNS[name].get("memory_stack", True) and name in TILED:  # the MoE blocks tiled, 2 row tiles
            assert got["tiles"] == [(t, 2) for t in TILED[name]], (name, got["tiles"])
        for a, b in zip(got["losses"], losses):
            assert math.isclose(a, b, rel_tol=1e-5), (got["losses"], losses)
        for n, ref in deltas.items():
            torch.testing.assert_close(got["after"][n] - got["before"][n], ref, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{n}: {m}")


def test_accelerate_refusal_stays_for_what_ds_longctx_does_not_run():
    """enable() lets Accelerate's recurrent-layer check pass a model only under a long_context config and only
    for layer types ds_longctx splits; everything else keeps Accelerate's refusal; disable() restores it."""
    import types

    import accelerate.accelerator as acc

    import ds_longctx
    from ds_longctx.hf import integration

    original = acc._refuse_recurrent_layers_under_sequence_parallelism
    qwen = types.SimpleNamespace(config=hybrid_config("qwen3_5"))
    other = types.SimpleNamespace(config=types.SimpleNamespace(model_type="some_linear_lm",
                                                               layer_types=["linear_attention", "full_attention"]))
    ds_longctx.enable()
    try:
        gate = acc._refuse_recurrent_layers_under_sequence_parallelism
        integration._in_accelerate.accelerator = types.SimpleNamespace(deepspeed_config={"long_context": {}})
        assert gate(qwen) is None
        with pytest.raises(ValueError, match="linear_attention"):
            gate(other)
        integration._in_accelerate.accelerator = types.SimpleNamespace(deepspeed_config={})  # DeepSpeed's own SP
        with pytest.raises(ValueError, match="linear_attention"):
            gate(qwen)
    finally:
        integration._in_accelerate.accelerator = None
        ds_longctx.disable()
    assert acc._refuse_recurrent_layers_under_sequence_parallelism is original


@pytest.mark.parametrize("impl", ["none", "untied_ulysses"])
def test_sp1_packed_restarts_every_document(impl):
    """One process through patch_model (transformers' own attention, or ours): a packed sample trains as its
    documents alone (transformers' torch reference of these layers alone would carry the state across them)."""
    from ds_longctx.config import parse
    from tiny_models import patch

    lc = parse({"long_context": {"attention": {"implementation": impl}}})
    # granitemoehybrid only under untied: at 'none' its attention (no rope; its causal mask is built without
    # position_ids) does not see the documents through HF's packed path (the mixer alone is exact there too)
    # kimi_linear only at 'none' (at SP 1 untied adds nothing to its MLA layers the SP spawns do not cover)
    for name in ("qwen3_5", "lfm2", "falcon_h1", "minimax") + \
            (("granitemoehybrid",) if impl != "none" else ("kimi_linear",)):
        ref_loss, ref_deltas = reference(name, batch(True), DOC_LENS)
        model = build_hybrid(name)
        assert patch(model, lc).mixers is not None
        loss = model(**batch(True)).loss
        loss.backward()
        assert math.isclose(loss.item(), ref_loss, rel_tol=1e-6), (name, loss.item(), ref_loss)
        for n, p in model.named_parameters():
            torch.testing.assert_close(-p.grad, ref_deltas[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def _check(name, impl, sp, **kw):
    from ds_longctx.patching.checks import check_against
    from ds_longctx.config import parse

    lc = parse({"sequence_parallel_size": sp, "long_context": {"attention": {"implementation": impl}}})
    check_against(lc, hybrid_config(name, **kw), world_size=sp)


def test_untied_head_chunks_keep_key_head_groups():
    from ds_longctx.attention.mixers import _head_chunks, _mamba2_chunks

    assert _head_chunks(4, 2, None) == [(0, 4)]
    assert _head_chunks(4, 2, 1) == [(0, 2), (2, 2)]  # at least one key head's group of value heads
    assert _head_chunks(6, 2, 4) == [(0, 4), (4, 2)]
    assert _head_chunks(4, 1, 3) == [(0, 3), (3, 1)]
    assert _mamba2_chunks(4, 2, None) == [(0, 4)]
    assert _mamba2_chunks(4, 4, 1) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # inside the one B/C group
    assert _mamba2_chunks(8, 2, 3) == [(0, 2), (2, 2), (4, 2), (6, 2)]  # whole groups
    assert _mamba2_chunks(8, 4, 3) == [(0, 2), (2, 2), (4, 2), (6, 2)]  # a divisor of the group's heads


def test_heads_sp_does_not_divide_are_refused():
    """Gated DeltaNet splits whole key heads, or each rank's value channels inside one key head (SP a multiple of
    the key heads, past the value heads a slice of one: issue 47); what neither runs is one error naming the counts
    and the degrees that work."""
    for impl in ("ulysses", "untied_ulysses"):
        _check("qwen3_5", impl, 2, key_heads=2, value_heads=4)  # both divide
        _check("qwen3_5", impl, 4, key_heads=2, value_heads=4)  # a key head on two ranks, a value head each
        _check("qwen3_5", impl, 8, key_heads=2, value_heads=4)  # half a value head each
        e = config_error(_check, "qwen3_5", impl, 6, key_heads=4, value_heads=8)
        assert e.startswith("sequence_parallel_size: the qwen3_5_text model's linear_attention layers "
                            "(Qwen3_5GatedDeltaNet) have 4 key heads and 8 value heads; sequence_parallel_size 6 must "
                            "divide them or be a multiple of them"), e
        assert "use a sequence_parallel_size of 1, 2, 4, 8, 16, 24, 32" in e, e


def test_mamba2_heads_and_groups_sp_does_not_fit_are_refused():
    """Mamba2: SP divides the heads and divides the B/C groups or is a multiple of them; else one error naming both
    counts and the degrees that work."""
    from ds_longctx.patching.checks import check_against
    from ds_longctx.config import parse

    def check(sp, heads, groups):
        cfg = hybrid_config("granitemoehybrid")
        cfg.mamba_n_heads, cfg.mamba_n_groups = heads, groups
        lc = parse({"sequence_parallel_size": sp, "long_context": {"attention": {"implementation": "ulysses"}}})
        check_against(lc, cfg, world_size=sp)

    check(4, 8, 2)  # one group per two ranks
    check(2, 8, 2)  # a group per rank
    check(2, 8, 1)  # the one group on every rank
    check(4, 8, 8)  # two groups per rank
    e = config_error(check, 4, 12, 6)  # the heads divide, the groups neither divide nor are divided
    assert e.startswith("sequence_parallel_size: the granitemoehybrid model's linear_attention layers "
                        "(GraniteMoeHybridMambaLayer) have 12 heads in 6 B/C groups"), e
    assert "use a sequence_parallel_size of 1, 2, 3, 6, 12" in e, e
    e = config_error(check, 4, 6, 2)  # the heads do not divide
    assert "have 6 heads in 2 B/C groups" in e and "use a sequence_parallel_size of 1, 2, 6" in e, e  # not 3 (2 groups)
    cfg = hybrid_config("nemotron_h")  # its own config names (mamba_num_heads, n_groups)
    cfg.mamba_num_heads, cfg.n_groups = 12, 6
    lc = parse({"sequence_parallel_size": 4, "long_context": {"attention": {"implementation": "untied_ulysses"}}})
    e = config_error(check_against, lc, cfg, world_size=4)
    assert "nemotron_h model's linear_attention layers (NemotronHMamba2Mixer) have 12 heads in 6 B/C groups" in e, e
    assert "use a sequence_parallel_size of 1, 2, 3, 6, 12" in e, e


def test_kimi_linear_runs_under_both_paths_and_fused_is_refused():
    """Kimi Delta Attention runs split by heads under both paths; kimi_linear's MLA layers run under 'ulysses' and at
    untied's attention-function level (exact: SP_CASES); fuse_projections true is one clear error naming the key."""
    from ds_longctx.patching.checks import check_against
    from ds_longctx.config import parse

    _check("kimi_linear", "ulysses", 4)
    _check("kimi_linear", "untied_ulysses", 2)
    lc = parse({"sequence_parallel_size": 2, "long_context": {"attention": {"implementation": "untied_ulysses",
                                                                           "fuse_projections": True}}})
    e = config_error(check_against, lc, hybrid_config("kimi_linear"), world_size=2)
    assert e.startswith("long_context.attention.fuse_projections: architecture 'kimi_linear' has no fused"), e

@pytest.mark.distributed
def test_trl_sft_packed_trains_hybrid_families_at_sp2(sp_results):
    """TRL SFTTrainer + enable() with packing at SP=2 trains like TRL's one-process run with each document alone:
    per-step losses and parameter deltas, for each family of TRL_FAMILIES (one spawn)."""
    from eco_cases import delta_errors, deltas

    refs = result_or_raise(sp_results["trl_reference"])[0]
    failures = []
    for name in TRL_FAMILIES:
        ref = refs[name]
        assert len(ref["losses"]) == TRL_RUN["steps"] and all(d.abs().max() > 0 for d in deltas(ref).values()), name
        assert ref["documents"][0] == (10, 5), ref["documents"]  # step 1's row: two documents, the first crossing 8
        for rank_out in result_or_raise(sp_results[2]):
            got = rank_out["trl", name]
            assert got["inputs"] != [] and len(got["losses"]) == len(ref["losses"]), (name, got["losses"])
            if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got["losses"], ref["losses"])):
                failures.append((name, got["losses"], ref["losses"]))
            errs, _ = delta_errors(ref, got)
            worst = max(errs, key=errs.get)
            if errs[worst] > 1e-5:
                failures.append((name, worst, errs[worst]))
    assert not failures, failures
