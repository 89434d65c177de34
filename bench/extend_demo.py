"""Context extension on CPU, end to end: a tiny Llama trained at 256 tokens, extended to 1024 (RoPE linear:4, a
second stage with --resume --new-stage, SP=2), the needle heatmap (ds-longctx needle) before and after.

    python bench/extend_demo.py [--out /tmp/extend_demo] [--steps1 N] [--steps2 N]

The data is the needle test's own format (ds_longctx.eval.needle.build_cases): a haystack, the fact "The secret passkey
is 48213. Remember it. 48213 is the secret passkey." at a random depth, the question "What is the secret passkey?
The secret passkey is" and the answer. The tokenizer is a small word-level one written here (digits one token each;
the filler's words never occur in the fact or the question), so "passkey is" marks the key and the answer is a
clean copy of it. Each training document's haystack is its own random run of filler words repeated (so a model
that copies earlier text predicts the filler as well: the same skill the needle needs, learned in a few hundred
steps); the needle test's haystack is one more such text (--haystack, another seed). Writes under --out: the
tokenizer, the model config, the data, the two checkpoints and the needle JSON/PNGs; copies the figures to
bench/results/ with --results.
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

from ds_longctx.eval import needle

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEMPLATE = sorted({w for t in (needle.FACT, needle.QUESTION) for w in t.replace("{key}", "").replace(".", " ")
                   .replace("?", " ").split()})
FILLER_WORDS = ("red green blue gray gold pink dark pale cold warm wet dry old new big small tall short far near "
                "hill tree lake road town moon star sand rock leaf bird fish wolf bear fox owl rain snow wind fire "
                "runs sits flies sings glows falls grows").split()
SHORT, LONG = 256, 1024
PERIOD = tuple(int(x) for x in os.environ.get("EXTEND_DEMO_PERIOD", "4,12").split(","))


def make_tokenizer(path):
    """A word-level tokenizer (saved to ``path``): the template's words, the filler's, digits and punctuation."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert not set(FILLER_WORDS) & set(TEMPLATE)
    words = ["<unk>"] + TEMPLATE + FILLER_WORDS + [str(d) for d in range(10)] + [".", "?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def haystack_text(seed):
    """A random run of 16-48 filler words (needle.build_cases repeats it to fill the document)."""
    rng = random.Random(f"haystack/{seed}")
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(*PERIOD)))


def train_doc_ids(tok, length, i):
    """Training document ``i``: a needle case of ``length`` tokens at a random depth (its own haystack and key)."""
    rng = random.Random(f"train/{i}")
    case = needle.build_cases(tok, [length], [rng.random()], seed=1_000_000 + i, haystack=haystack_text(i))[0]
    return case.input_ids.tolist()


