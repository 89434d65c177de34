"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?") as teacher-forced cases under SP: generated offline from a seed, scored by the needle test's own machinery
(``needle.score_cases``: logits at the answer positions only, each rank its shard), a table and a heatmap per task.

    cases = build_cases(tokenizer, "multikey", lengths=[4096, 16384], depths=[0, 0.5, 1], seed=0, samples=4)
    results = needle.score_cases(engine, cases)             # a collective: every rank, the same cases
    report = needle.summarize(cases, results, tokenizer)    # needle.table(report), needle.heatmap(report, png)

Each case is one document of exactly ``length`` tokens whose last tokens are the answer, scored as the needle's:
exact match of the greedy answer (teacher-forced) and its log-likelihood. The tasks (RULER's names in brackets):

- ``passkey`` (niah_single_1, the passkey form of Mohtashami & Jaggi 2023): one value, no key; the question asks
  for it.
- ``single`` (niah_single_1/2): one needle "One of the special magic numbers for KEY is: VALUE."; the question
  asks KEY, the answer is VALUE.
- ``multikey`` (niah_multikey_1): the needle and 3 distractor needles of other keys.
- ``multikey_dense`` (niah_multikey_2): the haystack is distractor needles (other keys, other values).
- ``multivalue`` (niah_multivalue): one key with 4 needles of 4 values; the answer lists the 4 in the order the
  document holds them (RULER accepts any order; a teacher-forced answer needs one).
- ``multiquery`` (niah_multiquery): 4 keys with a value each; the question asks the 4 in a seeded order and the
  answer lists their values in that order.
- ``vt`` (variable tracking, 1 chain of 4 hops): "VAR A = 12345." then "VAR B = VAR A." ...; the question asks
  for every variable that holds 12345, the answer lists the 5 in chain order.

``depth``: where the (first) queried needle sits, as a fraction of the haystack; a task's other needles of the
answer (multivalue's values, multiquery's keys, vt's hops) sit at seeded depths after it, distractors anywhere.

Two styles. ``"ruler"``: RULER's English templates (keys adjective-noun words, values 7-digit numbers, variables 5
capital letters; the haystack RULER's "repeat" noise sentences, or a user's text as RULER's essay haystack; needles
between the haystack's sentences, anywhere in a user's text): for real models and their tokenizers, unchanged.
``"kv"``: the same structures in bare words, one token each (a word-level tokenizer of :func:`kv_vocabulary`, e.g.
:func:`kv_tokenizer`): keys ``k0..``, values ``v0..``, variables ``x0..``, filler ``w0..``, ``?`` and ``=``; a
needle is "k v", a question "? k" (vt: "? = v"). Its haystack follows a fixed second-order rule (:func:`kv_words`:
every word not placed by the task is ``RULE[the word two before]``), so that predicting the haystack takes a
previous-token attention head, as language does; the passkey's question is "?", one haystack word, then the
answer, so answering takes knowing that "?" is exactly one word back. It is for the tiny models a CPU trains in
minutes (bench/extend_demo.py). Deterministic by seed: the same tokens on every rank and for every SP degree.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError
from .needle import FACT, QUESTION, NeedleCase, _encode, _filler_tokens, _fmt_len, check_lengths

TASKS = ("passkey", "single", "multikey", "multikey_dense", "multivalue", "multiquery", "vt")
STYLES = ("ruler", "kv")
DISTRACTORS = 3      # multikey: RULER's num_needle_k = 4
VALUES = 4           # multivalue: num_needle_v = 4
QUERIES = 4          # multiquery: num_needle_q = 4
HOPS = 4             # vt: num_hops = 4, one chain
DENSE_GAP = 4        # kv multikey_dense: haystack words between two distractor needles

# RULER's "repeat" haystack (its noise sentences) and templates (scripts/data/synthetic/constants.py, niah.py,
# variable_tracking.py); the passkey's are the needle test's
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NIAH_PREAMBLE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will "
                 "quiz you about the {kind} afterwards.")
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_QUESTION = ("What are all the special magic {kind} for {query} mentioned in the provided text? The special "
                 "magic {kind} for {query} mentioned in the provided text are")
VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = ("Question: Find all variables that are assigned the value {query} in the text above. Answer: According "
               "to the chain(s) of variable assignment in the text above, {n} variables are assigned the value "
               "{query}, they are:")
# keys: RULER draws adjective-noun pairs from wonderwords' lists; these are a fixed offline subset (no downloads)
ADJECTIVES = ("able", "bitter", "brave", "calm", "clever", "cold", "cool", "curious", "damp", "dark", "eager", "early",
              "fair", "fancy", "fierce", "gentle", "glad", "golden", "grand", "happy", "hollow", "honest", "humble",
              "jolly", "kind", "late", "lazy", "little", "loud", "lucky", "mellow", "mighty", "narrow", "noble",
              "odd", "plain", "proud", "quick", "quiet", "rapid", "rare", "rough", "round", "shiny", "silent", "silly",
              "simple", "sleepy", "smooth", "soft", "solid", "sour", "steady", "sticky", "strange", "sweet", "swift",
              "tame", "tender", "tidy", "tiny", "vast", "warm", "wild", "wise", "young")
NOUNS = ("anchor", "apple", "arrow", "badge", "basket", "beacon", "bell", "blanket", "branch", "bridge", "bucket",
         "button", "candle", "canyon", "castle", "cedar", "chalk", "cherry", "cloud", "comet", "copper", "cottage",
         "crystal", "desert", "dragon", "engine", "falcon", "feather", "forest", "fountain", "garden", "glacier",
         "hammer", "harbor", "island", "jacket", "kettle", "ladder", "lantern", "lemon", "marble", "meadow", "mirror",
         "needle", "orchard", "pebble", "pepper", "pillow", "planet", "pocket", "puzzle", "rabbit", "ribbon",
         "river", "saddle", "shadow", "signal", "silver", "spider", "summit", "thunder", "timber", "tunnel",
         "velvet", "violin", "wagon", "window", "winter")


@dataclass(frozen=True)
class KV:
    """The "kv" style's word pools: keys k0..k{keys-1}, values v0.., variables x0.., filler w0..."""
    keys: int = 64
    values: int = 32
    variables: int = 16
    filler: int = 16


def kv_vocabulary(kv: KV = KV()) -> List[str]:
    """The words of the "kv" style (a word-level tokenizer of exactly these gives one token per word)."""
    return (["?", "="] + [f"k{i}" for i in range(kv.keys)] + [f"v{i}" for i in range(kv.values)]
            + [f"x{i}" for i in range(kv.variables)] + [f"w{i}" for i in range(kv.filler)])


def kv_tokenizer(kv: KV = KV(), path: Optional[str] = None):
    """A word-level ``PreTrainedTokenizerFast`` of :func:`kv_vocabulary` (``<unk>`` first; no BOS/EOS: documents of
    exactly their word count), saved to ``path`` when given: what train.py's ``--tokenizer`` loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>"] + kv_vocabulary(kv)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    if path:
        fast.save_pretrained(path)
    return fast


def kv_rule(kv: KV = KV()) -> Dict[str, str]:
    """The kv haystack's second-order rule: word -> the filler word that follows it two positions later (a seeded
    permutation of the filler words; a seeded filler word for every other word)."""
    perm = list(range(kv.filler))
    random.Random("ruler/kv_rule").shuffle(perm)
    rule = {f"w{i}": f"w{perm[i]}" for i in range(kv.filler)}
    for w in kv_vocabulary(kv):
        rule.setdefault(w, f"w{random.Random('ruler/kv_rule/' + w).randrange(kv.filler)}")
    return rule


def kv_words(n: int, slots: Dict[int, str], rng: random.Random, kv: KV = KV()) -> List[str]:
    """``n`` words: ``slots`` (position -> word) where given, else the rule applied to the word two before (the
    first two: seeded filler words)."""
    rule = kv_rule(kv)
    out: List[str] = []
    for t in range(n):
        out.append(slots[t] if t in slots else rule[out[t - 2]] if t >= 2 else f"w{rng.randrange(kv.filler)}")
    return out


@dataclass
class RulerCase(NeedleCase):
    """A :class:`~ds_longctx.eval.needle.NeedleCase` (scored by ``needle.score_cases``) of one task: ``key`` is the
    question's key(s), ``answer`` the answer's text."""
    task: str = ""
    answer: str = ""


@dataclass
class _Plan:
    """One case's content, style-free: needles (kind, fields, depth; placed by (position, list order)), the
    question's queries, the answers; ``used``: the keys and values drawn (a dense haystack draws others)."""
    needles: List[Tuple[str, tuple, float]]
    queries: List[str]
    answers: List[str]
    dense: bool = False
    used: Tuple[set, set] = field(default_factory=lambda: (set(), set()))


