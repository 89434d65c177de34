"""RULER's synthetic tasks (ds_longctx/eval/ruler.py, ds-longctx ruler): deterministic cases of exactly the asked
length whose answer tokens decode to the task's answer, in RULER's English templates (a byte tokenizer and a
byte-level BPE) and in the kv style (a word-level tokenizer; its haystack follows its rule wherever the task placed
no word); the refusals; and under SP=2 (ulysses; ZeRO-3) every task's per-case scores equal one process's, with a
case per task whose answer is the model's own greedy continuation (exact match 1), so a scorer that always says 0
or reads the wrong positions fails."""
import importlib.util
import json
import math

import pytest
import torch

from ds_longctx.errors import ConfigError
from ds_longctx.eval import ruler
from ds_longctx.eval.needle import ByteTokenizer, NeedleCase, score_cases, summarize, table
from tiny_models import build, tiny_config

DEPTHS = [0.0, 0.5, 1.0]


def _decode(tok, ids):
    return tok.decode([int(i) for i in ids])


def test_ruler_style_cases_are_deterministic_and_hold_the_answer():
    tok = ByteTokenizer(256)
    for task in ruler.TASKS:
        a = ruler.build_cases(tok, task, [900, 1200], DEPTHS, seed=3, samples=2)
        b = ruler.build_cases(tok, task, [900, 1200], DEPTHS, seed=3, samples=2)
        c = ruler.build_cases(tok, task, [900, 1200], DEPTHS, seed=4, samples=2)
        assert len(a) == 12 and all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
        assert any(not torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
        for case in a:
            text = _decode(tok, case.input_ids)
            assert case.input_ids.numel() == case.length and case.task == task
            assert _decode(tok, case.input_ids[case.answer_start:]).strip() == case.answer, (task, case.answer)
            # every answer word is in the document before the question
            body = text[:len(text) - len(case.answer) - 1]
            for word in case.answer.rstrip(".").replace(",", " ").split():
                assert word in body, (task, word)
        # deeper needles sit later
        first = [c.needle_at for c in a if c.length == 900 and c.sample == 0]
        assert first == sorted(first) and first[0] < first[-1], (task, first)
    mv = ruler.build_cases(tok, "multivalue", [1200], [0.5], seed=0)[0]
    text = _decode(tok, mv.input_ids)
    values = mv.answer.rstrip(".").split(", ")
    assert len(values) == ruler.VALUES and [text.index(v) for v in values] == sorted(text.index(v) for v in values)
    assert "What are all the special magic numbers for" in text
    single = _decode(tok, ruler.build_cases(tok, "single", [900], [0.5], seed=0)[0].input_ids)
    assert "What is the special magic number for" in single and "A special magic number is hidden" in single
    vt = ruler.build_cases(tok, "vt", [900], [0.2], seed=0)[0]
    chain = vt.answer.rstrip(".").split()
    vtext = _decode(tok, vt.input_ids)
    assert f"VAR {chain[0]} = {vt.key}." in vtext and all(f"VAR {b} = VAR {a}." in vtext for a, b in zip(chain, chain[1:]))
    dense = _decode(tok, ruler.build_cases(tok, "multikey_dense", [1500], [0.5], seed=0)[0].input_ids)
    assert dense.count("One of the special magic numbers for") >= 10
    user = ruler.build_cases(tok, "single", [1000], [0.5], haystack="Once upon a time there was a story. " * 3)[0]
    assert "Once upon a time" in _decode(tok, user.input_ids)


def test_ruler_style_with_a_bpe_tokenizer():
    """A byte-level BPE trained here: exact lengths, a BOS first, the answer's tokens decode to the answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = " ".join(ruler.NOISE + (ruler.NIAH_NEEDLE, ruler.NIAH_QUESTION, ruler.VT_QUESTION)) + " 1234567 ABCDE"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=["<bos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>")
    for task in ruler.TASKS:
        for c in ruler.build_cases(hf, task, [700, 901], [0, 1], seed=1):
            assert c.input_ids.numel() == c.length and int(c.input_ids[0]) == hf.bos_token_id
            assert hf.decode(c.input_ids[c.answer_start:].tolist()).strip() == c.answer, (task, c.answer)


def test_kv_style_follows_its_rule():
    tok = ruler.kv_tokenizer()
    rule = ruler.kv_rule()
    vocab = tok.get_vocab()
    for task in ruler.TASKS:
        for c in ruler.build_cases(tok, task, [64, 256], DEPTHS, seed=2, samples=2, style="kv"):
            words = tok.convert_ids_to_tokens(c.input_ids.tolist())
            assert len(words) == c.length and "<unk>" not in words
            assert " ".join(words[c.answer_start:]) == c.answer
            placed = [t for t, w in enumerate(words) if not w.startswith("w")]  # the task's words
            if task == "passkey":
                assert words[-3] == "?" and words[-1] == c.answer and words.count(c.answer) == 2
            follow = [t for t in range(2, c.length) if t not in placed]
            assert all(words[t] == rule[words[t - 2]] for t in follow if words[t].startswith("w")), task
            # words the task did not place are all the rule's (the rule's words are filler words)
            assert sum(words[t] != rule[words[t - 2]] for t in follow) == 0, (task, words)
            assert c.needle_at in placed
            assert all(vocab[w] == i for w, i in zip(words, c.input_ids.tolist()))


def test_refusals():
    tok = ByteTokenizer(256)
    for call, match in (
            (lambda: ruler.build_cases(tok, "nope", [900], [0.5]), "unknown task"),
            (lambda: ruler.build_cases(tok, "single", [900], [0.5], style="xml"), "unknown style"),
            (lambda: ruler.build_cases(tok, "multivalue", [200], [0.5]), "cannot hold multivalue"),
            (lambda: ruler.build_cases(tok, "single", [901], [0.5], sp=2), "not divisible"),
            (lambda: ruler.build_cases(tok, "single", [900], [0.5], style="kv"), "1 tokens here|tokens here"),
            (lambda: ruler.build_cases(ruler.kv_tokenizer(), "single", [900], [0.5], style="kv", haystack="a b"),
             "kv style's haystack"),
            (lambda: ruler.build_cases(ruler.kv_tokenizer(), "single", [900], [0.5]), "does not know RULER's words"),
            (lambda: ruler.build_cases(ruler.kv_tokenizer(), "multikey_dense", [1024], [0.5], style="kv"),
             "keys are all taken"),
            (lambda: ruler.parse_tasks("single,nope"), "unknown task")):
        with pytest.raises(ConfigError, match=match):
            call()
    assert ruler.parse_tasks("all") == list(ruler.TASKS) and ruler.parse_tasks("vt, single") == ["vt", "single"]


def test_command_one_process(tmp_path, capsys):
    """ds-longctx ruler on a --model-config (random init): a table per task, the summary, the JSON and one
    figure; bad flags exit 2 naming the flag."""
    from ds_longctx.cli import main
    from ds_longctx.config.shipped import default_model_config

    argv = ["ruler", "--model-config", default_model_config(), "--tasks", "passkey,vt", "--lengths", "600,700",
            "--depths", "0,1", "--json", str(tmp_path / "r.json")]
    plot = importlib.util.find_spec("matplotlib") is not None
    assert main(argv + (["--heatmap", str(tmp_path / "r.png")] if plot else [])) == 0
    out = capsys.readouterr().out
    assert "== passkey" in out and "== vt" in out and "task \\ length" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["tasks"]) == {"passkey", "vt"} and len(report["tasks"]["vt"]["results"]) == 4
    assert main(argv[:3] + ["--tasks", "nope"]) == 2
    assert "ds-longctx ruler: --tasks" in capsys.readouterr().err
    assert main(argv[:3] + ["--style", "kv", "--lengths", "64"]) == 2  # a byte tokenizer: not one token per word
    assert "--style" in capsys.readouterr().err
    if plot:
        assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# --- SP=2 equals one process, every task, both styles -----------------------------------------------------------

def _greedy(model, case):
    """``case`` with its answer replaced by the model's own greedy continuation of the question."""
    ids = case.input_ids.clone()
    with torch.no_grad():
        for p in range(case.answer_start, case.length):
            ids[p] = model(input_ids=ids[None, :p], use_cache=False).logits[0, -1].argmax()
    return NeedleCase(length=case.length, depth=case.depth, sample=99, key="greedy", input_ids=ids,
                      answer_start=case.answer_start, needle_at=case.needle_at)


def _all_cases(model):
    """Every task in both styles (RULER's text over bytes % 136; kv words), plus a greedy case per task."""
    out = []
    for style, tok, lengths in (("ruler", ByteTokenizer(136), [768]), ("kv", ruler.kv_tokenizer(), [64, 128])):
        for task in ruler.TASKS:
            cases = ruler.build_cases(tok, task, lengths, [0.0, 1.0], seed=0, style=style)
            out += cases + [_greedy(model, cases[-1])]
    return out


def _model():
    return build(tiny_config(vocab=136), seed=0).eval()


def _ruler_ranks(rank, world, cases):
    import ds_longctx
    from sp_cases import ds_config

    model = build(tiny_config(vocab=136), seed=0)
    engine, *_ = ds_longctx.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=ds_config(3, 2, {"attention": {"implementation": "ulysses"}}))
    return score_cases(engine, cases)


