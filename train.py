"""ds_longctx's main job: train a causal LM on long sequences with DeepSpeed.

    deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/tiny-cpu.json          # CPU demo
    deepspeed train.py --deepspeed_config ds_configs/llama3-8b-5m.json --model meta-llama/Llama-3.1-8B

The embedded default (no download) is a small Llama preset on the long-range copy task: a random
block then its copy, so the loss can only fall below ln(vocab-2) if attention reaches across
sequence shards. The same --seed gives the same weights and data for every SP degree, ZeRO stage
and process count.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import math
import os
import sys
import zipfile

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL_CONFIG = os.path.join(HERE, "ds_configs", "models", "tiny-llama.json")


def _logger():
    """train.py's lines on stdout under the ``ds_longctx`` logger (quiet them all with
    ``logging.getLogger("ds_longctx").setLevel(logging.WARNING)``)."""
    log = logging.getLogger("ds_longctx.train")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[ds_longctx] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        if logging.getLogger("ds_longctx").level == logging.NOTSET:
            logging.getLogger("ds_longctx").setLevel(logging.INFO)
    return log


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="the ds_config.json: DeepSpeed's keys plus the long_context section (see ds_configs/)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model id or local path (pretrained weights)")
    src.add_argument("--model-config", help="local HF config.json: random init (default: the tiny preset)")
    p.add_argument("--tokenizer", help="tokenizer for --data files (default: --model)")
    p.add_argument("--seq-len", type=int, default=None, help="global tokens per sample (default: "
                   "long_context.sequence_length or 512)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init and the copy task's data: the same "
                   "seed gives the same weights and samples for every SP degree, ZeRO stage and process count")
    p.add_argument("--data", default="copy", help="built-in task name ('copy') or a .jsonl/.txt file")
    p.add_argument("--concat-documents", action="store_true", help="--data FILE: plain concatenation, attention "
                   "across documents (default: packed, position_ids restart per document, document-masked attention)")
    p.add_argument("--metrics", help="write one JSON object per step to this file (rank 0)")
    p.add_argument("--save", help="save a checkpoint here at the end")
    p.add_argument("--resume", help="resume from a checkpoint saved with --save")
    p.add_argument("--eval-samples", type=int, default=8, help="held-out samples for the task accuracy")
    p.add_argument("--allow-beyond-max-position", action="store_true", help="train with --seq-len above the "
                   "model's max_position_embeddings on purpose (context extension); refused otherwise")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (rank 0 still logs the layout "
                   "and the final loss)")
    return p.parse_args(argv)


def _config_error(key, problem, fix):
    from ds_longctx.errors import ConfigError

    return ConfigError(key, problem, fix)


def _check_writable_file(flag, path):
    """``path`` can be created or overwritten by this process."""
    if os.path.isdir(path):
        raise _config_error(flag, f"{path!r} is a directory", "give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _config_error(flag, f"directory {parent!r} does not exist", f"create it (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise _config_error(flag, f"{path!r} is not writable", "give a path this user can write")


def _model_config_path(path):
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def validate_args(args, lc):
    """Every CLI value, checked on every rank before any collective (a rank that raised alone would
    leave the others waiting). Returns the sequence length."""
    from ds_longctx.data import TASKS

    sp = lc.sequence_parallel_size
    if args.steps < 1:
        raise _config_error("--steps", f"must be >= 1, got {args.steps}", "give the number of optimizer steps")
    if args.seed < 0:
        raise _config_error("--seed", f"must be >= 0, got {args.seed}", "give a non-negative seed")
    if args.eval_samples < 0:
        raise _config_error("--eval-samples", f"must be >= 0, got {args.eval_samples}", "use 0 to skip the eval")
    seq_len = args.seq_len if args.seq_len is not None else (lc.sequence_length or 512)
    flag = "--seq-len" if args.seq_len is not None else "long_context.sequence_length"
    if seq_len < 1:
        raise _config_error(flag, f"must be >= 1, got {seq_len}", "give the global tokens per sample")
    if seq_len % sp:
        raise _config_error(flag, f"{seq_len} is not divisible by sequence_parallel_size={sp}",
                            f"use a multiple of {sp}, e.g. {(seq_len // sp + 1) * sp}")
    if args.data in TASKS:
        if args.data == "copy" and (seq_len < 4 or seq_len % 2):
            raise _config_error(flag, f"the copy task needs an even length >= 4, got {seq_len}",
                                "use an even sequence length")
    else:
        if not os.path.isfile(args.data):
            raise _config_error("--data", f"{args.data!r} is neither a task ({sorted(TASKS)}) nor an existing file",
                                "give a task name or the path of a .txt/.jsonl file")
        if not args.data.endswith((".txt", ".jsonl")):
            raise _config_error("--data", f"unsupported file type {args.data!r}", "use a .txt or .jsonl file")
        if not (args.tokenizer or args.model):
            raise _config_error("--data", "a file needs a tokenizer", "pass --tokenizer (or --model)")
    if args.model_config is not None and not os.path.isfile(_model_config_path(args.model_config)):
        raise _config_error("--model-config", f"{_model_config_path(args.model_config)!r} does not exist",
                            "give the path of a HF config.json (or a directory holding one)")
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        _check_local_or_hub(flag, value)
    if lc.profile.enabled:
        _check_writable_dir("long_context.profile.output_dir", lc.profile.output_dir)
    if args.metrics:
        _check_writable_file("--metrics", args.metrics)
    if args.save:
        if os.path.exists(args.save) and not os.path.isdir(args.save):
            raise _config_error("--save", f"{args.save!r} exists and is not a directory", "give a directory")
        existing = os.path.abspath(args.save)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.access(existing, os.W_OK | os.X_OK):
            raise _config_error("--save", f"{existing!r} is not writable", "give a directory this user can write")
    if args.resume:
        find_resume_tag(args.resume)  # raises when there is no usable checkpoint
    from ds_longctx.config import check_shards

    check_shards(lc, seq_len)  # against the length trained (--seq-len), not only the config's sequence_length
    return seq_len


def _check_local_or_hub(flag, value):
    """A value that can only be a local path (absolute, ./ ../ ~, or more than one '/': a hub id is
    'org/name') must exist; otherwise transformers reports 'Repo id must be in the form ...'."""
    if not value or os.path.exists(os.path.expanduser(value)):
        return
    if os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1:
        raise _config_error(flag, f"local path {value!r} does not exist", "give an existing model directory, or a "
                            "hub id of the form 'org/name'")


def hub_load(flag, name, load):
    """``load()`` (a transformers ``from_pretrained``) with its OSError (offline, hub unreachable, gated or private
    repo, no such id: transformers raises OSError for each) turned into one ConfigError naming the id and the
    ways to run without the hub."""
    try:
        return load()
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        if flag == "--tokenizer":
            local = "--tokenizer <local tokenizer directory> (or a --model directory that holds one)"
        else:
            local = ("--model-config path/to/config.json (random init, e.g. ds_configs/models/llama3-8b.json) or "
                     "--model <local model directory>")
        raise _config_error(flag, f"{name!r} is not a local directory and could not be loaded from the Hugging Face "
                            f"hub: the hub is unreachable{' (HF_HUB_OFFLINE is set)' if offline else ''}, the repo "
                            f"is gated or private, or the id does not exist (transformers: {first[:300]})",
                            f"pass {local}; or point HF_HOME at a cache that holds it; for a gated repo accept its "
                            "license on huggingface.co and log in (`huggingface-cli login`, or set HF_TOKEN)"
                            ) from None


def _check_writable_dir(key, path):
    """``path`` exists as a writable directory or can be created (checked at start, not at step 2)."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise _config_error(key, f"{existing!r} is not a directory", "give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _config_error(key, f"{existing!r} is not writable by this user", "give a directory this user can write")