class _Draw:
    """Keys, values and variables of a style, distinct within a case."""

    def __init__(self, style: str, kv: KV, rng: random.Random):
        self.style, self.kv, self.rng = style, kv, rng
        self.keys, self.values, self.variables = set(), set(), set()

    def _new(self, pool: set, make, size: int, what: str, fix: str):
        if len(pool) >= size:
            raise ConfigError("--lengths", f"the kv style's {size} {what} are all taken in one document", fix)
        while True:
            x = make()
            if x not in pool:
                pool.add(x)
                return x

    def key(self) -> str:
        r = self.rng
        if self.style == "kv":
            return self._new(self.keys, lambda: f"k{r.randrange(self.kv.keys)}", self.kv.keys, "keys",
                             "use shorter lengths for multikey_dense in the kv style, or a KV with more keys")
        return self._new(self.keys, lambda: f"{r.choice(ADJECTIVES)}-{r.choice(NOUNS)}", 10 ** 9, "keys", "")

    def value(self, digits: int = 7) -> str:
        r = self.rng
        if self.style == "kv":
            return self._new(self.values, lambda: f"v{r.randrange(self.kv.values)}", self.kv.values, "values",
                             "use a KV with more values")
        return self._new(self.values, lambda: str(r.randrange(10 ** (digits - 1), 10 ** digits)), 10 ** 9, "values",
                         "")

    def distractor_value(self) -> str:
        """A distractor's value: any value (a key's answer stays unique by its key; RULER draws them freely)."""
        if self.style == "kv":
            return f"v{self.rng.randrange(self.kv.values)}"
        return str(self.rng.randrange(10 ** 6, 10 ** 7))

    def variable(self) -> str:
        r = self.rng
        if self.style == "kv":
            return self._new(self.variables, lambda: f"x{r.randrange(self.kv.variables)}", self.kv.variables,
                             "variables", "use a KV with more variables")
        return self._new(self.variables, lambda: "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)),
                         10 ** 9, "variables", "")


def _after(rng: random.Random, depth: float, n: int) -> List[float]:
    """``n`` sorted seeded depths in [depth, 1]."""
    return sorted(depth + (1.0 - depth) * rng.random() for _ in range(n))


