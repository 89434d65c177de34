"""--data at scale: first-start tokenize time and peak RSS, second-start time and RSS, on ~1 GB corpora.

    python bench/data_cache.py                       # 1 GB corpora, writes bench/results/data_cache.json
    python bench/data_cache.py --gb 0.05 --out /tmp/x.json     # a quick look

Corpora are generated locally in --workdir (deleted at the end unless --keep) from the Python sources of the
installed packages (code and docstrings; sorted files, repeated until the size is reached):
  * one-line .txt   newlines replaced by spaces: one document with no line breaks (the worst case of the
                    former whole-file path, issue 30: a 50 MB one-line .txt peaked at 6.24 GiB RSS)
  * many-line .txt  the same text with its newlines (one document)
  * many-line .jsonl one document per source file
  * 50 MB one-line .txt, also through the former whole-file TokenFileDataset (as at c4c4908), whose whole-text
    ids are compared with the cache's (what cutting the text into pieces did to tokenization)
The tokenizer is a byte-level BPE (GPT-2 / Llama-3 style pre-tokenizer, 32,000 tokens) trained here with the
`tokenizers` library on the first 40 MB of the same text. Every start runs in a fresh process; "peak_rss" is
the process' ru_maxrss (VmHWM: imports and mapped file pages included; "rss_after_imports" is what torch +
transformers + ds_longctx + the tokenizer take before the call); "peak_rss_anon" is the peak of RssAnon (private
memory, sampled every 20 ms), against "rss_anon_after_imports". The caches are deleted after each corpus.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GB = 1 << 30


def _pool_files():
    import site

    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    return sorted(f for d in dirs for f in glob.glob(os.path.join(d, "**", "*.py"), recursive=True))


def _texts():
    """The pool's files' texts, in a fixed order, forever."""
    files = _pool_files()
    while True:
        for f in files:
            try:
                with open(f, encoding="utf-8") as fh:
                    t = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            if t.strip():
                yield t


def make_corpora(workdir, size, small, names=None):
    paths = {"one_line_txt": os.path.join(workdir, "one_line.txt"),
             "many_line_txt": os.path.join(workdir, "many_line.txt"),
             "many_line_jsonl": os.path.join(workdir, "many_line.jsonl"),
             "one_line_txt_50mb": os.path.join(workdir, "one_line_50mb.txt")}
    targets = {"one_line_txt": size, "many_line_txt": size, "many_line_jsonl": size, "one_line_txt_50mb": small}
    for name, path in paths.items():
        if names is not None and name not in names:
            continue
        if os.path.exists(path) and os.path.getsize(path) >= targets[name]:
            continue
        n = 0
        with open(path, "w", encoding="utf-8") as f:
            for t in _texts():
                if name.startswith("one_line"):
                    t = t.replace("\r", " ").replace("\n", " ") + " "
                    out = t
                elif name == "many_line_jsonl":
                    out = json.dumps({"text": t}) + "\n"
                else:
                    out = t if t.endswith("\n") else t + "\n"
                f.write(out)
                n += len(out.encode("utf-8"))
                if n >= targets[name]:
                    break
    return paths


def train_tokenizer(workdir, train_bytes=40 << 20):
    out = os.path.join(workdir, "bpe32k")
    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return out, None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def batches():
        n = 0
        for t in _texts():
            yield t
            n += len(t)
            if n >= train_bytes:
                return

    t0 = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(batches(), trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out, round(time.time() - t0, 1)


# ---------------------------------------------------------------------------------------------
# one start, in a fresh process
# ---------------------------------------------------------------------------------------------


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _AnonPeak:
    """The peak of RssAnon (private memory; RSS also counts mapped file pages: the libraries, and the cache
    pages a memory-mapped read touches, which are shared page cache), sampled every 20 ms."""

    def __enter__(self):
        import threading

        self.peak, self.stop = _status("RssAnon"), threading.Event()

        def run():
            while not self.stop.wait(0.02):
                self.peak = max(self.peak, _status("RssAnon"))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def former_token_file_dataset(path, tokenizer, seq_len):
    """The former TokenFileDataset's tokenization (c4c4908, ds_longctx/data.py): the whole .txt read and
    tokenized in one call. Returns the whole-text ids (for the comparison) and the sample count."""
    import torch

    with open(path, "rb") as f:
        texts = [f.read().decode("utf-8")]
    ids = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    data = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return ids, data.shape[0]


def child(args):
    import torch  # noqa: F401
    from transformers import AutoTokenizer

    import ds_longctx.data.corpus  # noqa: F401  (imported before the baseline)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    base = _rss()
    t0 = time.time()
    out = {"rss_after_imports": base, "rss_anon_after_imports": _status("RssAnon")}
    with _AnonPeak() as anon:
        _child_run(args, tok, out, t0)
    out.update(peak_rss_anon=anon.peak, rss_file_at_end=_status("RssFile"))
    print("RESULT " + json.dumps(out), flush=True)


def _child_run(args, tok, out, t0):
    import numpy as np

    from ds_longctx.data.corpus import open_corpus
    from ds_longctx.data.token_cache import data_identity

    if args.child == "former":
        ids, n = former_token_file_dataset(args.data, tok, args.seq_len)
        out.update(seconds=round(time.time() - t0, 2), samples=n, tokens=len(ids), peak_rss=_peak())
        np.asarray(ids, dtype=np.int32).tofile(args.ids_out)
    else:
        ds = open_corpus(args.data, tok, args.seq_len)
        out["peak_rss_at_open"] = _peak()  # before any sample is read (reads map cache pages, counted in RSS)
        t1 = time.time()
        ident = data_identity(args.data)
        t2 = time.time()
        touched = [ds[i]["input_ids"].sum().item() for i in range(0, len(ds), max(1, len(ds) // 64))]
        out.update(seconds=round(t1 - t0, 2), data_identity_seconds=round(t2 - t1, 3),
                   read_64_samples_seconds=round(time.time() - t2, 3), samples=len(ds),
                   tokens=ds.meta["n_tokens"], documents=ds.meta["n_docs"], cuts=ds.meta["cuts"],
                   built_now=ds.meta["built"]["pid"] == os.getpid(), cache=ds.cache, peak_rss=_peak(),
                   sha256=ident["sha256"][:16], checksum=sum(touched))
        out["cache_bytes"] = sum(os.path.getsize(os.path.join(ds.cache, f)) for f in os.listdir(ds.cache))


def run_child(kind, data, tokenizer, seq_len, ids_out=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--data", data, "--tokenizer", tokenizer,
           "--seq-len", str(seq_len)] + (["--ids-out", ids_out] if ids_out else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="true")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} {data}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_seconds"] = round(wall, 2)
    return res


def compare_ids(whole_path, cache, meta_dtype):
    """Whole-text ids vs the cache's: equal, or where they differ."""
    import numpy as np

    whole = np.fromfile(whole_path, dtype=np.int32).astype(np.int64)
    got = np.fromfile(os.path.join(cache, "tokens.bin"), dtype=meta_dtype).astype(np.int64)
    out = {"whole_text_tokens": int(whole.size), "cached_tokens": int(got.size)}
    if whole.size == got.size:
        diff = np.flatnonzero(whole != got)
        out.update(equal=bool(diff.size == 0), differing_positions=int(diff.size))
    else:
        n = min(whole.size, got.size)
        first = np.flatnonzero(whole[:n] != got[:n])
        out.update(equal=False, first_difference=int(first[0]) if first.size else n)
    return out