@pytest.mark.distributed
def test_every_task_under_sp2_equals_one_process():
    from dist_utils import run_distributed

    model = _model()
    cases = _all_cases(model)
    ref = score_cases(model, cases)
    greedy = [r for c, r in zip(cases, ref) if c.key == "greedy"]
    assert len(greedy) == 2 * len(ruler.TASKS) and all(r["exact_match"] for r in greedy)
    assert sum(not r["exact_match"] for r in ref) > len(ref) // 2  # both outcomes occur: the random model misses
    for rank, got in enumerate(run_distributed(_ruler_ranks, 2, cases)):
        assert [g["predicted_ids"] for g in got] == [r["predicted_ids"] for r in ref], rank
        assert [g["exact_match"] for g in got] == [r["exact_match"] for r in ref], rank
        for c, g, r in zip(cases, got, ref):  # summation order differs across the shards (as the needle's test)
            assert math.isclose(g["logprob"], r["logprob"], rel_tol=1e-5, abs_tol=1e-5), (rank, c.task, g, r)
        # and so every table cell
        by_task = {}
        for c, g, r in zip(cases, got, ref):
            by_task.setdefault(getattr(c, "task", "greedy") or "greedy", []).append((c, g, r))
        for task, rows in by_task.items():
            cs = [c for c, _, _ in rows]
            mine, theirs = summarize(cs, [g for _, g, _ in rows]), summarize(cs, [r for _, _, r in rows])
            assert [c["accuracy"] for c in mine["cells"]] == [c["accuracy"] for c in theirs["cells"]], task
            assert table(mine).splitlines()[0] == table(theirs).splitlines()[0]