def _plan(task: str, draw: _Draw, depth: float) -> _Plan:
    rng = draw.rng
    if task == "passkey":
        v = draw.value(5)
        return _Plan([("passkey", (v,), depth)], [], [v])
    if task in ("single", "multikey", "multikey_dense"):
        k, v = draw.key(), draw.value()
        needles = [("kv", (k, v), depth)]
        if task == "multikey":
            needles += [("kv", (draw.key(), draw.distractor_value()), rng.random()) for _ in range(DISTRACTORS)]
        return _Plan(needles, [k], [v], dense=task == "multikey_dense")
    if task == "multivalue":
        k = draw.key()
        vals = [draw.value() for _ in range(VALUES)]
        depths = [depth] + _after(rng, depth, VALUES - 1)
        return _Plan([("kv", (k, v), d) for v, d in zip(vals, depths)], [k], vals)
    if task == "multiquery":
        ks = [draw.key() for _ in range(QUERIES)]
        vals = [draw.value() for _ in range(QUERIES)]
        depths = [depth] + _after(rng, depth, QUERIES - 1)
        order = list(range(QUERIES))
        rng.shuffle(order)
        return _Plan([("kv", (k, v), d) for k, v, d in zip(ks, vals, depths)], [ks[i] for i in order],
                     [vals[i] for i in order])
    if task == "vt":
        value = draw.value(5)
        chain = [draw.variable() for _ in range(HOPS + 1)]
        depths = [depth] + _after(rng, depth, HOPS)
        needles = [("assign", (chain[0], value, True), depths[0])]
        needles += [("assign", (chain[j + 1], chain[j], False), depths[j + 1]) for j in range(HOPS)]
        return _Plan(needles, [value], chain)
    raise ConfigError("--tasks", f"unknown task {task!r}", f"choose from {', '.join(TASKS)}")


# ------------------------------------------------------------------------------------------------
# the "ruler" style: RULER's English text, any tokenizer
# ------------------------------------------------------------------------------------------------

def _singular(text: str) -> str:
    """RULER's rewrite of its templates for one answer ("Some ... are" -> "A ... is", "numbers" -> "number")."""
    for a, b in (("Some special", "A special"), ("What are all", "What is"), (" are ", " is "),
                 ("numbers", "number")):
        text = text.replace(a, b)
    return text[:-4] + " is" if text.endswith(" are") else text


def _ruler_text(task: str, plan: _Plan):
    """(preamble, needle texts, question, answer) in RULER's words."""
    n = len(plan.answers)
    if task == "passkey":
        v = plan.answers[0]
        return "", [FACT.format(key=v)], QUESTION, f" {v}."
    needles = []
    for kind, f, _ in plan.needles:
        if kind == "kv":
            needles.append(NIAH_NEEDLE.format(kind="numbers", key=f[0], value=f[1]))
        else:
            var, src, is_value = f
            needles.append(f"VAR {var} = {src}." if is_value else f"VAR {var} = VAR {src}.")
    if task == "vt":
        return VT_PREAMBLE, needles, VT_QUESTION.format(query=plan.queries[0], n=n), " " + " ".join(plan.answers) + "."
    qs = plan.queries
    query = qs[0] if len(qs) == 1 else ", ".join(qs[:-1]) + ", and " + qs[-1]
    pre = NIAH_PREAMBLE.format(kind="numbers")
    question = NIAH_QUESTION.format(kind="numbers", query=query)
    if n == 1:
        pre, question = _singular(pre), _singular(question)
    return pre, needles, question, " " + ", ".join(plan.answers) + "."


def _question_answer(tokenizer, question: str, answer: str):
    """As the needle test's: the tokens of question and answer as the tokenizer splits the two together, encoded
    apart when the question's own tokens are not a prefix of the joint ones."""
    q = _encode(tokenizer, " " + question)
    both = _encode(tokenizer, " " + question + answer)
    if both[:len(q)] == q and len(both) > len(q):
        return q, both[len(q):]
    return q, _encode(tokenizer, answer)


def _ruler_haystack(tokenizer, room: int, rng: random.Random, haystack: Optional[str], plan: _Plan, draw: _Draw):
    """``room`` haystack tokens and the indices a needle may go before (the pieces' boundaries; None: any)."""
    if haystack is not None and not plan.dense:
        return _filler_tokens(tokenizer, room, rng, haystack), None  # any token boundary, as the needle test
    pieces: List[List[int]] = []
    total, start = 0, rng.randrange(len(NOISE))
    while total < room:
        text = (NIAH_NEEDLE.format(kind="numbers", key=draw.key(), value=draw.distractor_value()) if plan.dense
                else NOISE[(start + len(pieces)) % len(NOISE)])
        pieces.append(_encode(tokenizer, " " + text))
        total += len(pieces[-1])
    tokens, bounds = [], [0]
    for p in pieces:
        tokens += p
        bounds.append(len(tokens))
    cut = len(tokens) - room  # the first piece cut at the front: the haystack ends whole before the question
    return tokens[cut:], [0] + [b - cut for b in bounds if b > cut]


