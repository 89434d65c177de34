"""Issue 52, item 1: checkpoints verified by content. One real save (2 ranks, tiny-cpu.json, ZeRO-3: tags step2 and
step4 of the shared uninterrupted run, tests/conftest.py copy_reference; every file's XXH3 in the record), then a
byte flip in each kind of file of the newest tag, same size: DeepSpeed's model states and optimizer states, ds_longctx's
record (invalid JSON, and one digit changed: still valid JSON) and the HF config. Each is detected by the check a resume
runs (``verify_on_every_rank``: here one process), ``--resume DIR``
falling back to step2 naming the file, ``--resume DIR/step4`` refused naming it, ``ds-longctx verify`` exiting 1 naming
it, export and the universal conversion refusing it; a damaged universal conversion is converted again. One launched
resume of the damaged tag, explicitly: every rank refuses it before the model is built. (``auto`` falling back in a
launch: tests/test_soak.py.)"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pathlib import Path

from launch_utils import REFERENCE_ARGS, ROOT, _env, run_train, save_dir_at
from soak_utils import flip
from ds_longctx.errors import ConfigError
from ds_longctx.job import checkpoint
from ds_longctx.job.checkpoint import manifest
from ds_longctx.job.checkpoint.resume import verify_on_every_rank

pytestmark = pytest.mark.distributed  # the fixture launches a job

KINDS = {
    "model_states": "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "optim_states": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "record": checkpoint.RECORD_FILE,
    "hf_config": os.path.join(checkpoint.HF_CONFIG_DIR, "config.json"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, copy_reference):
    """What a 4-step run with --save-every 2 leaves (tags step2 and step4, 'latest' on step4): those two tags of the
    shared uninterrupted run's save directory (tests/conftest.py copy_reference), copied."""
    return Path(save_dir_at(copy_reference, tmp_path_factory.mktemp("content") / "ck", ["step2", "step4"]))


def _damaged(saved, tmp_path, kind):
    ck = tmp_path / f"ck_{kind}"
    shutil.copytree(saved, ck)
    target = ck / "step4" / KINDS[kind]
    flip(str(target))
    return ck, target


def test_the_save_records_every_files_checksum(saved):
    record, problem = checkpoint.check_tag(str(saved), "step4", manifest.verify_tag)
    assert problem is None
    sums = manifest.checksums_of(record)
    assert set(sums) == set(record["files"]) | {"hf/config.json", "hf/generation_config.json"}
    assert set(record["files"]) == {f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1)
                                    for k in ("model", "optim")}
    for rel, digest in sums.items():  # what each rank reported is what is on disk
        assert manifest.digest_file(str(saved / "step4" / rel))[1] == digest
    assert manifest.record_problem(record, "x") is None and manifest.RECORD_DIGEST in record


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_flipped_byte_in_each_file_kind_is_refused_or_skipped_naming_the_file(saved, tmp_path, kind):
    ck, target = _damaged(saved, tmp_path, kind)
    # --resume DIR (and auto): the newest tag that verifies, the note naming the damaged file
    tag, record, note = checkpoint.find_resume_tag(str(ck), verify=verify_on_every_rank)
    assert tag == "step2" and record["step"] == 2, note
    assert repr(str(target)) in note and note.endswith("the newest complete checkpoint"), note
    if kind != "record":  # (64 flipped bytes make the record invalid JSON: said as such)
        assert "does not match its checksum (xxh3_64" in note, note
    # --resume DIR/step4: refused, naming it
    with pytest.raises(ConfigError, match="checkpoint '.*step4': '.*" + os.path.basename(str(target))):
        checkpoint.find_resume_tag(str(ck / "step4"), verify=verify_on_every_rank)
    # export and conversion read only what verifies
    with pytest.raises(ConfigError, match=os.path.basename(str(target))):
        checkpoint.read_tag(str(ck), "step4")
    with pytest.raises(ConfigError, match=os.path.basename(str(target))):
        checkpoint.convert_to_universal(str(ck), "step4")
    assert not (ck / "step4.universal").exists()


def test_a_record_changed_but_still_valid_json_is_caught_by_its_own_checksum(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    path = ck / "step4" / checkpoint.RECORD_FILE
    text = path.read_text()
    assert '"samples_consumed": 16' in text
    path.write_text(text.replace('"samples_consumed": 16', '"samples_consumed": 17'))  # one digit: valid JSON
    json.loads(path.read_text())
    tag, _, note = checkpoint.find_resume_tag(str(ck))  # the record's own checksum: checked even without content
    assert tag == "step2" and f"{str(path)!r} does not match its own checksum" in note, note


def test_ds_longctx_verify_names_the_damaged_file_and_exits_1(saved, tmp_path):
    ck, target = _damaged(saved, tmp_path, "optim_states")
    cmd = [sys.executable, "-m", "ds_longctx.cli", "verify"]
    good = subprocess.run([*cmd, str(saved)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "step2: intact (6 files" in good.stdout and "step4: intact (6 files" in good.stdout, good.stdout
    assert f"--resume {saved} loads step4" in good.stdout, good.stdout
    bad = subprocess.run([*cmd, str(ck)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"step4: DAMAGED: {str(target)!r} does not match its checksum" in bad.stdout, bad.stdout
    assert "step2: intact" in bad.stdout and f"--resume {ck} loads step2" in bad.stdout, bad.stdout


def test_an_explicit_damaged_tag_is_refused_by_every_rank_of_a_launch(saved, tmp_path):
    ck, target = _damaged(saved, tmp_path, "model_states")
    p = run_train(*REFERENCE_ARGS, "--steps", "6", "--resume", str(ck / "step4"), check=False, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    for r in (0, 1):
        assert f"[rank {r}] ds_longctx: error: --resume: checkpoint {str(ck / 'step4')!r}: {str(target)!r} does not " \
               "match its checksum" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_damaged_universal_conversion_is_converted_again(saved, tmp_path):
    import glob

    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    assert checkpoint.convert_to_universal(str(ck), "step4") == "step4.universal"
    marker = json.loads((ck / "step4.universal" / checkpoint.UNIVERSAL_RECORD).read_text())
    assert marker["source_checksums"] == manifest.checksums_of(json.loads((ck / "step4" / checkpoint.RECORD_FILE)
                                                                          .read_text()))
    notes = []
    assert checkpoint.convert_to_universal(str(ck), "step4", log=notes.append) == "step4.universal" and not notes
    target = sorted(glob.glob(str(ck / "step4.universal" / "zero" / "*" / "exp_avg.pt")))[0]
    flip(target)
    checkpoint.convert_to_universal(str(ck), "step4", log=notes.append)
    assert notes[0].startswith(f"warning: the universal checkpoint {str(ck / 'step4.universal')!r} is damaged "
                               f"({target!r} does not match its checksum"), notes
    again = json.loads((ck / "step4.universal" / checkpoint.UNIVERSAL_RECORD).read_text())
    assert again["checksums"] == marker["checksums"]  # the same content as the first conversion
