"""tools/position_audit.py over the installed transformers: every shard-local position / size it finds has a
reviewed verdict, and the silently-wrong set is exactly the one below (issue 35's check for the class).

A new transformers that adds a pattern (a new model, a new helper) fails test_every_hit_has_a_verdict, naming it:
review it and add a rule to position_audit.RULES. A change of the WRONG set (a family fixed upstream, or a new
one) fails test_wrong_set_is_known.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import position_audit  # noqa: E402

# (where, code) of every hit the table calls WRONG under SP, for transformers 5.24
KNOWN_WRONG = set()  # BART family, MusicGen, PhiMoE (LongRoPE): found here, refused under SP since (patch.py, rope.py)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """The tool as a user runs it (a ~20 s source scan of every causal LM: a subprocess, so the tests that read
    it are in the full suite, not the unit subset)."""
    import json
    import subprocess

    out = tmp_path_factory.mktemp("audit") / "audit.json"
    tool = os.path.join(os.path.dirname(position_audit.__file__), "position_audit.py")
    subprocess.run([sys.executable, tool, "--out", str(out)], check=True, capture_output=True, timeout=600)
    with open(out) as f:
        return json.load(f)


def _name(g):
    return f"{g['pattern']}: {g['code']!r} in {g['where']} ({g['locations'][0]}; {len(g['model_types'])} model types)"


@pytest.mark.distributed
def test_every_hit_has_a_verdict(result):
    assert len(result["model_types"]) >= 150 and not result["unresolved"], result["unresolved"]
    missing = [_name(g) for g in result["hits"] if g["verdict"] is None]
    assert not missing, ("shard-local positions / sizes with no verdict in tools/position_audit.py RULES (read the "
                         "code, then add a rule):\n" + "\n".join(missing))


@pytest.mark.distributed
def test_wrong_set_is_known(result):
    if result["transformers_version"] != "5.24.0":
        pytest.skip(f"KNOWN_WRONG is for transformers 5.24.0, this is {result['transformers_version']}")
    wrong = {(g["where"], g["code"]) for g in result["hits"] if g["verdict"] == "WRONG"}
    assert wrong == KNOWN_WRONG, (f"new WRONG: {sorted(wrong - KNOWN_WRONG)}\n"
                                  f"no longer WRONG: {sorted(KNOWN_WRONG - wrong)}")


@pytest.mark.distributed
def test_finds_the_issue_35_cases(result):
    """The audit sees the two shard-local computations issue 35 found by hand (now fixed: 'handled'): a rule
    table that stopped matching them, or a reachability walk that stopped reaching them, fails here."""
    handled = {}
    for g in result["hits"]:
        if g["verdict"] == "handled":
            handled.setdefault(g["where"], set()).update(g["model_types"])
    assert {"llama4", "llama4_text"} <= handled.get("modeling_llama4:*TextAttention.forward", set())
    assert {"llama", "qwen3", "mistral", "phi3"} <= handled.get("modeling_rope_utils:dynamic_rope_update", set())


def test_rules_classify_a_new_shard_local_index():
    """A line of the class in a place no rule covers has no verdict (the table does not wave new code through)."""
    assert position_audit.verdict_of("arange", "scale = torch.arange(hidden_states.shape[1]) * self.alpha",
                                     "modeling_newmodel:*Attention.forward") is None
    assert position_audit.verdict_of("arange", "position_ids = torch.arange(seq_length) + past_seen_tokens",
                                     "modeling_newmodel:*Model.forward", guard="position_ids is None").verdict == "harmless"