def _place(needles: List[Tuple[list, float]], room: int, bounds: Optional[List[int]]):
    """(haystack index, order, needle) sorted into the document: each needle before the boundary nearest its
    depth; ties keep the plan's order."""
    placed = []
    for order, (piece, d) in enumerate(needles):
        want = d * room
        at = int(round(want)) if bounds is None else min(bounds, key=lambda b: (abs(b - want), b))
        placed.append((at, order, piece))
    return sorted(placed, key=lambda p: (p[0], p[1]))


def _ruler_case(tokenizer, task: str, plan: _Plan, length: int, rng: random.Random, haystack: Optional[str],
                draw: _Draw):
    bos = getattr(tokenizer, "bos_token_id", None)
    pre, texts, question, answer = _ruler_text(task, plan)
    head = ([bos] if bos is not None else []) + (_encode(tokenizer, pre) if pre else [])
    needles = [(_encode(tokenizer, " " + t), d) for t, (_, _, d) in zip(texts, plan.needles)]
    q, a = _question_answer(tokenizer, question, answer)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and sum(t == unk for t in q + a) * 2 > len(q + a):
        raise ConfigError("--style", f"this tokenizer does not know RULER's words ({sum(t == unk for t in q + a)} of "
                          f"the question's and answer's {len(q + a)} tokens are {getattr(tokenizer, 'unk_token', unk)!r})",
                          "use the model's own tokenizer, or --style kv with a word-level kv tokenizer")
    room = length - len(head) - sum(len(n) for n, _ in needles) - len(q) - len(a)
    if room < 0:
        raise ConfigError("--lengths", f"{length} tokens cannot hold {task}'s needles, question and answer "
                          f"({length - room} tokens)", f"give lengths >= {length - room} (more for a haystack)")
    hay, bounds = _ruler_haystack(tokenizer, room, rng, haystack, plan, draw)
    ids, prev, first_at = list(head), 0, None
    for at, order, piece in _place(needles, room, bounds):
        ids += hay[prev:at]
        if order == 0:
            first_at = len(ids)
        ids += piece
        prev = at
    ids += hay[prev:] + q + a
    return ids, first_at, len(a), answer.strip()


# ------------------------------------------------------------------------------------------------
# the "kv" style: bare words, one token each
# ------------------------------------------------------------------------------------------------