def check_max_position(args, model_config, seq_len):
    """--seq-len above the model's max_position_embeddings is refused unless asked for: RoPE models run but
    see positions they were never trained on (RoPE-scaled configs already state their scaled length)."""
    from ds_longctx.models import text_config

    mpe = getattr(text_config(model_config), "max_position_embeddings", None)
    if isinstance(mpe, int) and seq_len > mpe and not args.allow_beyond_max_position:
        flag = "--seq-len" if args.seq_len is not None else "long_context.sequence_length"
        raise _config_error(flag, f"{seq_len} is above the model's max_position_embeddings {mpe}",
                            f"use at most {mpe}, set rope_scaling/max_position_embeddings in the model config, or pass "
                            "--allow-beyond-max-position to train past it on purpose (context extension)")


# ---------------------------------------------------------------------------------------------
# the checkpoint's layout: a resume must run the same layout (same data order, same partitions)
# ---------------------------------------------------------------------------------------------

LAYOUT_FILE = "ds_longctx_layout.json"
# what must match for a resume to continue the same run (data position is where to continue)
LAYOUT_KEYS = ("world_size", "sequence_parallel_size", "data_parallel_size", "seq_len", "micro_batch",
               "gradient_accumulation_steps", "seed", "data", "concat_documents", "batches_per_epoch")
