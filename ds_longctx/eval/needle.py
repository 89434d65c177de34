"""Needle in a haystack (passkey retrieval) under sequence parallelism: did the model learn its long context?

    cases = build_cases(tokenizer, lengths=[1024, 4096], depths=[0, 0.25, 0.5, 0.75, 1], seed=0)
    results = score_cases(engine, cases)          # every rank calls it (a collective); same results everywhere
    report = summarize(cases, results)            # {"cells": ..., "results": ...}; table(report), heatmap(report, png)

A case is one haystack document of exactly ``length`` tokens: filler text (a user's text file, or a built-in
deterministic text), the key fact "The secret passkey is 48213." inserted at ``depth`` (0: the start, 1: just before
the question), then "What is the secret passkey? The secret passkey is" and the answer "48213." as the last tokens.
Deterministic by seed: the same tokens on every rank and for every SP degree.

Scoring is teacher-forced over the answer tokens: exact match (the arg-max at every answer position is the answer
token, i.e. greedy decoding would produce the answer) and the answer's log-likelihood. The logits are computed only
at the answer positions, never [seq, vocab]: the model's own forward with ``logits_to_keep`` = those positions
(transformers applies ``lm_head`` and the model's logit transform, soft-capping and scaling included, to those hidden
states only; under ds_longctx's patch a forward without labels is the model's own one). Under SP each rank runs its
contiguous shard (positions continuing across ranks, as ds_longctx's forward wrapper requires; the whole memory stack
and attention path as in training), keeps the logits of the answer positions it holds and the results are summed
over the ranks; DP replicas share the cases (every rank runs the same number of forwards: ZeRO-3 gathers
parameters in each). ``tokenizer``: a HF tokenizer, or :class:`ByteTokenizer` (UTF-8 bytes, for the tiny models of
the tests and the CPU demo, which have no tokenizer of their own).
"""
from __future__ import annotations

import inspect
import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..dist.comm import control_device, sp_group, sp_rank
from ..errors import ConfigError
from ..patching.patch import get_patch

FACT = "The secret passkey is {key}. Remember it. {key} is the secret passkey."
QUESTION = "What is the secret passkey? The secret passkey is"
ANSWER = " {key}."
# the built-in haystack: the classic passkey filler (Mohtashami & Jaggi 2023), sentences drawn by seed
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
          "The river flows to the sea.", "A bird sings in the morning.", "The road goes on and on.",
          "Clouds drift over the hills.", "The wind is cold tonight.", "Stones lie still by the path.",
          "The town sleeps under the stars.")