def gib(b):
    return round(b / GB, 3)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="size of the large corpora in GiB (default 1)")
    p.add_argument("--small-mb", type=float, default=50.0, help="size of the one-line file compared with the "
                   "former whole-file path, MiB (default 50)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--workdir", default="/tmp/ds_longctx_data_bench")
    p.add_argument("--keep", action="store_true", help="keep the corpora, the tokenizer and the caches")
    p.add_argument("--skip-former", action="store_true", help="do not run the former whole-file path")
    p.add_argument("--only", help="comma-separated corpora to run (one_line_txt_50mb, one_line_txt, many_line_txt, "
                   "many_line_jsonl); default all")
    p.add_argument("--out", default=os.path.join(HERE, "results", "data_cache.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--ids-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    tok_dir, train_s = train_tokenizer(args.workdir)
    only = args.only.split(",") if args.only else None
    paths = make_corpora(args.workdir, int(args.gb * GB), int(args.small_mb * (1 << 20)), only)
    rows = {"tokenizer": {"kind": "byte-level BPE, 32,000 tokens, trained here on 40 MB of the same sources",
                          "train_seconds": train_s}, "corpora_seconds": round(time.time() - t0, 1), "runs": {}}
    print(json.dumps(rows), flush=True)
    order = ["one_line_txt_50mb", "one_line_txt", "many_line_txt", "many_line_jsonl"]
    if only:
        order = [n for n in order if n in only]
    for name in order:
        path = paths[name]
        first = run_child("new", path, tok_dir, args.seq_len)
        second = run_child("new", path, tok_dir, args.seq_len)
        assert first["built_now"] and not second["built_now"] and first["checksum"] == second["checksum"]
        row = {"file_bytes": os.path.getsize(path), "first_start": first, "second_start": second}
        for k in ("first_start", "second_start"):
            r = row[k]
            for key in ("peak_rss", "rss_after_imports", "peak_rss_at_open", "peak_rss_anon", "rss_anon_after_imports"):
                if key in r:
                    r[key + "_gib"] = gib(r[key])
        rows["runs"][name] = row
        print(name, json.dumps(row), flush=True)
        if name == "one_line_txt_50mb" and not args.skip_former:
            ids_out = os.path.join(args.workdir, "whole_ids.i32")
            former = run_child("former", path, tok_dir, args.seq_len, ids_out=ids_out)
            former["peak_rss_gib"] = gib(former["peak_rss"])
            meta = json.load(open(os.path.join(first["cache"], "meta.json")))
            row["former_whole_file"] = former
            row["cut_vs_whole_text"] = compare_ids(ids_out, first["cache"], meta["dtype"])
            print("former", json.dumps(former), json.dumps(row["cut_vs_whole_text"]), flush=True)
        shutil.rmtree(first["cache"], ignore_errors=True)  # the caches are as large as the token count
    rows["total_seconds"] = round(time.time() - t0, 1)
    record = {"command": "python bench/data_cache.py " + " ".join(a for a in sys.argv[1:]),
              "machine": f"2-core x86_64 CPU VM shared by 5 agents ({platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores visible)", "date": time.strftime("%Y-%m-%d"), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
