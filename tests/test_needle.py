"""Needle in a haystack (ds_longctx/eval/needle.py): deterministic cases, scores from logits at the answer positions only
equal to the full-logits reference, and under SP=2 (ulysses and untied with the memory stack, ZeRO-3) and DP=2 equal
to one process. The tiny random model cannot retrieve: its exact match is 0 and its log-likelihood is at chance
(7 answer tokens of a 64-token vocabulary: about 7 ln 64 = 29 nats); a case whose answer is the model's own greedy
continuation scores exact match 1, so a scorer that always says 0 (or reads the wrong positions) fails."""
import json
import math

import pytest
import torch

from ds_longctx.errors import ConfigError
from ds_longctx.eval.needle import (ByteTokenizer, NeedleCase, build_cases, heatmap, parse_depths, parse_lengths,
                               score_cases, summarize, table, write_json)
from tiny_models import build, tiny_config

LENGTHS = [192, 256]
DEPTHS = [0.0, 0.5, 1.0]


def _model():
    return build(tiny_config(), seed=0).eval()


def _full_logits_reference(model, case):
    """The answer's log-likelihood and arg-maxes from the model's full [seq, vocab] logits (one process)."""
    with torch.no_grad():
        logp = model(input_ids=case.input_ids[None], use_cache=False).logits[0].double().log_softmax(-1)
    pos = torch.arange(case.answer_start - 1, case.length - 1)
    tgt = case.input_ids[pos + 1]
    return float(logp[pos].gather(-1, tgt[:, None]).sum()), logp[pos].argmax(-1).tolist()


def _greedy_case(model, case):
    """``case`` with its answer replaced by the model's own greedy continuation of the question."""
    ids = case.input_ids.clone()
    with torch.no_grad():
        for p in range(case.answer_start, case.length):
            ids[p] = model(input_ids=ids[None, :p], use_cache=False).logits[0, -1].argmax()
    return NeedleCase(length=case.length, depth=case.depth, sample=99, key="greedy", input_ids=ids,
                      answer_start=case.answer_start, needle_at=case.needle_at)


def _cases(model):
    cases = build_cases(ByteTokenizer(64), LENGTHS, DEPTHS, seed=0)
    return cases + [_greedy_case(model, cases[-2])]


def test_cases_are_deterministic_and_place_the_fact():
    tok = ByteTokenizer(256)
    a = build_cases(tok, [300, 1024], [0, 0.5, 1], seed=3, samples=2)
    b = build_cases(tok, [300, 1024], [0, 0.5, 1], seed=3, samples=2)
    assert len(a) == 12 and all(torch.equal(x.input_ids, y.input_ids) and x.key == y.key for x, y in zip(a, b))
    assert any(x.key != y.key for x, y in zip(a, build_cases(tok, [300, 1024], [0, 0.5, 1], seed=4, samples=2)))
    for c in a:
        text = tok.decode(c.input_ids.tolist())
        assert c.input_ids.numel() == c.length
        assert text.endswith(f"What is the secret passkey? The secret passkey is {c.key}.")
        assert tok.decode(c.input_ids[c.answer_start:].tolist()) == f" {c.key}."
        assert tok.decode(c.input_ids[c.needle_at:].tolist()).startswith(f" The secret passkey is {c.key}.")
        room = c.length - len(f" The secret passkey is {c.key}. Remember it. {c.key} is the secret passkey.") \
            - len(" What is the secret passkey? The secret passkey is") - c.answer_len
        assert c.needle_at == round(c.depth * room)
    text = "Once upon a time there was a long story. " * 3
    user = build_cases(tok, [400], [0.5], seed=0, haystack=text)[0]
    assert "Once upon a time" in tok.decode(user.input_ids.tolist())


