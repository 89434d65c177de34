"""ds_longctx.job.checkpoint's decisions without a training job: what a resume refuses, converts or reports; the
publish step of a save killed at each of its points; the save directory's lock. (Saves and resumes of real
DeepSpeed engines, on 1, 2 and 4 ranks: tests/test_long_runs.py.)"""
import json
import os
import subprocess
import sys

import pytest
import torch

from ds_longctx.job import checkpoint
from ds_longctx.errors import ConfigError
from test_faults import _fake_checkpoint
from tiny_models import tiny_config

RECORD = {"world_size": 2, "sequence_parallel_size": 2, "data_parallel_size": 1, "zero_stage": 3, "micro_batch": 4,
          "gradient_accumulation_steps": 1, "seq_len": 64, "seed": 0, "data": {"task": "copy"},
          "concat_documents": False, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "scheduler": None,
          "gradient_clipping": 1.0, "dtype": "fp32"}


def _saved(tmp_path, **changes):
    """A fake step-4 checkpoint of RECORD (with ``changes``) in ``tmp_path``; returns this run's record."""
    import shutil

    shutil.rmtree(tmp_path / "step4", ignore_errors=True)
    facts = checkpoint.model_facts(tiny_config(heads=4, kv_heads=2))
    d = _fake_checkpoint(tmp_path, "step4", 4, facts=facts)
    rec = json.loads((d / checkpoint.RECORD_FILE).read_text())
    rec.update(RECORD, samples_consumed=16, **changes)
    (d / checkpoint.RECORD_FILE).write_text(json.dumps(rec))
    return dict(RECORD, model=facts)


