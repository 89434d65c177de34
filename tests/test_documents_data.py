"""--data FILE packs documents (position_ids restart per document) or concatenates them
(--concat-documents); a tokenizer larger than the model's vocabulary is an error before the engine
starts. The tokenizer is a char-level WordLevel one built locally."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from ds_longctx.config import ConfigError
from ds_longctx.data import TokenFileDataset, check_tokenizer_vocab, shard_batch

CHARS = "abcdefghijklmnopqrstuvwxyz "
DOCS = ["hello world", "a", "packed documents attend within themselves", "the quick brown fox jumps over the lazy dog",
        "sequence parallel", "zz"] * 4


def make_tokenizer(path, extra=0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    vocab.update({f"<x{i}>": len(vocab) + i for i in range(extra)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")
    fast.save_pretrained(str(path))
    return fast


def write_docs(path):
    with open(path, "w") as f:
        for d in DOCS:
            f.write(json.dumps({"text": d}) + "\n")


def test_packed_positions_restart_per_document(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    write_docs(tmp_path / "docs.jsonl")
    ds = TokenFileDataset(str(tmp_path / "docs.jsonl"), tok, 16, vocab_size=64)
    stream = []
    for d in DOCS:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [0]
    assert tok("ab", add_special_tokens=False)["input_ids"] == [1, 2]
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].tolist() == stream[i * 16:(i + 1) * 16]
        # position = distance to the last document start (token after an EOS) or the sample start
        expect, p = [], 0
        for j in range(16):
            g = i * 16 + j
            p = 0 if j == 0 or stream[g - 1] == 0 else p + 1
            expect.append(p)
        assert item["position_ids"].tolist() == expect
    assert any(0 in ds[i]["position_ids"][1:].tolist() for i in range(len(ds)))  # really packed
    s = shard_batch({k: v.unsqueeze(0) for k, v in ds[0].items()}, 0, 2)
    assert s["doc_cu_seqlens"].shape[1] > 2
    plain = TokenFileDataset(str(tmp_path / "docs.jsonl"), tok, 16, documents=False)
    assert "position_ids" not in plain[0] and torch.equal(plain[0]["input_ids"], ds[0]["input_ids"])


def test_tokenizer_larger_than_model_vocab_is_an_error(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", extra=40)  # 68 tokens
    write_docs(tmp_path / "docs.jsonl")
    with pytest.raises(ConfigError, match="--tokenizer: has 68 tokens but the model's vocab_size is 64"):
        check_tokenizer_vocab(tok, 64)
    from ds_longctx.train import job as train_job

    args = argparse.Namespace(data=str(tmp_path / "docs.jsonl"), tokenizer=str(tmp_path / "tok"), model=None,
                              concat_documents=False, seed=0, data_column="text")

    class Cfg:
        vocab_size = 64

    with pytest.raises(ConfigError, match="has 68 tokens but the model's vocab_size is 64"):
        train_job.build_dataset(args, Cfg, 16, train_job.load_tokenizer(args))


@pytest.mark.distributed
def test_train_py_packed_documents(tmp_path):
    from launch_utils import read_metrics, run_train, side_by_side

    make_tokenizer(tmp_path / "tok")
    write_docs(tmp_path / "docs.jsonl")
    losses = {}
    flags = ([], ["--concat-documents"])
    # the packed job also evaluates held-out data (--eval-data: here the same documents) after every step
    side_by_side(*[(run_train, ("--data", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--steps",
                                "2", "--seq-len", "32", "--metrics", str(tmp_path / f"m{len(flag)}.jsonl"),
                                "--eval-samples", "0", *(flag or ["--eval-data", str(tmp_path / "docs.jsonl"),
                                                                  "--eval-every", "1"])), {})
                   for flag in flags])  # two jobs, started together
    for flag in flags:
        recs = read_metrics(tmp_path / f"m{len(flag)}.jsonl")
        assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
        losses[len(flag)] = recs[0]["loss"]
    assert losses[0] != losses[1]  # document masking changes the function (same weights, same tokens)
    evals = read_metrics(tmp_path / "m0.jsonl")
    assert all(r["eval_tokens"] > 0 and r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]  # evaluated after each step's update
