"""Context extension on CPU, end to end, under SP=2: a tiny Llama trained at 64 tokens retrieves a passkey there,
fails at 256 (4x) with and without RoPE scaling, and a short second stage at 256 (--resume --new-stage
--rope-scaling linear:4, 200 steps after stage 1's 500) brings retrieval at 256 back (measured 2026-11-29, 2-core CPU
box, 8 min 39 s: exact match at 256 0.00 before, 0.00 scaled without training, 1.00 after; bench/RESULTS.md).

    python bench/extend_demo.py [--out /tmp/extend_demo] [--results]      # ~10-15 min on a shared 2-core box

Every step is a real launch: `deepspeed --num_gpus 2 train.py` for the two stages and `deepspeed --num_gpus 2
--module ds_longctx.eval.ruler_cli` (SP=2, teacher-forced, the needle test's scoring) for the scores. Writes under
--out the tokenizer, model config, ds_configs, data, checkpoints, logs, the three reports and summary.json;
--results copies the figure (bench/results/extend_demo.png: before / scaled without training / after, side by
side) and the summary (bench/results/extend_demo.json) into the repository.

The task is RULER's passkey in ds_longctx.eval.ruler's "kv" style (one token per word, a word-level tokenizer of
ruler.kv_vocabulary()): a haystack of filler words that follows a fixed second-order rule (each word is a fixed
function of the word two before it), one value word v0..v31 somewhere, and at the end "?", the rule's next word,
then the value. Exact match: the value is the greedy answer. Why this task and not the needle's English passkey
(bench/history/2026-11-29.md "Context extension demo on CPU (2026-11-28)": 5-digit keys over digit tokens, exact
match 0 before and after): what a 2-layer, 0.1M-parameter model learns in a few hundred CPU steps is one attention head that finds
"the value-class word" and copies it (probes of this session: key-value matching among several needles, the
induction circuit, stayed at chance for 600-1500 steps in every variant tried; a 5-digit key needs that circuit for
its digits 2-5). Three choices make that skill learn fast and make the extension visible:

- Half of stage 1's documents are a copy task (32 random values, then the same 32 again): they teach, within a
  hundred steps, an attention head that moves a value's identity (the output half of retrieval); without them the
  passkey's single answer token per document left stage 1 at chance for 400-800 steps. Each passkey document also
  asks about every 16 tokens after the value (the last question ends it, as in the scored cases): more answers of
  signal than 1 per document.
- The haystack's second-order rule makes the model learn a previous-token head (predicting a word takes the word two
  back, i.e. the previous token's previous token), and the question puts one haystack word between "?" and the
  answer, so answering takes knowing that "?" is exactly one word back. Linear RoPE scaling (position
  interpolation) squeezes neighbouring positions to a quarter of the angle that head was trained at: scaled without
  training, the model no longer finds the question (exact match 0), and a short stage relearns it (the known
  behaviour of position interpolation without and with fine-tuning, Chen et al. 2023).
- RoPE base 500 with 16-dim heads: its slowest rotary pair turns about as far over 64 tokens (relative to its
  period) as a Llama 2 pair over 4096 at base 10000 with 128-dim heads. At base 10000 a 64-token model's slow pairs
  barely turn over 64 or 256 tokens, and retrieval at 4x simply extrapolated (probe: 0.95 at 4x); at base 500 the
  positions past 64 are angles the model never saw.

Stage 1: 500 steps of 32 documents at 64 tokens, AdamW lr 3e-3 (ds_configs/tiny-cpu.json's optimizer), ZeRO-1,
ulysses SP=2, no memory stack (a tiny model: the offloads would cost more than they save). Stage 2: 200 steps of 8
passkey documents at 256 tokens (the same tokens per step), the same lr, `--resume ck1 --new-stage --rope-scaling
linear:4`. Scores: 5 depths x 8 documents per length (64 and 256), each exact match over the value; then every
RULER task (kv style) on the stage-2 model. docs/context_extension.md has the probes behind these choices.
"""
import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time

from ds_longctx.eval import needle, ruler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHORT, LONG = 64, 256
KV = ruler.KV()              # keys 64, values 32, variables 16, filler 16: the tokenizer's words
VOCAB = 136                  # the kv vocabulary's 130 words and <unk>, rounded up to a multiple of 8
DEPTHS = "0,0.25,0.5,0.75,1"