def model_config(vocab):
    """The tiny Llama: trained at SHORT tokens (its max_position_embeddings), RoPE base 10000."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "vocab_size": vocab, "max_position_embeddings": SHORT, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attn_implementation": "sdpa"}


def ds_config(micro_batch):
    """ds_configs/tiny-cpu.json's optimizer (AdamW, constant lr 3e-3) at SP=2 with ulysses attention, ZeRO-1 and no
    memory stack: a tiny model on a shared 2-core box (the full stack's offload and tiling took ~10 s a step)."""
    with open(os.path.join(ROOT, "ds_configs", "tiny-cpu.json")) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["zero_optimization"] = {"stage": 1}
    cfg["long_context"] = {"sequence_length": SHORT, "attention": {"implementation": "ulysses"}}
    return cfg


def write_data(tok, path, length, docs, first):
    with open(path, "w") as f:
        for i in range(first, first + docs):
            ids = train_doc_ids(tok, length, i)
            text = tok.decode(ids)
            assert tok.encode(text) == ids, "the word-level text does not round-trip"
            f.write(json.dumps({"text": text}) + "\n")


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


def by_length(path):
    """Per document length: exact match, token accuracy and answer log-likelihood, means over depths and samples."""
    with open(path) as f:
        rows = json.load(f)["results"]
    out = {}
    for n in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == n]
        out[str(n)] = {k: round(sum(float(r[k]) for r in mine) / len(mine), 3)
                       for k in ("exact_match", "token_accuracy", "logprob")}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/extend_demo", help="work directory (default /tmp/extend_demo)")
    p.add_argument("--steps1", type=int, default=1500, help="stage 1 steps at 256 tokens (default 1500)")
    p.add_argument("--steps2", type=int, default=150, help="stage 2 steps at 1024 tokens (default 150)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--scaling", default="linear:4", help="stage 2's --rope-scaling (default linear:4)")
    p.add_argument("--samples", type=int, default=4, help="needle documents per cell (default 4)")
    p.add_argument("--results", action="store_true", help="copy the heatmaps and the summary to bench/results/")
    p.add_argument("--dry-run", action="store_true", help="write the inputs and print the commands only")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    o = lambda *n: os.path.join(a.out, *n)  # noqa: E731
    tok = make_tokenizer(o("tokenizer"))
    vocab = 128
    assert len(tok) <= vocab
    with open(o("model.json"), "w") as f:
        json.dump(model_config(vocab), f, indent=1)
    with open(o("ds.json"), "w") as f:
        json.dump(ds_config(a.micro_batch), f, indent=1)
    with open(o("haystack.txt"), "w") as f:
        f.write(haystack_text("needle") + "\n")
    write_data(tok, o("train256.jsonl"), SHORT, a.steps1 * a.micro_batch, 0)
    write_data(tok, o("train1024.jsonl"), LONG, a.steps2 * a.micro_batch, 10_000_000)
    with socket.socket() as sock:  # a free port for the launcher (not DeepSpeed's default 29500)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ds = ["deepspeed", "--num_gpus", "2", "--master_port", str(port)]
    common = ["--deepspeed_config", o("ds.json"), "--model-config", o("model.json"), "--tokenizer", o("tokenizer"),
              "--no-progress", "--log-every", "25"]
    stage1 = ds + ["train.py", *common, "--data", o("train256.jsonl"), "--seq-len", str(SHORT),
                   "--steps", str(a.steps1), "--save", o("ck1"), "--metrics", o("m1.jsonl")]
    stage2 = ds + ["train.py", *common, "--data", o("train1024.jsonl"), "--seq-len", str(LONG),
                   "--steps", str(a.steps1 + a.steps2), "--resume", o("ck1"), "--new-stage",
                   "--rope-scaling", a.scaling, "--save", o("ck2"), "--metrics", o("m2.jsonl")]

    def needle_cmd(ck, name, extra=()):
        return [sys.executable, "-m", "ds_longctx.eval.needle_cli", "--checkpoint", o(ck), "--tokenizer", o("tokenizer"),
                "--haystack", o("haystack.txt"), "--lengths", f"{SHORT},{LONG}", "--depths", "0,0.25,0.5,0.75,1",
                "--samples", str(a.samples), "--json", o(f"{name}.json"), "--heatmap", o(f"{name}.png"), *extra]

    steps = [("stage1", stage1), ("needle_before", needle_cmd("ck1", "needle_before")),
             ("needle_before_scaled", needle_cmd("ck1", "needle_before_scaled", ["--rope-scaling", a.scaling])),
             ("stage2", stage2), ("needle_after", needle_cmd("ck2", "needle_after"))]
    if a.dry_run:
        for _, cmd in steps:
            print(" ".join(cmd))
        return 0
    for d in ("ck1", "ck2"):
        shutil.rmtree(o(d), ignore_errors=True)
    times = {name: round(run(cmd, o(f"{name}.log"))) for name, cmd in steps}
    summary = {"seconds": times, "steps1": a.steps1, "steps2": a.steps2, "scaling": a.scaling,
               "micro_batch": a.micro_batch, "samples_per_cell": a.samples,
               "by_length": {n: by_length(o(f"{n}.json")) for n in ("needle_before", "needle_before_scaled",
                                                                   "needle_after")},
               "commands": {name: " ".join(cmd) for name, cmd in steps}}
    with open(o("summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["by_length"], indent=1))
    if a.results:
        dst = os.path.join(HERE, "results")
        for n in ("needle_before", "needle_before_scaled", "needle_after"):
            shutil.copy(o(f"{n}.png"), os.path.join(dst, f"extend_demo_{n}.png"))
        shutil.copy(o("summary.json"), os.path.join(dst, "extend_demo_cpu.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