class ByteTokenizer:
    """UTF-8 bytes as token ids (byte % vocab_size): a tokenizer for models that have none (the tiny test models,
    the CPU demo). Deterministic, no files."""

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 2:
            raise ConfigError("vocab_size", f"{vocab_size} is too small for a byte tokenizer", "use a real model")
        self.vocab_size = vocab_size
        self.bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The bytes as text; ids that are no byte (a model's vocabulary past 256 predicts them too) as ``<id>``."""
        if self.vocab_size < 256:
            return " ".join(str(int(i)) for i in ids)
        out, run = [], bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(f"<{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


@dataclass
class NeedleCase:
    length: int
    depth: float
    sample: int
    key: str
    input_ids: torch.Tensor   # [length], long
    answer_start: int         # index of the first answer token; the answer runs to the end
    needle_at: int            # index of the fact's first token

    @property
    def answer_len(self) -> int:
        return self.length - self.answer_start


def parse_lengths(text: str, flag: str = "--lengths") -> List[int]:
    """'1K,4K,1M' -> [1024, 4096, 1048576] (K/M: 1024 / 1048576; plain integers too)."""
    out = []
    for part in str(text).split(","):
        p = part.strip().upper()
        mult = {"K": 1024, "M": 1024 ** 2}.get(p[-1:], 1)
        try:
            n = int(float(p[:-1] if mult > 1 else p) * mult)
        except ValueError:
            raise ConfigError(flag, f"{part!r} is not a length", "give lengths like 1K,4K,32K or 1000,4000") from None
        if n < 1:
            raise ConfigError(flag, f"{part!r} is not a positive length", "give positive lengths")
        out.append(n)
    if not out:
        raise ConfigError(flag, "no length given", "give lengths like 1K,4K")
    return out


def parse_depths(text: str, flag: str = "--depths") -> List[float]:
    try:
        out = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise ConfigError(flag, f"{text!r} is not a list of fractions", "give depths like 0,0.25,0.5,0.75,1") from None
    if not out or any(not 0.0 <= d <= 1.0 for d in out):
        raise ConfigError(flag, f"{text!r}: depths are fractions of the document in [0, 1]",
                          "give depths like 0,0.25,0.5,0.75,1")
    return out


def _encode(tokenizer, text: str) -> List[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _filler_tokens(tokenizer, n: int, rng: random.Random, text: Optional[str]) -> List[int]:
    """``n`` haystack tokens: the user's text from a seeded offset (repeated when shorter), or seeded sentences."""
    out: List[int] = []
    if text is not None:
        base = _encode(tokenizer, text)
        if not base:
            raise ConfigError("--haystack", "the text file holds no tokens", "give a text file with content")
        start = rng.randrange(len(base))
        while len(out) < n:
            out += base[start:]
            start = 0
        return out[:n]
    while len(out) < n:  # tokenized sentence by sentence, then cut: the same for every n
        out += _encode(tokenizer, " " + " ".join(rng.choice(FILLER) for _ in range(16)))
    return out[:n]


def _question_answer(tokenizer, key: str):
    """The question's and the answer's tokens as the tokenizer splits the two together (a BPE may merge across
    the boundary); encoded apart when the question's own tokens are not a prefix of the joint ones."""
    question = _encode(tokenizer, " " + QUESTION)
    both = _encode(tokenizer, " " + QUESTION + ANSWER.format(key=key))
    if both[:len(question)] == question and len(both) > len(question):
        return question, both[len(question):]
    return question, _encode(tokenizer, ANSWER.format(key=key))


def check_lengths(lengths: Sequence[int], sp: int) -> None:
    """Every length divisible by the SP degree (the shards), else one error naming the first that is not."""
    for length in lengths:
        if length % sp:
            raise ConfigError("--lengths", f"{length} is not divisible by the sequence parallel degree {sp}",
                              f"give lengths that are multiples of {sp} (e.g. {length - length % sp or sp})")


def build_cases(tokenizer, lengths: Sequence[int], depths: Sequence[float], seed: int = 0, samples: int = 1,
                haystack: Optional[str] = None, sp: int = 1) -> List[NeedleCase]:
    """One :class:`NeedleCase` per (length, depth, sample), deterministic by ``seed``. ``haystack``: filler text
    (a file's content) or None for the built-in one. ``sp``: every length must be divisible by it (the shards)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    check_lengths(lengths, sp)
    cases = []
    for length in lengths:
        for depth in depths:
            for s in range(samples):
                rng = random.Random(f"{seed}/{length}/{depth}/{s}")
                key = str(rng.randrange(10000, 100000))
                fact = _encode(tokenizer, " " + FACT.format(key=key))
                question, answer = _question_answer(tokenizer, key)
                head = [bos] if bos is not None else []
                room = length - len(head) - len(fact) - len(question) - len(answer)
                if room < 0:
                    raise ConfigError("--lengths", f"{length} tokens cannot hold the fact, question and answer "
                                      f"({length - room} tokens)", f"give lengths >= {length - room} (more for a haystack)")
                hay = _filler_tokens(tokenizer, room, rng, haystack)
                at = int(round(depth * room))
                ids = head + hay[:at] + fact + hay[at:] + question + answer
                assert len(ids) == length
                cases.append(NeedleCase(length=length, depth=float(depth), sample=s, key=key,
                                        input_ids=torch.tensor(ids, dtype=torch.long),
                                        answer_start=length - len(answer), needle_at=len(head) + at))
    return cases


def _check_model(model) -> None:
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    forward = type(module).forward
    if "logits_to_keep" not in inspect.signature(forward).parameters:
        raise ConfigError("model", f"{type(module).__name__}.forward takes no logits_to_keep: the needle test "
                          "computes logits at the answer positions only", "use a transformers causal LM whose "
                          "forward takes logits_to_keep (transformers 5 models do)")


def placement(model):
    """(SP group or None, SP degree, SP rank, DP degree, DP rank) of ``model``: a ds_longctx engine's layout, a
    model patched by ds_longctx (its spec's group), else one process per replica of the default group."""
    layout = getattr(model, "long_context_layout", None)
    if layout is None:

        handle = get_patch(getattr(model, "module", model))
        if handle is not None and handle.spec.sp > 1:

            group, sp = handle.spec.group, handle.spec.sp
            rank = dist.get_rank()
            return group, sp, sp_rank(group), dist.get_world_size() // sp, rank // sp
        live = dist.is_available() and dist.is_initialized()
        return None, 1, 0, (dist.get_world_size() if live else 1), (dist.get_rank() if live else 0)
    group = None
    if layout.sp > 1:

        group = sp_group()
    return group, layout.sp, layout.sp_rank, layout.dp, layout.dp_rank


def _device(model):
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(getattr(model, "module", model).parameters()).device


@torch.no_grad()
def _score_local(model, case: NeedleCase, sp: int, sp_rank: int, width: int, device) -> torch.Tensor:
    """This rank's part of one case: [logprob sum, correct tokens, arg-max id + 1 per answer position (0: not
    held here)], float64."""
    out = torch.zeros(2 + width, dtype=torch.float64)
    local = case.length // sp
    lo = sp_rank * local
    ids = case.input_ids[lo:lo + local]
    # the logits at position p predict token p + 1: the answer's predictors are answer_start - 1 .. length - 2
    wanted = [p for p in range(case.answer_start - 1, case.length - 1) if lo <= p < lo + local]
    keep = torch.tensor([p - lo for p in wanted], dtype=torch.long, device=device)
    logits = model(input_ids=ids.unsqueeze(0).to(device),
                   position_ids=torch.arange(lo, lo + local, device=device).unsqueeze(0),
                   logits_to_keep=keep, use_cache=False).logits
    if logits.shape[1] != len(wanted):
        raise ConfigError("model", f"returned logits at {logits.shape[1]} positions for {len(wanted)} asked "
                          "(logits_to_keep)", "use a model whose forward honours logits_to_keep as indices")
    if wanted:
        logp = torch.log_softmax(logits[0].double(), dim=-1).cpu()
        targets = case.input_ids[torch.tensor(wanted) + 1]
        top = logp.argmax(-1)
        out[0] = logp.gather(-1, targets.unsqueeze(-1)).sum()
        out[1] = (top == targets).sum()
        for j, p in enumerate(wanted):
            out[2 + p - (case.answer_start - 1)] = float(top[j]) + 1
    return out


@torch.no_grad()
def score_cases(model, cases: Sequence[NeedleCase]) -> List[Dict]:
    """Every case's score, the same on every rank (a collective: every rank calls it with the same cases):
    ``{"exact_match", "token_accuracy", "logprob", "predicted_ids"}``. ``model``: a HF causal LM, a model patched
    by ds_longctx, or a (ds_longctx) DeepSpeed engine; it is put in eval mode for the loop and back after."""
    _check_model(model)
    group, sp, sp_rank, dp, dp_rank = placement(model)
    for c in cases:
        if c.length % sp:
            raise ConfigError("--lengths", f"{c.length} is not divisible by the sequence parallel degree {sp}",
                              f"give lengths that are multiples of {sp}")
    width = max((c.answer_len for c in cases), default=0)
    table = torch.zeros(len(cases), 2 + width, dtype=torch.float64)
    device = _device(model)
    training = model.training
    model.eval()
    try:
        rounds = -(-len(cases) // dp)
        for r in range(rounds):  # every rank runs the same forwards (ZeRO-3, SP); a replica out of cases redoes
            i = r * dp + dp_rank  # case 0 and drops it
            row = _score_local(model, cases[i if i < len(cases) else 0], sp, sp_rank, width, device)
            if i < len(cases):
                table[i] = row
    finally:
        if training:
            model.train()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:

        t = table.to(control_device())
        dist.all_reduce(t)  # the SP shards of a case and the replicas' cases: each slot held by one rank
        table = t.cpu()
    results = []
    for c, row in zip(cases, table):
        n = c.answer_len
        correct = int(round(float(row[1])))
        results.append({"exact_match": correct == n, "token_accuracy": correct / n, "logprob": float(row[0]),
                        "predicted_ids": [int(round(float(v))) - 1 for v in row[2:2 + n]]})
    return results


def summarize(cases: Sequence[NeedleCase], results: Sequence[Dict], tokenizer=None) -> Dict:
    """The report: per case (length, depth, sample, key, the scores, the greedy answer's text when ``tokenizer``
    decodes) and per (length, depth) cell (exact-match accuracy over its samples, mean log-likelihood)."""
    rows = []
    for c, r in zip(cases, results):
        row = {"length": c.length, "depth": c.depth, "sample": c.sample, "key": c.key, "needle_at": c.needle_at,
               **r}
        if tokenizer is not None and hasattr(tokenizer, "decode"):
            row["predicted"] = tokenizer.decode([max(i, 0) for i in r["predicted_ids"]])
        rows.append(row)
    lengths = sorted({c.length for c in cases})
    depths = sorted({c.depth for c in cases})
    cells = []
    for L in lengths:
        for d in depths:
            mine = [r for r in rows if r["length"] == L and r["depth"] == d]
            if mine:
                cells.append({"length": L, "depth": d, "samples": len(mine),
                              "accuracy": sum(r["exact_match"] for r in mine) / len(mine),
                              "logprob": sum(r["logprob"] for r in mine) / len(mine)})
    return {"lengths": lengths, "depths": depths, "cells": cells, "results": rows}


def _fmt_len(n: int) -> str:
    for unit, size in (("M", 1024 ** 2), ("K", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def table(report: Dict) -> str:
    """Text table: a row per depth, a column per length; each cell 'accuracy (mean log-likelihood)'."""
    cell = {(c["length"], c["depth"]): c for c in report["cells"]}
    head = ["depth \\ length"] + [_fmt_len(L) for L in report["lengths"]]
    lines = [head]
    for d in report["depths"]:
        row = [f"{d:g}"]
        for L in report["lengths"]:
            c = cell.get((L, d))
            row.append("-" if c is None else f"{c['accuracy']:.2f} ({c['logprob']:.2f})")
        lines.append(row)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in lines]
    return "\n".join(text + ["cells: exact-match accuracy of the greedy answer (mean answer log-likelihood, nats)"])


def write_json(report: Dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _pyplot(flag: str = "--heatmap"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(flag, "needs matplotlib, which is not installed",
                          "pip install matplotlib (or ds_longctx[test]), or drop --heatmap") from None
    return plt


def _draw(ax, report: Dict, title: str):
    """One report's exact-match heatmap (depth x length) on ``ax``; each cell shows the mean log-likelihood."""
    lengths, depths = report["lengths"], report["depths"]
    cell = {(c["length"], c["depth"]): c for c in report["cells"]}
    acc = [[cell[(L, d)]["accuracy"] if (L, d) in cell else math.nan for L in lengths] for d in depths]
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [_fmt_len(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("depth of the fact")
    for i, d in enumerate(depths):
        for j, L in enumerate(lengths):
            if (L, d) in cell:
                ax.text(j, i, f"{cell[(L, d)]['logprob']:.1f}", ha="center", va="center", fontsize=8)
    ax.set_title(title)
    return im


def heatmap(report: Dict, path: str, title: str = "needle in a haystack") -> None:
    """The accuracy heatmap (depth x length) as a PNG; each cell also shows the mean log-likelihood."""
    plt = _pyplot()
    lengths, depths = report["lengths"], report["depths"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    im = _draw(ax, report, title)
    fig.colorbar(im, ax=ax, label="exact match")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmaps(reports: Sequence[Dict], path: str, titles: Sequence[str], suptitle: Optional[str] = None,
             flag: str = "--heatmap") -> None:
    """Several reports' heatmaps side by side in one PNG (one colour scale): a run before and after, or one
    panel per task."""
    plt = _pyplot(flag)
    n = len(reports)
    width = max(1.2 * max(len(r["lengths"]) for r in reports) + 1.8, 3.2)
    height = 0.6 * max(len(r["depths"]) for r in reports) + 2.0
    fig, axes = plt.subplots(1, n, figsize=(width * n + 1.0, height), squeeze=False)
    for i, (ax, report, title) in enumerate(zip(axes[0], reports, titles)):
        im = _draw(ax, report, title)
        if i:
            ax.set_ylabel("")
    fig.colorbar(im, ax=list(axes[0]), label="exact match", fraction=0.03)
    if suptitle:
        fig.suptitle(suptitle, y=1.02)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def case_dicts(cases: Sequence[NeedleCase]) -> List[Dict]:
    return [{k: v for k, v in asdict(c).items() if k != "input_ids"} for c in cases]


# ---------------------------------------------------------------------------------------------
# the command: ds-longctx needle (ds_longctx/cli.py), or python -m ds_longctx.eval.needle_cli under a launcher
# ---------------------------------------------------------------------------------------------


__all__ = ["ByteTokenizer", "NeedleCase", "build_cases", "score_cases", "summarize", "table", "heatmap", "heatmaps",
           "write_json", "parse_lengths", "parse_depths", "placement"]
