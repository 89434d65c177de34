"""Checkpoints for runs of days: saved during the run, resumed on any layout, exported as a Hugging Face model.

The formats are DeepSpeed's and transformers'. A tag is DeepSpeed's own checkpoint (``engine.save_checkpoint``)
plus ds_longctx's record (:data:`RECORD_FILE`: the run's layout, its data position and data identity, the
model's shape facts and HF config, the optimizer and scheduler sections, each file's size). A resume on another
world size, SP or DP degree goes through DeepSpeed's universal checkpoint (``ds_to_universal``, then
``checkpoint.load_universal``). An export gathers the weights with DeepSpeed's own means (ZeRO-3's consolidated
16-bit state dict for a live engine, ``zero_to_fp32`` for a saved tag) and writes them with transformers'
``save_pretrained``: safetensors shards, config, generation config, tokenizer.

What a save guarantees (every rank calls it):

* A tag is written under a temporary name (``.tmp-<tag>``) and renamed once every rank's files, fsynced, and
  the record are there; ``latest`` moves after the rename. A save killed at any moment (SIGKILL, power) leaves
  the previous complete tag and ``latest`` as they were; the next run on the directory removes the partial one.
* A failed write (disk full, I/O error) does not raise inside DeepSpeed's save (the other ranks would wait in
  its barrier until the process-group timeout): it is recorded, every rank learns of it, the partial tag is
  removed, and every rank raises one ConfigError naming the path, the bytes and the free space.
* Free space is checked before every save against the bytes it will write (the previous save's, or before the
  first one the model states' estimate :func:`estimate_bytes`), per filesystem (a shared one holds every
  rank's files, a node-local one its node's).
* One run per save directory: :class:`SaveDir` holds a lock on it for the run; a second run is refused naming
  the holder (host, pid, start). The lock is an ``flock``: the kernel drops it when the holder dies.

Resume (:func:`plan_resume` before ``initialize``, :meth:`ResumePlan.load` after): the tag ``latest`` names when
it is complete, else the newest complete tag (said). Another world / SP / DP degree: converted once to
``<tag>.universal`` beside it (rank 0; ``ds-longctx convert`` does it offline) and loaded with DeepSpeed's
universal loader. Refused before any tensor is read, naming the difference: another model, other data, another
sequence length, another ZeRO stage (DeepSpeed's loaders cannot cross stages), another optimizer type. A changed
learning rate or schedule takes effect and is reported.

Checkpoints are unpickled by DeepSpeed (``torch.load(weights_only=False)``): resume only directories you trust.

The package: ``tags`` (names, filesystem steps, checks of a saved tag), ``savedir`` (:class:`SaveDir`), ``resume``
(:func:`plan_resume`, :class:`ResumePlan`), ``universal`` (DeepSpeed's universal checkpoint), ``record`` (the run's
record), ``export`` (a model ``from_pretrained`` loads) and ``faults`` (test hooks, outside the save's logic).
"""
from .export import export_checkpoint, export_hf, exported_line, fp32_weights, read_tag, write_hf
from .faults import SAVE_POINTS, TEST_FILL_ENV, TEST_FILLER, TEST_KILL_ENV
from .record import (batch_sizes, layout_record, next_stage, rope_facts, run_record, stage_of,
                     stage_start_sample)
from .resume import ResumePlan, ensure_universal, plan_resume, resume
from .savedir import SaveDir, checkpoint_bytes, estimate_bytes, open_checkpoints
from .tags import (HF_CONFIG_DIR, LOCK_FILE, MODEL_KEYS, OLD_PREFIX, PARTITION_KEYS, RECORD_FILE, TMP_PREFIX,
                   UNIVERSAL_RECORD, UNIVERSAL_SUFFIX, check_tag, find_resume_tag, is_tag_dir, model_facts, save_dir_of,
                   tag_files, tag_for, verify_report)
from .manifest import verify_tag
from .universal import convert_to_universal

__all__ = ["SaveDir", "ResumePlan", "open_checkpoints", "resume", "plan_resume", "ensure_universal",
           "convert_to_universal", "export_hf", "export_checkpoint", "exported_line", "write_hf", "read_tag", "fp32_weights", "find_resume_tag",
           "check_tag", "estimate_bytes", "checkpoint_bytes", "run_record", "layout_record", "batch_sizes",
           "model_facts", "rope_facts", "stage_of", "stage_start_sample", "next_stage", "tag_files", "tag_for",
           "RECORD_FILE", "HF_CONFIG_DIR", "LOCK_FILE", "TMP_PREFIX", "OLD_PREFIX", "UNIVERSAL_SUFFIX",
           "UNIVERSAL_RECORD", "PARTITION_KEYS", "MODEL_KEYS", "SAVE_POINTS", "TEST_KILL_ENV", "TEST_FILL_ENV",
           "TEST_FILLER", "is_tag_dir", "save_dir_of", "verify_report",
           "verify_tag"]