def _kv_case(tokenizer, task: str, plan: _Plan, length: int, rng: random.Random, draw: _Draw, kv: KV):
    needles = []
    for kind, f, d in plan.needles:
        if kind == "passkey":
            needles.append(([f[0]], d))
        elif kind == "kv":
            needles.append(([f[0], f[1]], d))
        else:
            needles.append(([f[0], "=", f[1]], d))
    if task == "passkey":
        question = ["?", None]  # None: the haystack's next word (the rule's)
    elif task == "vt":
        question = ["?", "=", plan.queries[0]]
    else:
        question = ["?"] + list(plan.queries)
    answer = list(plan.answers)
    bos = getattr(tokenizer, "bos_token_id", None)
    n = length - (bos is not None)
    room = n - sum(len(w) for w, _ in needles) - len(question) - len(answer)
    if plan.dense:  # distractor needles every DENSE_GAP haystack words
        count = max(0, room // (2 + DENSE_GAP))
        extra = [([draw.key(), draw.distractor_value()], (i + rng.random()) / max(count, 1)) for i in range(count)]
        needles += extra
        room -= 2 * count
    if room < 0:
        raise ConfigError("--lengths", f"{length} tokens cannot hold {task}'s needles, question and answer "
                          f"({length - room} words)", f"give lengths >= {length - room}")
    slots, offset, first_at = {}, 0, None
    for at, order, words in _place(needles, room, None):
        pos = at + offset
        if order == 0:
            first_at = pos + (bos is not None)
        for j, w in enumerate(words):
            slots[pos + j] = w
        offset += len(words)
    tail = question + answer
    for j, w in enumerate(tail):
        if w is not None:
            slots[n - len(tail) + j] = w
    words = kv_words(n, slots, rng, kv)
    ids = ([bos] if bos is not None else []) + [_kv_token(tokenizer, w) for w in words]
    return ids, first_at, len(answer), " ".join(answer)


def _kv_token(tokenizer, word: str) -> int:
    ids = _encode(tokenizer, word)
    if len(ids) != 1 or ids[0] == getattr(tokenizer, "unk_token_id", None):
        raise ConfigError("--style", f"the kv style's word {word!r} is {len(ids)} tokens here (or unknown)",
                          "use --style ruler with this tokenizer, or a word-level tokenizer of "
                          "ruler.kv_vocabulary() (ruler.kv_tokenizer)")
    return ids[0]


def build_cases(tokenizer, task: str, lengths: Sequence[int], depths: Sequence[float], seed: int = 0,
                samples: int = 1, style: str = "ruler", haystack: Optional[str] = None, sp: int = 1,
                kv: KV = KV()) -> List[RulerCase]:
    """One :class:`RulerCase` per (length, depth, sample) of ``task``, deterministic by ``seed`` (and the task and
    style). ``haystack``: a user's filler text (ruler style), or None for the style's own. ``sp``: every length must
    be divisible by it."""
    if task not in TASKS:
        raise ConfigError("--tasks", f"unknown task {task!r}", f"choose from {', '.join(TASKS)}")
    if style not in STYLES:
        raise ConfigError("--style", f"unknown style {style!r}", f"choose from {', '.join(STYLES)}")
    if style == "kv" and haystack is not None:
        raise ConfigError("--haystack", "the kv style's haystack is its own rule's words", "drop --haystack, or "
                          "use --style ruler")
    check_lengths(lengths, sp)
    cases = []
    for length in lengths:
        for depth in depths:
            for s in range(samples):
                rng = random.Random(f"ruler/{task}/{style}/{seed}/{length}/{depth}/{s}")
                draw = _Draw(style, kv, rng)
                plan = _plan(task, draw, float(depth))
                if style == "kv":
                    ids, first_at, n_answer, answer = _kv_case(tokenizer, task, plan, length, rng, draw, kv)
                else:
                    ids, first_at, n_answer, answer = _ruler_case(tokenizer, task, plan, length, rng, haystack, draw)
                assert len(ids) == length, (len(ids), length)
                cases.append(RulerCase(length=length, depth=float(depth), sample=s, key=" ".join(plan.queries),
                                       input_ids=torch.tensor(ids, dtype=torch.long), answer_start=length - n_answer,
                                       needle_at=first_at, task=task, answer=answer))
    return cases


def parse_tasks(text: str, flag: str = "--tasks") -> List[str]:
    """'single,vt' -> ['single', 'vt']; 'all' -> every task."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return list(TASKS)
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise ConfigError(flag, f"unknown task(s) {', '.join(bad) or repr(text)}",
                          f"choose from {', '.join(TASKS)} (or all)")
    return names


def summary_table(reports: Dict[str, Dict]) -> str:
    """One row per task, one column per length: exact-match accuracy over the task's depths and samples."""
    lengths = sorted({L for r in reports.values() for L in r["lengths"]})
    lines = [["task \\ length"] + [_fmt_len(L) for L in lengths]]
    for task, r in reports.items():
        row = [task]
        for L in lengths:
            mine = [x for x in r["results"] if x["length"] == L]
            row.append(f"{sum(x['exact_match'] for x in mine) / len(mine):.2f}" if mine else "-")
        lines.append(row)
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in lines)


__all__ = ["TASKS", "STYLES", "KV", "RulerCase", "build_cases", "kv_vocabulary", "kv_tokenizer", "kv_rule",
           "kv_words", "parse_tasks", "summary_table"]