def model_config():
    """The tiny Llama: 2 layers, hidden 64, 4 heads of 16, trained at SHORT tokens, RoPE base 500."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "vocab_size": VOCAB, "max_position_embeddings": SHORT, "rope_theta": 500.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attn_implementation": "sdpa"}


def ds_config(micro_batch, lr, seq_len):
    """tiny-cpu.json's optimizer (AdamW, betas 0.9/0.99, no weight decay, clipping 1.0) at the given lr, SP=2 with
    ulysses attention, ZeRO-1, no memory stack."""
    with open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["zero_optimization"] = {"stage": 1}
    cfg["long_context"] = {"sequence_length": seq_len, "attention": {"implementation": "ulysses"}}
    return cfg


def passkey_doc(rng, length):
    """A training document: the value once (in the first half 3 times in 4: long distances), then a question
    "? <rule word> value" every 16 tokens on average after it (the last one ends the document, as the scored cases
    do)."""
    v = f"v{rng.randrange(KV.values)}"
    at = rng.randrange(0, length // 2 if rng.random() < 0.75 else length - 3)
    qs = {length - 3}
    for _ in range(length // 16 - 1):
        q = rng.randrange(at + 1, length - 2)
        if all(abs(q - o) >= 4 for o in qs):
            qs.add(q)
    slots = {at: v}
    for q in qs:
        slots[q], slots[q + 2] = "?", v
    return ruler.kv_words(length, slots, rng, KV)


def copy_doc(rng, length):
    half = [f"v{rng.randrange(KV.values)}" for _ in range(length // 2)]
    return half + half


def write_data(path, length, docs, seed, copy_fraction):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            words = copy_doc(rng, length) if rng.random() < copy_fraction else passkey_doc(rng, length)
            assert len(words) == length
            f.write(json.dumps({"text": " ".join(words)}) + "\n")


def run(cmd, log):
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"  ({time.time() - t0:.0f} s, log {log})", flush=True)
    if rc:
        sys.stdout.write(open(log).read()[-3000:])
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}")
    return time.time() - t0


def by_length(report):
    """Per document length: exact match and answer log-likelihood, means over depths and samples."""
    out = {}
    for n in report["lengths"]:
        mine = [r for r in report["results"] if r["length"] == n]
        out[str(n)] = {"exact_match": round(sum(r["exact_match"] for r in mine) / len(mine), 3),
                       "logprob": round(sum(r["logprob"] for r in mine) / len(mine), 3)}
    return out


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/extend_demo", help="work directory (default /tmp/extend_demo)")
    p.add_argument("--steps1", type=int, default=500, help="stage 1 steps at 64 tokens (default 500)")
    p.add_argument("--steps2", type=int, default=200, help="stage 2 steps at 256 tokens (default 200)")
    p.add_argument("--scaling", default="linear:4", help="stage 2's --rope-scaling (default linear:4)")
    p.add_argument("--samples", type=int, default=8, help="scored documents per length and depth (default 8)")
    p.add_argument("--master-port", type=int, help="the launcher's port (default: a free one)")
    p.add_argument("--results", action="store_true", help="copy the figure and the summary to bench/results/")
    p.add_argument("--dry-run", action="store_true", help="write the inputs and print the commands only")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    o = lambda *n: os.path.join(a.out, *n)  # noqa: E731
    tok = ruler.kv_tokenizer(KV, o("tokenizer"))
    assert len(tok) <= VOCAB
    with open(o("model.json"), "w") as f:
        json.dump(model_config(), f, indent=1)
    scoring = ds_config(1, 1e-3, LONG)
    scoring["zero_optimization"] = {"stage": 0}  # no optimizer when scoring (ZeRO-1 would want one)
    for name, cfg in (("ds1.json", ds_config(32, 3e-3, SHORT)), ("ds2.json", ds_config(8, 3e-3, LONG)),
                      ("ds_eval.json", scoring)):
        with open(o(name), "w") as f:
            json.dump(cfg, f, indent=1)
    write_data(o("train64.jsonl"), SHORT, a.steps1 * 32, "stage1", 0.5)
    write_data(o("train256.jsonl"), LONG, a.steps2 * 8, "stage2", 0.0)
    port = str(a.master_port or free_port())
    ds = ["deepspeed", "--num_gpus", "2", "--master_port", port]
    common = ["--model-config", o("model.json"), "--tokenizer", o("tokenizer"), "--no-progress", "--log-every", "25"]
    stage1 = ds + ["train.py", "--deepspeed_config", o("ds1.json"), *common, "--data", o("train64.jsonl"),
                   "--seq-len", str(SHORT), "--steps", str(a.steps1), "--save", o("ck1"), "--metrics", o("m1.jsonl")]
    stage2 = ds + ["train.py", "--deepspeed_config", o("ds2.json"), *common, "--data", o("train256.jsonl"),
                   "--seq-len", str(LONG), "--steps", str(a.steps1 + a.steps2), "--resume", o("ck1"), "--new-stage",
                   "--rope-scaling", a.scaling, "--save", o("ck2"), "--metrics", o("m2.jsonl")]

    def score(ck, name, tasks="passkey", lengths=f"{SHORT},{LONG}", depths=DEPTHS, samples=a.samples, extra=()):
        return ds + ["--module", "ds_longctx.eval.ruler_cli", "--deepspeed_config", o("ds_eval.json"), "--checkpoint",
                     o(ck), "--tokenizer", o("tokenizer"), "--style", "kv", "--tasks", tasks, "--lengths", lengths,
                     "--depths", depths, "--samples", str(samples), "--json", o(f"{name}.json"), *extra]

    steps = [("stage1", stage1), ("before", score("ck1", "before")),
             ("before_scaled", score("ck1", "before_scaled", extra=["--rope-scaling", a.scaling])),
             ("stage2", stage2), ("after", score("ck2", "after")),
             ("ruler_after", score("ck2", "ruler_after", tasks="all", depths="0,0.5,1", samples=4,
                                   extra=["--heatmap", o("ruler_after.png")]))]
    if a.dry_run:
        for _, cmd in steps:
            print(" ".join(cmd))
        return 0
    for d in ("ck1", "ck2"):
        shutil.rmtree(o(d), ignore_errors=True)
    times = {}
    for name, cmd in steps:
        times[name] = round(run(cmd, o(f"{name}.log")))
    reports = {n: json.load(open(o(f"{n}.json")))["tasks"] for n in ("before", "before_scaled", "after", "ruler_after")}
    panels = [reports[n]["passkey"] for n in ("before", "before_scaled", "after")]
    titles = [f"stage 1 ({a.steps1} steps at {SHORT})", f"stage 1 + {a.scaling}, no training",
              f"stage 2 (+{a.steps2} steps at {LONG}, {a.scaling})"]
    needle.heatmaps(panels, o("extend_demo.png"), titles, suptitle="passkey retrieval (exact match; cells: mean "
                    "answer log-likelihood), SP=2")
    summary = {"machine": "2-core CPU box (shared)", "date": time.strftime("%Y-%m-%d"), "seconds": times,
               "steps1": a.steps1, "steps2": a.steps2, "scaling": a.scaling, "samples_per_cell": a.samples,
               "passkey_by_length": {n: by_length(reports[n]["passkey"]) for n in ("before", "before_scaled", "after")},
               "passkey_cells": {n: reports[n]["passkey"]["cells"] for n in ("before", "before_scaled", "after")},
               "ruler_after": ruler.summary_table(reports["ruler_after"]),
               "ruler_after_by_length": {t: by_length(r) for t, r in reports["ruler_after"].items()},
               "commands": {name: " ".join(cmd) for name, cmd in steps}}
    with open(o("summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["passkey_by_length"], indent=1))
    print(summary["ruler_after"])
    if a.results:
        dst = os.path.join(HERE, "results")
        shutil.copy(o("extend_demo.png"), os.path.join(dst, "extend_demo.png"))
        shutil.copy(o("ruler_after.png"), os.path.join(dst, "extend_demo_ruler.png"))
        shutil.copy(o("summary.json"), os.path.join(dst, "extend_demo.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