def test_cases_with_a_bpe_tokenizer():
    """A byte-level BPE (Llama 3 / GPT-2 style, trained here on the built-in text): exact lengths, the answer's
    tokens decode to the passkey."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ds_longctx.eval.needle import FACT, FILLER, QUESTION

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = " ".join(FILLER) + " " + FACT.format(key="12345") + " " + QUESTION + " 67890."
    tok.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>")
    for c in build_cases(hf, [200, 333], [0, 0.3, 1], seed=1):
        assert c.input_ids.numel() == c.length and int(c.input_ids[0]) == hf.bos_token_id
        assert hf.decode(c.input_ids[c.answer_start:].tolist()).strip() == f"{c.key}."
        assert f"The secret passkey is {c.key}." in hf.decode(c.input_ids.tolist())


def test_flags_and_refusals():
    assert parse_lengths("1K,4k,1M,100") == [1024, 4096, 1024 ** 2, 100]
    assert parse_depths("0,0.25,1") == [0.0, 0.25, 1.0]
    for bad, fn in (("1Q", parse_lengths), ("0", parse_lengths), ("0,1.5", parse_depths), ("a", parse_depths)):
        with pytest.raises(ConfigError):
            fn(bad)
    with pytest.raises(ConfigError, match="cannot hold the fact"):
        build_cases(ByteTokenizer(64), [50], [0.5])
    with pytest.raises(ConfigError, match="not divisible by the sequence parallel degree 4"):
        build_cases(ByteTokenizer(64), [130], [0.5], sp=4)


def test_one_process_scores_equal_the_full_logits_and_the_report(tmp_path):
    model = _model()
    cases = _cases(model)
    results = score_cases(model, cases)
    for c, r in zip(cases, results):
        lp, top = _full_logits_reference(model, c)
        assert r["predicted_ids"] == top
        assert math.isclose(r["logprob"], lp, rel_tol=1e-6, abs_tol=1e-6), (r["logprob"], lp)
    # the untrained model cannot retrieve: exact match 0, log-likelihood at chance; its own greedy answer: 1
    assert not any(r["exact_match"] for r in results[:-1])
    assert all(abs(r["logprob"] / 7 + math.log(64)) < 0.5 for r in results[:-1])
    assert results[-1]["exact_match"] and results[-1]["token_accuracy"] == 1.0
    # the fact is read: moving it changes the answer's likelihood
    assert len({round(r["logprob"], 6) for r in results[:3]}) == 3
    report = summarize(cases, results, ByteTokenizer(64))
    text = table(report)
    assert "depth \\ length" in text and "192" in text and "256" in text
    write_json(report, tmp_path / "needle.json")
    back = json.loads((tmp_path / "needle.json").read_text())
    assert back["lengths"] == LENGTHS and len(back["results"]) == len(cases)
    pytest.importorskip("matplotlib")
    heatmap(report, str(tmp_path / "needle.png"))
    assert (tmp_path / "needle.png").read_bytes()[:4] == b"\x89PNG"


def _case(rank, world, cases, lc, sp):
    import ds_longctx
    from sp_cases import ds_config

    model = build(tiny_config(), seed=0)
    engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=ds_config(3, sp, lc))
    out = score_cases(engine, cases)
    assert engine.training  # put back
    engine.module._ds_longctx_patch.remove()
    return out


def _needle_ranks(rank, world, cases):
    from eco_cases import ProcessState

    state = ProcessState()
    # SP=1 first: DeepSpeed keeps the SP run's mpu for every later engine
    res = {"dp2": _case(rank, world, cases, {"attention": {"implementation": "none"}}, 1)}
    state.reset()
    res["sp2_untied_memory_stack"] = _case(rank, world, cases, {
        "attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": True},
        "tiled_mlp": {"enabled": True, "shards": 2}, "tiled_loss": {"enabled": True, "shards": 2},
        "activation_checkpointing": {"enabled": True}}, 2)
    state.reset()
    res["sp2_ulysses"] = _case(rank, world, cases, {"attention": {"implementation": "ulysses"}}, 2)
    return res


@pytest.mark.distributed
def test_needle_under_sp_and_dp_equals_one_process():
    from dist_utils import run_distributed

    model = _model()
    cases = _cases(model)
    ref = score_cases(model, cases)
    assert ref[-1]["exact_match"] and not any(r["exact_match"] for r in ref[:-1])
    results = run_distributed(_needle_ranks, 2, cases)
    for key in ("dp2", "sp2_untied_memory_stack", "sp2_ulysses"):
        for rank, by_run in enumerate(results):
            got = by_run[key]
            assert [g["predicted_ids"] for g in got] == [r["predicted_ids"] for r in ref], (key, rank)
            assert [g["exact_match"] for g in got] == [r["exact_match"] for r in ref], (key, rank)
            for g, r in zip(got, ref):
                assert math.isclose(g["logprob"], r["logprob"], rel_tol=1e-5, abs_tol=1e-5), (key, rank, g, r)


def test_command_one_process(tmp_path, capsys):
    """ds-longctx needle on a --model-config (random init: train.py's model), with a RoPE scaling and a user's
    haystack: the table, the JSON and the heatmap; bad flags exit 2 naming the flag."""
    from ds_longctx.cli import main
    from ds_longctx.config.shipped import default_model_config

    hay = tmp_path / "hay.txt"
    hay.write_text("A quiet lake under the pines. " * 20)
    argv = ["needle", "--model-config", default_model_config(), "--lengths", "192,256", "--depths", "0,1",
            "--haystack", str(hay), "--rope-scaling", "linear:2", "--json", str(tmp_path / "n.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "depth \\ length" in out and "192" in out
    report = json.loads((tmp_path / "n.json").read_text())
    assert len(report["results"]) == 4 and report["max_position_embeddings"] == 2 * 65536
    assert main(argv[:5] + ["--lengths", "1Q"]) == 2
    assert "--lengths" in capsys.readouterr().err
    assert main(argv[:3] + ["--checkpoint", str(tmp_path)]) == 2  # no checkpoint there
    assert "ds-longctx needle: --checkpoint" in capsys.readouterr().err