def test_train_eval_task_flags_and_report():
    """train.py --eval-task: checked with --eval-needle's other flags before the launch; at an eval point
    (loop.needle_now) a table per task in the log and the cells under 'ruler' in the metrics."""
    from types import SimpleNamespace

    from launch_utils import TINY_CPU

    from ds_longctx.config import load_ds_config, parse
    from ds_longctx.train import args as train_args
    from ds_longctx.train.loop import needle_now

    lc = parse(load_ds_config(TINY_CPU))
    args = lambda *a: train_args.parse_args(["--deepspeed_config", TINY_CPU, *a])  # noqa: E731
    train_args.validate_args(args("--eval-needle", "256", "--eval-task", "all", "--eval-style", "kv"), lc)
    with pytest.raises(ConfigError, match=r"^--eval-task: unknown task\(s\) nope"):
        train_args.validate_args(args("--eval-needle", "256", "--eval-task", "single,nope"), lc)
    with pytest.raises(ConfigError, match=r"^--eval-task: chooses --eval-needle's test, and there is no --eval-needle"):
        train_args.validate_args(args("--eval-task", "vt"), lc)
    model = _model()
    cases = [c for t in ("passkey", "vt") for c in ruler.build_cases(ruler.kv_tokenizer(), t, [64], [0, 1], style="kv")]
    notes = []
    job = SimpleNamespace(engine=model, needle_cases=cases, steplog=SimpleNamespace(note=notes.append),
                          args=SimpleNamespace(eval_needle="64"))
    out = needle_now(job, 7)
    assert set(out) == {"ruler"} and set(out["ruler"]) == {"passkey", "vt"}
    assert [len(v["cells"]) for v in out["ruler"].values()] == [2, 2]
    assert len(notes) == 2 and notes[0].startswith("RULER passkey (--eval-task) after step 7")