def test_resume_refuses_what_cannot_continue_the_run(tmp_path):
    current = _saved(tmp_path)
    plan = checkpoint.plan_resume(str(tmp_path), current)
    assert (plan.tag, plan.step, plan.samples_consumed, plan.universal, plan.changes) == ("step4", 4, 16, False, [])
    other_model = dict(current, model=checkpoint.model_facts(tiny_config(heads=2, kv_heads=2, head_dim=16)))
    with pytest.raises(ConfigError, match=r"^--resume: .*step4 holds a different model: heads 4 in the checkpoint vs "
                       r"2 now, head_dim 8 in the checkpoint vs 16 now"):
        checkpoint.plan_resume(str(tmp_path), other_model)
    cases = [
        ({"data": {"path": "/a/d.jsonl", "bytes": 10, "sha256": "ab"}},
         {"data": {"path": "/b/d.jsonl", "bytes": 10, "sha256": "cd"}}, r"the data differ: sha256 'ab' in the "
         r"checkpoint vs 'cd' now\. Fix: resume with the data the run trained on \(a path may move"),
        ({}, {"seq_len": 128}, r"seq_len 64 in the checkpoint vs 128 now .* Fix: resume with --seq-len 64, or continue "
         r"the run at the new length as a new stage: add --new-stage \(the weights and optimizer state carried"),
        ({}, {"seed": 1}, r"seed 0 in the checkpoint vs 1 now"),
        ({}, {"zero_stage": 2}, r"ZeRO stage 3 in the checkpoint vs 2 now \(DeepSpeed's loaders, universal included, "
         r"read only the stage a checkpoint was saved with\)\. Fix: resume with zero_optimization.stage 3"),
        ({}, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, r"optimizer.type 'AdamW' in the checkpoint vs "
         r"'SGD' now \(its state cannot carry over\)"),
    ]
    for saved, now, message in cases:
        current = _saved(tmp_path, **saved)
        with pytest.raises(ConfigError, match=r"^--resume: .*step4 cannot continue this run: " + message):
            checkpoint.plan_resume(str(tmp_path), dict(current, **now))
    # a record of an older ds_longctx names the task (or the path) only
    current = _saved(tmp_path, data="copy")
    checkpoint.plan_resume(str(tmp_path), dict(current, data={"task": "copy"}))
    with pytest.raises(ConfigError, match=r"the data differ: 'copy' in the checkpoint vs '/d.jsonl' now"):
        checkpoint.plan_resume(str(tmp_path), dict(current, data={"path": "/d.jsonl", "sha256": "ab"}))
    # a record of an older ds_longctx has no ZeRO stage: DeepSpeed's file names tell 3 from 1-2
    current = _saved(tmp_path, zero_stage=None)
    checkpoint.plan_resume(str(tmp_path), dict(current, zero_stage=2))  # _fake_checkpoint: mp_rank_00_model_states
    with pytest.raises(ConfigError, match=r"cannot continue this run: ZeRO stage 1 or 2 in the checkpoint vs 3 now"):
        checkpoint.plan_resume(str(tmp_path), dict(current, zero_stage=3))
    zero3 = tmp_path / "step4" / "mp_rank_00_model_states.pt"
    zero3.rename(tmp_path / "step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    rec = json.loads((tmp_path / "step4" / checkpoint.RECORD_FILE).read_text())
    rec["files"] = checkpoint.tag_files(str(tmp_path / "step4"))
    (tmp_path / "step4" / checkpoint.RECORD_FILE).write_text(json.dumps(rec))
    with pytest.raises(ConfigError, match=r"cannot continue this run: ZeRO stage 3 in the checkpoint vs 2 now"):
        checkpoint.plan_resume(str(tmp_path), dict(current, zero_stage=2))
    # a moved data file (same content) is the same data
    current = _saved(tmp_path, data={"path": "/a/d.jsonl", "bytes": 10, "sha256": "ab"})
    checkpoint.plan_resume(str(tmp_path), dict(current, data={"path": "/b/d.jsonl", "bytes": 10, "sha256": "ab"}))


def test_a_new_stage_accepts_another_length_and_with_restart_other_data(tmp_path):
    """train.py --new-stage: another seq_len continues the run; --stage-data keep still needs the same data and
    seed (the token position means nothing on other data), restart does not."""
    data = {"path": "/a/d.jsonl", "bytes": 10, "sha256": "ab"}
    current = dict(_saved(tmp_path, data=data), data=data)
    longer = dict(current, seq_len=256)
    for mode in ("restart", "keep"):
        plan = checkpoint.plan_resume(str(tmp_path), longer, new_stage=mode)
        assert plan.new_stage == mode and plan.changes[-1].startswith("a new stage (--new-stage): seq_len 64 -> 256")
    other = dict(longer, data={"path": "/a/e.jsonl", "bytes": 11, "sha256": "cd"}, seed=3)
    assert checkpoint.plan_resume(str(tmp_path), other, new_stage="restart").new_stage == "restart"
    with pytest.raises(ConfigError, match=r"the data differ: .* or --stage-data restart \(a new stage on other data"):
        checkpoint.plan_resume(str(tmp_path), other, new_stage="keep")
    with pytest.raises(ConfigError, match=r"seed 0 in the checkpoint vs 3 now .* or --stage-data restart"):
        checkpoint.plan_resume(str(tmp_path), dict(longer, seed=3), new_stage="keep")
    # the data position of a new stage: restart at 0; keep at the same token position (rounded up: none twice)
    assert checkpoint.stage_start_sample("restart", 16, 64, 256) == 0
    assert [checkpoint.stage_start_sample("keep", n, 64, 256) for n in (16, 17, 0)] == [4, 5, 0]
    assert checkpoint.stage_start_sample("keep", 3, 256, 64) == 12  # a shorter stage
    # the stage record: a record without one is stage 1 from step 0
    saved = {"step": 4, "seq_len": 64}
    assert checkpoint.stage_of(saved)["index"] == 1
    stage, before = checkpoint.next_stage(saved, 256, {"parameters": {"rope_theta": 1e6}}, "keep", 4)
    assert stage == {"index": 2, "seq_len": 256, "rope": {"parameters": {"rope_theta": 1e6}}, "start_step": 4,
                     "start_sample": 4, "data": "keep"}
    assert [(s["index"], s["seq_len"], s["start_step"], s["end_step"]) for s in before] == [(1, 64, 0, 4)]
    stage3, before3 = checkpoint.next_stage({"step": 9, "seq_len": 256, "stage": stage, "stages": before}, 1024,
                                            None, "restart", 0)
    assert stage3["index"] == 3 and [(s["index"], s["end_step"]) for s in before3] == [(1, 4), (2, 9)]


def test_resume_on_another_layout_is_universal_and_changes_are_reported(tmp_path):
    current = _saved(tmp_path)
    four = dict(current, world_size=4, data_parallel_size=2, micro_batch=2,
                optimizer={"type": "adamw", "params": {"lr": 0.001}}, scheduler={"type": "WarmupLR"})
    plan = checkpoint.plan_resume(str(tmp_path), four)
    assert plan.universal and plan.load_tag == "step4.universal"
    assert plan.changes == [
        "layout: world_size 2 -> 4, data_parallel_size 1 -> 2, micro_batch 4 -> 2",
        "optimizer.params.lr: 0.003 in the checkpoint, 0.001 now: the ds_config's value takes effect",
        "scheduler: None in the checkpoint, {'type': 'WarmupLR'} now: the ds_config's value takes effect"]
    assert plan.ds_config({"a": 1}) == {"a": 1, "checkpoint": {"load_universal": True}}
    one = checkpoint.plan_resume(str(tmp_path), dict(current, world_size=1, sequence_parallel_size=1))
    assert one.universal and "the global batch" not in " ".join(one.changes)
    wider = checkpoint.plan_resume(str(tmp_path), dict(current, gradient_accumulation_steps=2))
    assert not wider.universal and wider.changes[-1] == ("the global batch changes from 4 to 8 samples per step (the "
                                                         "learning-rate schedule goes on by steps)")


def test_a_replace_killed_between_its_renames_resumes_from_the_parked_copy(tmp_path):
    _fake_checkpoint(tmp_path, "step2", 2)
    os.rename(tmp_path / "step2", tmp_path / (checkpoint.OLD_PREFIX + "step2"))
    tag, record, note = checkpoint.find_resume_tag(str(tmp_path))
    assert tag == ".old-step2" and record["step"] == 2 and "was being replaced when its run ended" in note


def _publish_in_child(root, point):
    """Rank 0's publish of a new step2 (its files already in .tmp-step2) in a forked child, killed at ``point``;
    returns how the child ended (-9: killed)."""
    tmp = root / (checkpoint.TMP_PREFIX + "step2")
    tmp.mkdir()
    torch.save({"new": 1}, tmp / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    pid = os.fork()
    if pid == 0:  # the child: the hook reads the environment
        code = 0
        try:
            if point:
                os.environ[checkpoint.TEST_KILL_ENV] = f"0:{point}"
            out = checkpoint.SaveDir(path=str(root))._publish("step2", tmp.name, {"step": 2, "model": {}}, None, None,
                                                               0)
            code = 0 if out is None else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_a_save_killed_at_each_point_of_its_publish_keeps_a_complete_tag(tmp_path):
    """Rank 0's part of a save (record, rename, latest) killed at each point, while the directory already holds a
    complete tag of the same name (a run restarted without --resume): 'latest' always names a complete tag with
    the old or the new files, never a mix or a partial one."""
    for point in ("before_record", "after_record", "after_rename", "after_latest", None):
        root = tmp_path / str(point)
        root.mkdir()
        old = _fake_checkpoint(root, "step2", 2)
        ended = _publish_in_child(root, point)
        assert ended == (-9 if point else 0), (point, ended)
        tag, record, note = checkpoint.find_resume_tag(str(root))
        files = sorted(os.listdir(root / tag))
        new = "zero_pp_rank_0_mp_rank_00_model_states.pt" in files
        assert tag == "step2" and note is None, (point, tag, note)
        assert new == (point in ("after_rename", "after_latest", None)), (point, files)
        if not new:
            assert files == sorted([checkpoint.RECORD_FILE, "mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"]), (point, files)
        assert os.path.isdir(old)


_LOCK = """
import sys
from ds_longctx.job import checkpoint
sd = checkpoint.SaveDir(path=sys.argv[1])
print("OUTCOME", sd._lock_and_clean("t"), flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
"""


@pytest.mark.distributed  # a subprocess
def test_one_run_per_save_directory(tmp_path):
    (tmp_path / ".tmp-step8").mkdir()  # a partial tag a killed run left
    first = subprocess.Popen([sys.executable, "-c", _LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "OUTCOME None"
        assert not (tmp_path / ".tmp-step8").exists()
        sd = checkpoint.SaveDir(path=str(tmp_path))
        outcome = sd._lock_and_clean("u")
        assert outcome[0] == "--save" and outcome[1].startswith(f"{str(tmp_path)!r} is in use by another run (host ")
        assert f"pid {first.pid}" in outcome[1] and "give this run its own --save directory" in outcome[2]
    finally:
        first.stdin.close()
        first.wait(timeout=30)
    sd = checkpoint.SaveDir(path=str(tmp_path))
    assert sd._lock_and_clean("v") is None  # the lock went with its process
    sd.close()


def test_export_refuses_names_the_model_class_does_not_know(tmp_path):
    cfg = tiny_config(layers=1)
    from tiny_models import build

    sd = build(cfg).state_dict()
    checkpoint.write_hf(str(tmp_path / "ok"), sd, cfg)
    assert (tmp_path / "ok" / "model.safetensors").exists() and (tmp_path / "ok" / "config.json").exists()
    renamed = {k.replace("mlp.", "tiled_mlp."): v for k, v in sd.items()}
    with pytest.raises(ConfigError, match=r"^export: the weights lack .*mlp"):
        checkpoint.write_hf(str(tmp_path / "bad"), renamed, cfg)
    with pytest.raises(ConfigError, match=r"^export: the weights have names LlamaForCausalLM does not know: "
                       r"\['extra'\]"):
        checkpoint.write_hf(str(tmp_path / "bad"), dict(sd, extra=torch.zeros(1)), cfg)