LAYOUT_DEFAULTS = {"concat_documents": False}
LAYOUT_FLAGS = {"world_size": "the number of processes", "sequence_parallel_size": "sequence_parallel_size",
                "data_parallel_size": "world / sequence_parallel_size", "seq_len": "--seq-len",
                "micro_batch": "train_micro_batch_size_per_gpu", "gradient_accumulation_steps":
                "gradient_accumulation_steps", "seed": "--seed", "data": "--data",
                "concat_documents": "--concat-documents (given or not)",
                "batches_per_epoch": "--data (the dataset's size)"}


MODEL_KEYS = ("model_type", "layers", "heads", "kv_heads", "head_dim", "hidden", "vocab")


def model_facts(model_config):
    """The shape facts a checkpoint must share with the model it is loaded into."""
    from ds_longctx.models import text_config

    tc = text_config(model_config)
    heads = getattr(tc, "num_attention_heads", None)
    hidden = getattr(tc, "hidden_size", None)
    head_dim = getattr(tc, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return {"model_type": getattr(tc, "model_type", None), "layers": getattr(tc, "num_hidden_layers", None),
            "heads": heads, "kv_heads": getattr(tc, "num_key_value_heads", None) or heads, "head_dim": head_dim,
            "hidden": hidden, "vocab": getattr(tc, "vocab_size", None)}


def _tag_files(tag_dir):
    """{relative path: size} of every file of a saved tag (the layout record excepted)."""
    out = {}
    for root, _, names in os.walk(tag_dir):
        for n in names:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, tag_dir)
            if rel != LAYOUT_FILE:
                out[rel] = os.path.getsize(full)
    return out


def _atomic_write(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# Test hook (tests and bench/fault_rerun.py only): DS_LONGCTX_TEST_KILL_AT="RANK:POINT" makes that rank
# SIGKILL itself when save_checkpoint reaches POINT, so that a kill at each point of the save is deterministic.
# Unset (always, outside tests), it changes nothing: the save runs without any wrapper.
TEST_KILL_ENV = "DS_LONGCTX_TEST_KILL_AT"
SAVE_POINTS_RANK0 = ("before_fileN", "after_fileN", "after_files", "before_record", "after_record",
                     "after_latest")
SAVE_POINTS_OTHER = ("before_fileN", "after_fileN", "after_files", "done")  # only rank 0 writes record/latest


def _kill_point(rank, point):
    if os.environ.get(TEST_KILL_ENV) == f"{rank}:{point}":
        import signal

        _flush_std()
        os.write(2, f"[rank {rank}] ds_longctx test hook: SIGKILL at {point}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def _flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def save_checkpoint(engine, path, tag, record, rank):
    """Save ``tag`` under ``path`` so that a save killed at any point leaves ``latest`` on a complete tag.

    Order: every rank's DeepSpeed files (``save_latest=False``), a barrier, the layout record (rank 0:
    the run's layout, the model's shape facts and each file's size, written to a temporary file and
    renamed), then ``latest`` (the same way), then a barrier. ``--resume`` loads ``latest`` when it is
    complete (its record exists and every listed file has its size and opens as a torch archive), else the
    newest complete tag, and says why (see :func:`find_resume_tag`).

    Files take the user's umask (0644 files in 0755 directories under the usual 022): on a shared machine
    set ``umask 077`` before training, or save into a directory only you can read. Load only checkpoints
    you trust: DeepSpeed's loader unpickles them (``torch.load(weights_only=False)``)."""
    ce = engine.checkpoint_engine
    hooked = os.environ.get(TEST_KILL_ENV)
    if hooked:  # test hook: a kill point before and after each file DeepSpeed writes on this rank
        counter = itertools.count(1)
        original, own = ce.save, "save" in vars(ce)

        def save(*a, **k):  # DeepSpeed calls it positionally and with state_dict=, path=
            n = next(counter)
            _kill_point(rank, f"before_file{n}")
            out = original(*a, **k)
            _kill_point(rank, f"after_file{n}")
            return out

        ce.save = save
    try:
        engine.save_checkpoint(path, tag=tag, client_state={"step": record["step"], "ds_longctx_layout": record},
                               save_latest=False)
    finally:
        if hooked:  # undo: the engine's own save again
            if own:
                ce.save = original
            else:
                del ce.save
    _kill_point(rank, "after_files")
    dist.barrier()
    if rank == 0:
        tag_dir = os.path.join(path, tag)
        _kill_point(rank, "before_record")
        _atomic_write(os.path.join(tag_dir, LAYOUT_FILE), json.dumps(dict(record, files=_tag_files(tag_dir)),
                                                                     indent=1))
        _kill_point(rank, "after_record")
        _atomic_write(os.path.join(path, "latest"), tag)
        _kill_point(rank, "after_latest")
    dist.barrier()
    _kill_point(rank, "done")


def check_tag(path, tag):
    """(record, None) for a complete, readable tag, else (None, the problem naming its file)."""
    tag_dir = os.path.join(path, tag)
    if not os.path.isdir(tag_dir):
        return None, f"tag directory {tag_dir!r} does not exist"
    rec_path = os.path.join(tag_dir, LAYOUT_FILE)
    if not os.path.isfile(rec_path):
        return None, (f"{rec_path!r} is missing (the save did not finish, or the checkpoint was not saved by this "
                      "train.py)")
    try:
        with open(rec_path) as f:
            record = json.load(f)
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{rec_path!r} is not a valid layout record ({e})"
    files = record.get("files")
    if isinstance(files, dict):
        for rel, size in sorted(files.items()):
            full = os.path.join(tag_dir, rel)
            if not os.path.isfile(full):
                return None, f"{full!r} is missing"
            if os.path.getsize(full) != size:
                return None, f"{full!r} has {os.path.getsize(full)} bytes, {size} were saved (truncated or replaced)"
    for rel in sorted(files if isinstance(files, dict) else _tag_files(tag_dir)):
        full = os.path.join(tag_dir, rel)
        if rel.endswith((".pt", ".bin")):
            try:  # torch.save's zip archive: reading its directory catches truncation and foreign bytes cheaply
                zipfile.ZipFile(full).close()
            except (zipfile.BadZipFile, OSError) as e:
                return None, f"{full!r} is not a readable torch checkpoint file ({e})"
    return record, None


def find_resume_tag(path):
    """(tag, record, note) of the checkpoint --resume loads: the tag in ``latest`` when it is complete and
    readable, else the newest complete tag (``note`` says why and which); a ConfigError when none is."""
    if not os.path.isdir(path):
        raise _config_error("--resume", f"{path!r} holds no checkpoint (no such directory)",
                            "give the directory passed to --save")
    latest = os.path.join(path, "latest")
    problem = None
    tag = None
    if os.path.isfile(latest):
        try:
            with open(latest) as f:
                tag = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            problem = f"{latest!r} cannot be read ({e})"
        if tag is not None:
            if not tag or os.sep in tag:
                problem = f"{latest!r} does not name a tag (holds {tag!r})"
            else:
                record, problem = check_tag(path, tag)
                if problem is None:
                    return tag, record, None
    candidates = []
    for name in os.listdir(path):
        if name == tag or not os.path.isdir(os.path.join(path, name)):
            continue
        record, _ = check_tag(path, name)
        if record is not None:
            candidates.append((int(record.get("step", -1)), name, record))
    if not candidates:
        if problem is None:
            raise _config_error("--resume", f"{path!r} holds no checkpoint (no 'latest' file)",
                                "give the directory passed to --save")
        raise _config_error("--resume", f"checkpoint {tag!r} in {path!r}: {problem}, and no other complete checkpoint "
                            "is there", "resume a complete checkpoint saved by train.py --save, or start a new run")
    step, best, record = max(candidates)
    why = problem or "there is no 'latest' file"
    note = (f"--resume: {why}; resuming from {os.path.join(path, best)!r} (step {step}), the newest complete "
            "checkpoint")
    return best, record, note


def read_checkpoint_layout(path):
    """The layout record of the checkpoint --resume would load from ``path``."""
    return find_resume_tag(path)[1]


def check_resume_model(saved, current, path):
    """A checkpoint of another model is refused before any tensor is loaded (same shapes with other head
    counts would otherwise load silently)."""
    saved_model = saved.get("model")
    if not isinstance(saved_model, dict):
        return  # an older record: DeepSpeed's loader checks the tensor shapes
    diffs = [k for k in MODEL_KEYS if saved_model.get(k) != current.get(k)]
    if diffs:
        what = ", ".join(f"{k} {saved_model.get(k)!r} in the checkpoint vs {current.get(k)!r} now" for k in diffs)
        raise _config_error("--resume", f"{path} holds a different model: {what}",
                            "resume with the model (--model / --model-config) the checkpoint was saved with")


def check_resume_layout(saved, current, path):
    # a key missing from an older record means its default (concat_documents: False)
    saved = {k: saved.get(k, LAYOUT_DEFAULTS.get(k)) for k in LAYOUT_KEYS}
    diffs = [k for k in LAYOUT_KEYS if k in current and saved[k] != current[k]]
    if diffs:
        what = ", ".join(f"{k} {saved[k]!r} in the checkpoint vs {current[k]!r} now" for k in diffs)
        fix = ", ".join(f"{LAYOUT_FLAGS[k]} = {saved[k]!r}" for k in diffs)
        raise _config_error("--resume", f"{path} was saved with a different layout: {what} (a resumed run must "
                            "see the same samples in the same order and the same ZeRO partitions)",
                            f"resume with {fix}, or start a new run without --resume")


def micro_batches(loader, start):
    """Micro batches from position ``start`` (micro batches this rank consumed before), epoch after
    epoch (``loader.set_epoch``). Nothing is kept: ``itertools.cycle`` held every batch it yielded."""
    n = len(loader)
    epoch, skip = divmod(start, n)
    while True:
        loader.set_epoch(epoch)
        yield from itertools.islice(iter(loader), skip, None)
        skip, epoch = 0, epoch + 1


def host_rss_bytes():
    """Current (not peak) resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def load_model_config(path):
    """The HF config of ``--model-config`` (a config.json or a directory holding one)."""
    from ds_longctx.models.loading import load_model_config as load

    return load(path)


def build_model(args, ds_config):
    import ds_longctx
    from ds_longctx.weights import deterministic_init
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with ds_longctx.model_init(ds_config):
        if args.model:
            return hub_load("--model", args.model, lambda: AutoModelForCausalLM.from_pretrained(
                args.model, attn_implementation="sdpa"))
        cfg = load_model_config(args.model_config or DEFAULT_MODEL_CONFIG)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation)
    deterministic_init(model, args.seed)  # same weights for every SP degree, ZeRO stage, process count
    return model


def build_dataset(args, model_config, seq_len):
    from ds_longctx.data import TASKS, TokenFileDataset

    if args.data in TASKS:
        return TASKS[args.data](seq_len=seq_len, vocab_size=model_config.vocab_size, seed=args.seed)
    from transformers import AutoTokenizer

    from ds_longctx.models import text_config

    name = args.tokenizer or args.model
    # the tokenizer is checked against the embedding before the engine starts (an id past it is an
    # IndexError deep in the forward); the error names the largest id it produced from the file
    tokenizer = hub_load("--tokenizer" if args.tokenizer else "--model", name,
                         lambda: AutoTokenizer.from_pretrained(name))
    return TokenFileDataset(args.data, tokenizer, seq_len,
                            documents=not args.concat_documents, vocab_size=text_config(model_config).vocab_size,
                            tokenizer_name=name)


def _reserve_nvme(engine, model_config, seq_len, micro, ds_config):
    """offload='nvme': reserve every rank's bytes on its drive before step 1 (its offloaded layer inputs, and the
    attention outputs and LSEs keep_attention_output sends with them), agreed over the job (a full drive is one
    clear error on every rank, not a failed write at step 1). The byte counts are the planner's."""
    from ds_longctx.memory import get_memory_handle, naming_nvme_keys
    from ds_longctx.memory.keep import kept_attention_layers
    from ds_longctx.memory.nvme import ALIGN, NVMeTarget, _align, reserve_on_every_rank
    from ds_longctx.planner.host import kept_attention_bytes, layer_input_bytes
    from ds_longctx.planner.model_states import _DTYPE_BYTES, model_dtype

    handle = get_memory_handle(engine)
    target = getattr(getattr(handle, "offloader", None), "target", None)
    if not isinstance(target, NVMeTarget):
        return
    lc = engine.long_context  # its "auto" values resolved by initialize
    ac = lc.activation_checkpointing
    layers = len(handle.checkpointed_layers)
    offloaded = max(0, layers - ac.keep_on_device)
    kept = min(kept_attention_layers(ac.keep_attention_output, layers), offloaded)  # the first layers keep theirs
    per_input = _align(layer_input_bytes(model_config, ds_config, lc, seq_len, micro))
    # output and LSE, each in its own aligned slot
    per_kept = kept_attention_bytes(model_config, lc, seq_len, micro, _DTYPE_BYTES[model_dtype(ds_config)]) + 2 * ALIGN
    with naming_nvme_keys():  # the same ConfigError on every rank, naming nvme_path
        reserve_on_every_rank(target, offloaded * per_input + kept * per_kept)


@torch.no_grad()
def copy_accuracy(engine, dataset, n, sp_rank, sp_size, group, start_index):
    """Argmax accuracy on scored tokens of held-out samples (the SP group evaluates together)."""
    from ds_longctx.data import shard_batch
    from ds_longctx.loss import IGNORE_INDEX

    engine.eval()
    correct = total = 0
    for i in range(n):
        item = dataset[start_index + i]
        batch = shard_batch({k: v.unsqueeze(0) for k, v in item.items()}, sp_rank, sp_size)
        logits = engine(input_ids=batch["input_ids"].to(engine.device),
                        position_ids=batch["position_ids"].to(engine.device), use_cache=False).logits
        target = batch["shift_labels"].to(logits.device)
        valid = target != IGNORE_INDEX
        correct += int((logits.argmax(-1)[valid] == target[valid]).sum())
        total += int(valid.sum())
    engine.train()
    t = torch.tensor([correct, total], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return float(t[0] / max(t[1], 1))


def _resolved_config(ds_config: dict, lc) -> dict:
    """``ds_config`` with the "auto" values initialize resolved (``engine.long_context``) written in."""
    import copy

    cfg = copy.deepcopy(ds_config)
    sec = cfg.get("long_context") or {}
    for part, key in (("attention", "heads_per_chunk"), ("activation_checkpointing", "keep_attention_output"),
                      ("activation_checkpointing", "keep_on_device")):
        if (sec.get(part) or {}).get(key) == "auto":
            sec[part][key] = getattr(getattr(lc, part), key)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    import ds_longctx
    from ds_longctx import comm
    from ds_longctx.config import load_ds_config, parse
    from ds_longctx.measure.profiler import StepProfiler
    from ds_longctx.planner import planned_work

    ds_config = load_ds_config(args.deepspeed_config)
    lc = parse(ds_config)
    seq_len = validate_args(args, lc)  # every rank, before the first collective
    if not args.model:  # a config far beyond the model (the tiny preset given an 8B config): say so now
        from ds_longctx.compat import check_model_scale

        model_config = load_model_config(args.model_config or DEFAULT_MODEL_CONFIG)
        check_model_scale(lc, model_config, seq_len,
                          f"--model-config {args.model_config}" if args.model_config else None)
    else:
        from transformers import AutoConfig

        model_config = hub_load("--model", args.model, lambda: AutoConfig.from_pretrained(args.model))
    check_max_position(args, model_config, seq_len)
    resume = None
    if args.resume:  # every rank reads the same files: the same verdict everywhere, before any collective
        resume = find_resume_tag(args.resume)
        check_resume_model(resume[1], model_facts(model_config), os.path.join(args.resume, resume[0]))
    from ds_longctx.initialize import init_distributed
    from ds_longctx.launch import check_launch

    init_distributed()  # (model_init would start it next) every rank passes the rendezvous, then
    from ds_longctx.agreement import check_agreement
    from ds_longctx.corpus import data_identity
    from ds_longctx.data import TASKS

    # the first collective: every rank holds the same config, CLI values and data (h30; the lead's wiring)
    check_agreement(ds_config, values={"cli": {"--seq-len": seq_len, "--steps": args.steps, "--seed": args.seed,
                                               "--model": args.model, "--model-config": args.model_config,
                                               "--tokenizer": args.tokenizer, "--concat-documents":
                                               args.concat_documents, "--resume": args.resume},
                                       "data": {"task": args.data} if args.data in TASKS else data_identity(args.data)})
    world = check_launch(lc.sequence_parallel_size)  # world vs SP, on every rank together, before the model is built
    from ds_longctx.config import check_train_batch_size

    # before model_init: transformers' HfDeepSpeedConfig parses the ds_config there and DeepSpeed's own batch
    # assertion (every rank counted as data parallel, no key named) would come first
    check_train_batch_size(ds_config, world, lc.sequence_parallel_size)
    model = build_model(args, ds_config)
    dataset = build_dataset(args, model.config, seq_len)
    engine, _, loader, _ = ds_longctx.initialize(args=args, model=model, config=ds_config, training_data=dataset,
                                                 model_parameters=[p for p in model.parameters()
                                                                   if p.requires_grad])
    layout = engine.long_context_layout
    rank, world, sp, dp = layout.rank, layout.world, layout.sp, layout.dp
    group = comm.sp_group() if sp > 1 else None
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    # time, tokens/s, TFLOPs (the one formula) and peak memory of every step; with long_context.profile
    # enabled also a torch.profiler trace (+ CUDA memory snapshot) of the chosen steps, into its output_dir
    # rank 0's profiled steps also count the executed FLOPs per category next to the planner's (the config as
    # initialize resolved it)
    profiler = StepProfiler(lc.profile, model.config, world_size=world, sp_size=sp, rank=rank, model=engine.module,
                            seq_len=seq_len, plan_work=functools.partial(
                                planned_work, _resolved_config(ds_config, engine.long_context), model.config, world)
                            if rank == 0 and lc.profile.enabled else None)

    if len(loader) == 0:
        raise _config_error("--data", f"{len(dataset)} samples give no micro batch of {micro} per data-parallel "
                            f"replica (dp={dp})", "use more data or a smaller train_micro_batch_size_per_gpu")
    run_layout = {"world_size": world, "sequence_parallel_size": sp, "data_parallel_size": dp,
                  "seq_len": seq_len, "micro_batch": micro, "gradient_accumulation_steps": gas, "seed": args.seed,
                  "data": args.data, "concat_documents": args.concat_documents, "batches_per_epoch": len(loader)}
    start = 0
    if args.resume:
        tag, saved, note = resume
        check_resume_layout(saved, run_layout, args.resume)  # before load_checkpoint: same verdict on every rank
        if note and rank == 0:
            print(f"[ds_longctx] warning: {note}", file=sys.stderr, flush=True)
        try:
            _, client = engine.load_checkpoint(args.resume, tag=tag)
        except Exception as e:  # DeepSpeed's and torch's load errors name no file
            raise _config_error("--resume", f"loading {os.path.join(args.resume, tag)!r} failed "
                                f"({type(e).__name__}: {e})", "resume another tag or start a new run") from None
        if client is None:
            raise _config_error("--resume", f"DeepSpeed found no checkpoint in {args.resume!r}",
                                "give the directory passed to --save")
        start = int(client["step"])
        if start >= args.steps:
            raise _config_error("--steps", f"{args.steps} is not past the checkpoint's step {start}",
                                f"give --steps > {start}")
    batches = micro_batches(loader, start * gas)
    _reserve_nvme(engine, model.config, seq_len, micro, ds_config)

    metrics = open(args.metrics, "a" if args.resume else "w") if args.metrics and rank == 0 else None
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout,
                   mininterval=1.0)
    if rank == 0:
        _logger().info(f"world={world} sp={sp} dp={dp} seq_len={seq_len} micro_batch={micro} gas={gas} "
                       f"params={n_params / 1e6:.2f}M attention={lc.attention.implementation} "
                       f"zero_stage={engine.zero_optimization_stage()}")
    loss_value = float("nan")
    last_finite = None  # (step, loss)
    for step in range(start + 1, args.steps + 1):
        profiler.start_step(step)
        losses = []
        for _ in range(gas):
            batch = {k: v.to(engine.device) for k, v in next(batches).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        loss_t = torch.stack(losses).mean()
        if dp > 1:  # report the mean over data-parallel replicas (SP ranks already agree)
            dist.all_reduce(loss_t)
            loss_t /= world
        loss_value = loss_t.item()
        prof = profiler.end_step(step, tokens=seq_len * micro * gas)  # this rank's SP group's tokens
        dt = prof["step_time_s"]
        tokens = seq_len * micro * gas * dp
        rec = {"step": step, "loss": loss_value, "tokens": tokens, "tokens_per_s": tokens / dt,
               "tflops": prof["tflops_per_gpu"], "peak_mem_bytes": prof["peak_memory_bytes"],
               "host_rss_bytes": host_rss_bytes(), "lr": engine.get_lr()[0] if engine.get_lr() else None,
               "step_time_s": dt}
        if "peak_reserved_bytes" in prof:
            rec["peak_reserved_bytes"] = prof["peak_reserved_bytes"]
        if "artifacts" in prof:
            rec["profile_artifacts"] = prof["artifacts"]
        if "allocator_model" in prof:
            rec["allocator_model"] = prof["allocator_model"]
        if "flops_by_category" in prof:
            rec["flops_by_category"] = prof["flops_by_category"]
            from ds_longctx.measure.profiler import format_flops

            _logger().info(f"step {step}: executed FLOPs per category, measured vs the planner's (this rank):\n"
                           + "\n".join(format_flops(prof["flops_by_category"])))
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        if not math.isfinite(loss_value):  # the same value on every rank (all-reduced): every rank stops here
            last = f"step {last_finite[0]}: {last_finite[1]:.6g}" if last_finite else "none (the first step)"
            raise _config_error(f"step {step}", f"the loss is {loss_value} (last finite loss: {last})",
                                "lower the learning rate or check the data and the config (lr, loss scaling, "
                                "bf16/fp16); --resume the last checkpoint to continue")
        last_finite = (step, loss_value)
        if bar:
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                            flops=f"{rec['tflops']:.1f}T/s" if rec["tflops"] >= 1 else f"{rec['tflops'] * 1e3:.1f}G/s",
                            peak=f"{rec['peak_mem_bytes'] / 2**20:.0f}MiB")
            bar.update(1)
    if bar:
        bar.close()
    if lc.profile.enabled:
        path = profiler.write_summary()
        if rank == 0:
            _logger().info(f"profile: per-step records in {path}, traces of steps "
                           f"{sorted(lc.profile.steps)} in {lc.profile.output_dir}")
    if args.save:
        record = dict(run_layout, step=args.steps, micro_batches_consumed=args.steps * gas,
                      model=model_facts(model.config))
        save_checkpoint(engine, args.save, f"step{args.steps}", record, rank)
    if args.data in ("copy",) and args.eval_samples:
        acc = copy_accuracy(engine, dataset, args.eval_samples, comm.sp_rank(group), sp, group,
                            start_index=len(dataset) - args.eval_samples)
        if rank == 0:
            chance = 1.0 / (model.config.vocab_size - 2)
            _logger().info(f"final loss {loss_value:.4f} (no-attention floor ln(V-2) = "
                           f"{dataset.chance_loss:.4f}); copy accuracy {acc:.3f} (chance {chance:.3f})")
    if metrics:
        metrics.close()
    return loss_value


if __name__ == "__main__":
    # an error on any rank ends the whole job; every rank ends without interpreter finalization
    # (the exit-time gloo abort): see ds_longctx/runtime.py
    from ds_longctx.runtime import run

    run(main)
