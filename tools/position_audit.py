"""Audit transformers' causal LMs for code that derives positions or sizes from the local sequence shard.

Under sequence parallelism every rank runs the HF model on a contiguous shard [b, S/C] of the tokens with the
shard's GLOBAL position_ids (ds_longctx's forward always passes them, with use_cache=False); the attention is
replaced by Ulysses / untied Ulysses over the gathered sequence. Code that computes a position, a length or a
per-position quantity from the local tensor (``torch.arange(x.shape[1])``, ``max(position_ids) + 1``,
``cache_position``, ...) silently computes with shard-local values (issue 35: Llama 4's NoPE temperature,
dynamic / LongRoPE).

For every model type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES this reads (ast, no import of the model
code: fast) the code that runs on a shard: starting at the causal-LM class, every class and module-level function
of the modeling file it reaches (submodules built in ``__init__``, bases, names its methods use), their ``forward``
and the ``self.*`` methods forward calls, decorators, and the transformers helpers they import by name
(modeling_rope_utils, masking_utils, ...: followed the same way inside their module). Each line matching one of
PATTERNS is a hit; identical lines in the same role (class-name prefix dropped) are grouped across model types;
each group gets the verdict of the first rule in RULES that matches it:

* ``harmless``: the value is the shard's and is meant to be (reshape to the local length), or the code does not
  run under ds_longctx (position_ids made only when none are passed; cache paths with use_cache=False; the mask
  HF builds for the shard, which ds_longctx's attention accepts only when plain causal and then ignores);
* ``handled``: shard-local and wrong as transformers wrote it, fixed by ds_longctx (the module named);
* ``WRONG``: a silent error under SP;
* ``refused``: in a layer ds_longctx refuses under SP (non-attention mixers: Mamba, linear attention, conv).

A hit no rule matches has verdict None: tests/test_position_audit.py fails on it, naming it.

    python tools/position_audit.py [--out bench/results/position_audit.json] [--md bench/position_audit.md]
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# ---------------------------------------------------------------------------------------------------------------
# what counts as a hit
# ---------------------------------------------------------------------------------------------------------------

PATTERNS: Dict[str, str] = {
    "arange": r"\b(torch\.)?arange\(",
    "shape[1]": r"\.shape\[1\]|\.size\(1\)",
    "shape[-2]": r"\.shape\[-2\]|\.size\(-2\)",
    "shape unpack": r"^\s*\(?\w+\s*,\s*\w+(\s*,\s*\w+)*\)?\s*=\s*[\w.\[\]]+\.(shape\b|size\(\))(?!\[)",
    "shape[:2]": r"\.shape\[:2\]|\.shape\[:-1\]|\.shape\[:-2\]|\.size\(\)\[:2\]|\.size\(\)\[:-1\]",
    "max(position_ids)": r"max\([^)]*position|position_ids\s*\.\s*max\(|positions?\s*\.\s*max\(",
    "cache_position": r"\bcache_position\b",
    "past_seen_tokens": r"\bpast_seen_tokens\b|\bpast_key_values_length\b|\bpast_length\b",
    "seq_len": r"\b(seq_len|seq_length|q_len|kv_seq_len|query_length|key_length|tgt_len|src_len)\b",
    "get_seq_length": r"get_seq_length\(",
    "cumsum": r"\bcumsum\(",
    "tril/triu": r"\b(tril|triu)\(",
    "position_ids[...]": r"position_ids\[",
}
_COMPILED = {k: re.compile(v) for k, v in PATTERNS.items()}

# methods never audited (run once at build time from the config, or only by generate / weight init)
_SKIP_METHODS = {"__init__", "_init_weights", "extra_repr", "get_input_embeddings", "set_input_embeddings",
                 "get_output_embeddings", "set_output_embeddings", "get_decoder", "set_decoder", "tie_weights",
                 "prepare_inputs_for_generation", "_reorder_cache", "compute_default_rope_parameters",
                 "_compute_default_rope_parameters", "post_init", "_supports_default_dynamic_cache"}
# imported names never followed (infrastructure: docs, output plumbing, base classes, caches)
_NO_FOLLOW_MODULES = ("utils", "utils.generic", "utils.doc", "utils.deprecation", "utils.import_utils",
                      "utils.output_capturing", "modeling_utils", "cache_utils", "generation", "modeling_outputs",
                      "configuration_utils", "processing_utils", "activations", "pytorch_utils",
                      "modeling_layers", "integrations", "integrations.hub_kernels", "modeling_flash_attention_utils",
                      "utils.auto_docstring", "modeling_attn_mask_utils_unused")


def transformers_root() -> str:
    spec = importlib.util.find_spec("transformers")
    return os.path.dirname(spec.origin)


# ---------------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Module:
    path: str
    modname: str  # dotted, relative to transformers (e.g. models.llama.modeling_llama)
    lines: List[str]
    defs: Dict[str, ast.AST]
    imports: Dict[str, Tuple[str, str]]  # local name -> (module dotted name, original name)


_MODULES: Dict[str, Optional[Module]] = {}


def load_module(root: str, modname: str) -> Optional[Module]:
    if modname in _MODULES:
        return _MODULES[modname]
    path = os.path.join(root, *modname.split(".")) + ".py"
    mod = None
    if os.path.exists(path):
        src = open(path, encoding="utf-8").read()
        tree = ast.parse(src)
        defs, imports = {}, {}
        pkg = modname.split(".")[:-1]
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defs[node.name] = node
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                defs[node.targets[0].id] = node  # e.g. JAMBA_ATTENTION_CLASSES = {...}: followed, not audited
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    imports[a.asname or a.name] = (target, a.name)
        mod = Module(path, modname, src.splitlines(), defs, imports)
    _MODULES[modname] = mod
    return mod


_SOURCES: Dict[str, Optional[str]] = {}


def _defines_function(root: str, modname: str, name: str) -> bool:
    if modname not in _SOURCES:
        path = os.path.join(root, *modname.split(".")) + ".py"
        _SOURCES[modname] = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    src = _SOURCES[modname]
    return src is not None and re.search(rf"^def {re.escape(name)}\(", src, re.M) is not None


def class_index(root: str) -> Dict[str, str]:
    """class name -> module dotted name, over every models/*/modeling_*.py (first definition wins)."""
    idx: Dict[str, str] = {}
    pat = re.compile(r"^class (\w+)\(", re.M)
    mdir = os.path.join(root, "models")
    for d in sorted(os.listdir(mdir)):
        p = os.path.join(mdir, d)
        if not os.path.isdir(p):
            continue
        for f in sorted(os.listdir(p)):
            if f.startswith("modeling_") and f.endswith(".py"):
                for name in pat.findall(open(os.path.join(p, f), encoding="utf-8").read()):
                    idx.setdefault(name, f"models.{d}.{f[:-3]}")
    return idx


def causal_lm_mapping(root: str) -> Dict[str, str]:
    """MODEL_FOR_CAUSAL_LM_MAPPING_NAMES read from modeling_auto.py's source (importing it costs seconds)."""
    tree = ast.parse(open(os.path.join(root, "models", "auto", "modeling_auto.py"), encoding="utf-8").read())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
            return {k: v for k, v in ast.literal_eval(node.value.args[0])}
    raise RuntimeError("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES not found in modeling_auto.py")


# ---------------------------------------------------------------------------------------------------------------
# reachability
# ---------------------------------------------------------------------------------------------------------------

_NAMES: Dict[int, List[str]] = {}


def _names(node) -> List[str]:
    got = _NAMES.get(id(node))
    if got is None:  # nodes live as long as _MODULES holds their tree
        got = _NAMES[id(node)] = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return got


def _self_calls(fn) -> List[str]:
    out = []
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                and n.func.value.id == "self"):
            out.append(n.func.attr)
    return out


@dataclass
class Unit:
    """One audited function: a module-level function, or a class's method (with the class it was reached from)."""
    module: Module
    qualname: str  # Class.method or function
    node: ast.AST


def reach(root: str, start_mod: Module, start_class: str) -> List[Unit]:
    units: Dict[Tuple[str, str], Unit] = {}
    seen = set()
    todo = [(start_mod, start_class)]
    # a multimodal wrapper builds its language model with AutoModel.from_config(config.text_config): the file's
    # text model / causal LM classes are what runs on the tokens
    todo += [(start_mod, n) for n, d in start_mod.defs.items() if isinstance(d, ast.ClassDef) and n != start_class
             and (n.endswith("TextModel") or n.endswith("ForCausalLM") or n.endswith("LanguageModel"))]
    while todo:
        mod, name = todo.pop()
        if (mod.modname, name) in seen:
            continue
        seen.add((mod.modname, name))
        node = mod.defs.get(name)
        if node is None:
            imp = mod.imports.get(name)
            if imp is None:
                continue
            target, orig = imp
            if target.split(".", 1)[-1] in _NO_FOLLOW_MODULES or target in _NO_FOLLOW_MODULES:
                continue
            if not _defines_function(root, target, orig):
                continue  # cheap text check first: parsing every imported module costs seconds
            tmod = load_module(root, target)
            if tmod is None or not isinstance(tmod.defs.get(orig), ast.FunctionDef):
                continue  # imported classes (bases, caches, layers from other files) are not followed
            todo.append((tmod, orig))
            continue
        if isinstance(node, ast.Assign):
            refs = _names(node.value)
        elif isinstance(node, ast.FunctionDef):
            units[(mod.modname, name)] = Unit(mod, name, node)
            refs = _names(node)
        else:
            refs = [b for base in node.bases for b in _names(base)]
            refs += [d for dec in node.decorator_list for d in _names(dec)]
            methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
            want = ["forward"] if "forward" in methods else []
            done = set()
            while want:
                mname = want.pop()
                if mname in done or mname not in methods or mname in _SKIP_METHODS:
                    continue
                done.add(mname)
                m = methods[mname]
                units[(mod.modname, f"{name}.{mname}")] = Unit(mod, f"{name}.{mname}", m)
                refs += _names(m)
                want += _self_calls(m)
            if "__init__" in methods:
                refs += _names(methods["__init__"])
        for r in refs:
            if r in mod.defs or r in mod.imports:
                todo.append((mod, r))
    return list(units.values())


# ---------------------------------------------------------------------------------------------------------------
# hits and verdicts
# ---------------------------------------------------------------------------------------------------------------

def role(qualname: str, prefix: str) -> str:
    """``LlamaAttention.forward`` -> ``*Attention.forward`` (the model's class-name prefix dropped)."""
    if "." not in qualname:
        return qualname
    cls, meth = qualname.split(".", 1)
    n = 0
    while n < min(len(cls), len(prefix)) and cls[n] == prefix[n]:
        n += 1
    # back up to a CamelCase boundary
    while 0 < n < len(cls) and not cls[n].isupper():
        n -= 1
    return f"*{cls[n:]}.{meth}" if n > 0 else f"{cls}.{meth}"


def guards_of(node) -> Dict[int, List[str]]:
    """line -> the conditions (``if`` tests, ``not (...)`` in else branches; conditional expressions too) under
    which that line of ``node`` runs."""
    out: Dict[int, List[str]] = {}

    def mark(stmts, cond):
        for st in stmts:
            for ln in range(st.lineno, st.end_lineno + 1):
                out.setdefault(ln, []).append(cond)

    for n in ast.walk(node):
        if isinstance(n, ast.If):
            c = ast.unparse(n.test)
            mark(n.body, c)
            mark(n.orelse, f"not ({c})")
        elif isinstance(n, ast.IfExp):
            c = ast.unparse(n.test)
            mark([n.body], c)
            mark([n.orelse], f"not ({c})")
    return out


_HITS: Dict[Tuple[str, str], list] = {}


def hits_of(unit: Unit) -> List[Tuple[int, str, str, str]]:
    key = (unit.module.modname, unit.qualname)
    if key not in _HITS:
        _HITS[key] = _hits_of(unit)
    return _HITS[key]


def _hits_of(unit: Unit) -> List[Tuple[int, str, str, str]]:
    """(line number, pattern, stripped line) for each pattern matching a line of the unit (docstrings and comments
    dropped; decorators included)."""
    node = unit.node
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    doc_lines = set()
    body0 = node.body[0] if node.body else None
    if isinstance(body0, ast.Expr) and isinstance(getattr(body0, "value", None), ast.Constant) \
            and isinstance(body0.value.value, str):
        doc_lines = set(range(body0.lineno, body0.end_lineno + 1))
    # nested docstrings (inner functions)
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n is not node and n.body:
            b = n.body[0]
            if isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant) \
                    and isinstance(b.value.value, str):
                doc_lines |= set(range(b.lineno, b.end_lineno + 1))
    out = []
    guards = guards_of(node)
    for ln in range(start, node.end_lineno + 1):
        if ln in doc_lines:
            continue
        text = unit.module.lines[ln - 1]
        code = text.split("#", 1)[0] if "#" in text else text
        if not code.strip():
            continue
        for pname, rx in _COMPILED.items():
            if rx.search(code):
                out.append((ln, pname, code.strip(), " and ".join(guards.get(ln, []))))
    return out


@dataclass
class Rule:
    verdict: str  # harmless | handled | WRONG | refused
    why: str
    pattern: Optional[str] = None  # the hit's pattern name (None: any)
    line: Optional[str] = None  # regex searched in the stripped line
    where: Optional[str] = None  # regex searched in "module:role" (e.g. modeling_llama:*Attention.forward)
    guard: Optional[str] = None  # regex searched in the conditions the line runs under ("a and not (b)")
    fix: Optional[str] = None  # for WRONG: a suggested fix, one line




def verdict_of(pattern: str, line: str, where: str, guard: str = "") -> Optional[Rule]:
    for r in RULES:
        if r.pattern is not None and r.pattern != pattern:
            continue
        if r.line is not None and not re.search(r.line, line):
            continue
        if r.where is not None and not re.search(r.where, where):
            continue
        if r.guard is not None and not re.search(r.guard, guard):
            continue
        return r
    return None


def audit(model_types: Optional[List[str]] = None) -> dict:
    root = transformers_root()
    mapping = causal_lm_mapping(root)
    idx = class_index(root)
    groups: Dict[Tuple[str, str, str], dict] = {}
    unresolved = {}
    audited = {}
    for mt, cls in sorted(mapping.items()):
        if model_types is not None and mt not in model_types:
            continue
        modname = idx.get(cls)
        mod = load_module(root, modname) if modname else None
        if mod is None:
            unresolved[mt] = cls
            continue
        prefix = re.sub(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$", "", cls)
        units = reach(root, mod, cls)
        interface = any("ALL_ATTENTION_FUNCTIONS" in n for u in units for n in _names(u.node))
        fwd = next((m for m in mod.defs[cls].body if isinstance(m, ast.FunctionDef) and m.name == "forward"), None)
        takes_positions = fwd is None or any(a.arg == "position_ids" for a in fwd.args.args + fwd.args.kwonlyargs)
        audited[mt] = {"class": cls, "file": os.path.relpath(mod.path, root),
                       "attention_interface": interface, "forward_takes_position_ids": takes_positions, "functions": sorted(f"{u.module.modname.rsplit('.', 1)[-1]}:{u.qualname}" for u in units)}
        for u in units:
            shared = not u.module.modname.startswith("models.")
            r = u.qualname if shared else role(u.qualname, prefix)
            where = f"{u.module.modname.rsplit('.', 1)[-1]}:{r}"
            for ln, pname, text, guard in hits_of(u):
                key = (pname, text, where, guard)
                g = groups.get(key)
                if g is None:
                    rule = verdict_of(pname, text, where, guard)
                    g = groups[key] = {"pattern": pname, "code": text, "where": where, "guard": guard,
                                       "verdict": rule.verdict if rule else None, "why": rule.why if rule else None,
                                       "rule": RULES.index(rule) if rule else None,
                                       "model_types": [], "locations": []}
                g.setdefault("_interface", set()).add(interface)
                if mt not in g["model_types"]:
                    g["model_types"].append(mt)
                loc = f"{os.path.relpath(u.module.path, root)}:{ln}"
                if loc not in g["locations"]:
                    g["locations"].append(loc)
    for g in groups.values():
        if True not in g.pop("_interface"):
            g["verdict"], g["why"], g["rule"] = NO_INTERFACE, NO_INTERFACE_WHY, None
    hits = sorted(groups.values(), key=lambda g: ({"WRONG": 0, None: 1}.get(g["verdict"], 2), g["where"], g["code"]))
    counts: Dict[str, int] = {}
    for g in hits:
        counts[str(g["verdict"])] = counts.get(str(g["verdict"]), 0) + 1
    return {"transformers_version": importlib.metadata.version("transformers"),
            "transformers_root": root,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("position_audit.py")
            else "tools.position_audit.audit()",
            "patterns": PATTERNS,
            "model_types": audited, "unresolved": unresolved,
            "counts_distinct_hits": counts, "hits": hits}


def _by_rule(hits, verdict):
    """hits of ``verdict`` grouped per rule: rule index -> {(where, code): (model types, locations)}."""
    out: Dict[Optional[int], Dict[Tuple[str, str], Tuple[set, list]]] = {}
    for g in hits:
        if g["verdict"] != verdict:
            continue
        mts, locs = out.setdefault(g.get("rule"), {}).setdefault((g["where"], g["code"]), (set(), []))
        mts.update(g["model_types"])
        locs += [loc for loc in g["locations"] if loc not in locs]
    return out


def markdown(res: dict) -> str:
    out = [f"# Shard-local positions / sizes in transformers {res['transformers_version']}'s causal LMs",
           "", f"`{res['command']}`, {res['date']}; {len(res['model_types'])} model types audited "
           f"(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), {len(res['hits'])} distinct hits (pattern, line, function, "
           "guard): " + ", ".join(f"{k} {v}" for k, v in sorted(res["counts_distinct_hits"].items())) + ".",
           "", "Verdicts: see tools/position_audit.py (RULES). Under SP ds_longctx passes the shard's global "
           "position_ids and use_cache=False; the attention runs on the gathered sequence.", ""]
    for verdict, title in (("WRONG", "WRONG under SP (silent)"), ("review", "review (not settled by this audit)"),
                           ("handled", "handled by ds_longctx")):
        out += [f"## {title}", ""]
        groups = _by_rule(res["hits"], verdict)
        if not groups:
            out.append("None.")
        for ri, lines in groups.items():
            rule = RULES[ri] if ri is not None else None
            mts = sorted(set().union(*(m for m, _ in lines.values())))
            out += [f"- **{', '.join(mts)}**: {rule.why if rule else ''}"]
            if rule is not None and rule.fix:
                out.append(f"  - suggested fix: {rule.fix}")
            for (where, code), (_, locs) in sorted(lines.items()):
                out.append(f"  - `{code}` ({where}; {', '.join(locs[:3])}{' ...' if len(locs) > 3 else ''})")
        out.append("")
    noif = sorted(k for k, v in res["model_types"].items() if not v["attention_interface"])
    nopos = sorted(k for k, v in res["model_types"].items() if v["attention_interface"]
                   and not v["forward_takes_position_ids"])
    out += ["## model types whose attention does not call transformers' attention interface", "",
            "ds_longctx's SP attention is installed in ALL_ATTENTION_FUNCTIONS; these fail to load with sdpa / flash, "
            "are multimodal wrappers whose language model is another model type, or call their own attention "
            "(falcon calls torch's SDPA itself when _attn_implementation == 'sdpa': whether ds_longctx refuses it is "
            "not checked here). Their hits are 'no_interface':", "", ", ".join(noif),
            "", "## model types whose causal-LM forward has no position_ids parameter", "",
            "(the position_ids ds_longctx passes land in **kwargs; whisper's decoder reads them from there, the "
            "BART family and MusicGen do not: WRONG above)", "", ", ".join(nopos), ""]
    for verdict in ("refused", "harmless", NO_INTERFACE):
        counts: Dict[str, int] = {}
        for g in res["hits"]:
            if g["verdict"] == verdict:
                counts[g["why"]] = counts.get(g["why"], 0) + 1
        out += [f"## {verdict} (distinct hits per reason)", ""]
        out += [f"- {n}: {why}" for why, n in sorted(counts.items(), key=lambda x: -x[1])] + [""]
    return "\n".join(out)


NO_INTERFACE = "no_interface"
NO_INTERFACE_WHY = ("only in model types whose attention does not call transformers' attention interface "
                    "(ALL_ATTENTION_FUNCTIONS): ds_longctx's SP attention cannot be installed in them")

# ---------------------------------------------------------------------------------------------------------------
# the verdict table (first match wins). Reviewed against transformers 5.24's code; a hit no rule matches fails
# tests/test_position_audit.py, and so does a change of the WRONG set.
# ---------------------------------------------------------------------------------------------------------------

_MASK = ("builds the attention mask for the shard; ds_longctx's SP attention accepts only a plain causal mask (or "
         "none) and then ignores it, raising for any other (attention/hf.py _check_mask)")
_NO_CACHE = "cache bookkeeping: ds_longctx runs with use_cache=False and no past_key_values, so it is 0 / unused"
_RESHAPE = "the shard's own length, used to shape / slice / loop over the shard's own tensor"
_DEFAULT_POS = ("positions made only when the caller passes none; ds_longctx's forward passes the shard's global "
                "position_ids on every rank")
_MIXER = ("inside a non-attention sequence mixer (Mamba/SSM, gated-delta / linear / lightning attention, short "
          "convolution, recurrent scan): it mixes only the rank's shard whatever its positions; ds_longctx refuses "
          "such layers under SP (checks.check_sp_attention_pattern: layer_types other than full/sliding; "
          "models.attention_shape: no attention heads)")
_MEDIA = "runs on image / audio / patch features, not on the token sequence's positions"
_MOE = "per-token routing in an MoE / MLP block: local shapes only reshape the shard's tokens"
_MIXER_WHERE = (r"Mamba|Mixer|GatedDeltaNet|DeltaAttention|conv1d|ShortConv|Convolution|segment_sum|delta_rule|"
                r"kimi_delta|selective|Rglru|RecurrentBlock|LightningAttention|RMSNormGated|ForgetGate|_short_conv|"
                r"_rnn_scan|rwkv|LinearAttention|create_recurrent_attention_mask|mamba|ssd_")
_MEDIA_WHERE = (r"Vision|Audio|Image|Patch|get_image_features|get_audio_features|get_placeholder_mask|"
                r"MultiModalProjector|adaptive_enc_mask|unfold_tensor|VisionEmbedder|_prepare_patch_cross_attention_mask|"
                r"process_patch_lengths|byte_group_hash|rolling_polynomial_hash|Patcher|_patch_ids_from_lengths|"
                r"get_block_sequence_ids_for_mask")

RULES: List[Rule] = [
    # ---- WRONG: silent errors under SP -------------------------------------------------------------------------
    Rule("refused", "PhiMoE's own rotary forward picks long_mscale vs short_mscale from the shard's max(position_ids)+1 "
         "(rope type longrope): refused under SP by ds_longctx/models/rope.py (a rotary forward that reads "
         "max(position_ids) itself), found by this audit",
         line=r"seq_len = torch\.max\(position_ids\) \+ 1|rope_type\"\] != \"default\" and seq_len|"
              r"if seq_len > self\.config\.rope_parameters\[\"original_max_position_embeddings\"\]",
         where=r"modeling_phimoe:\*RotaryEmbedding\.forward",
         fix="rope.py: give PhiMoE's undecorated forward the group's length for its mscale (or refuse phimoe with "
             "rope type longrope under SP); i.e. detect rotary forwards that read max(position_ids) themselves"),
    Rule("refused", "Inkling's relative-position bias and NoPE-style log-scaling tau from torch.arange over the shard "
         "(q_positions = arange(q_length)): local token indices, and the bias is handed to the attention function as "
         "the position_bias kwarg, which ds_longctx's untied attention ignores (only s_aux is refused). Refused today only because "
         "its layer_types are 'hybrid' / 'hybrid_sliding' (checks.check_sp_attention_pattern): were those names read "
         "as full / sliding attention, it would train silently wrong",
         where=r"modeling_inkling:\*Attention\.forward", line=r"_positions = torch\.arange\(",
         fix="refuse in attention/hf.py _function_level_attention a non-None position_bias (as s_aux is), or add the "
             "SP offset to q/kv positions and apply the bias in the kernel; the tau needs temperature.py's offset"),
    Rule("refused", "Inkling2's relative distance q_positions[:, None] - kv_positions[None, :] from torch.arange over the "
         "shard: a [S/C, S/C] local distance matrix; the bias built from it goes to the attention function as the "
         "position_bias kwarg, which ds_longctx's untied attention ignores. Refused today: its layer_types are 'hybrid' / "
         "'hybrid_sliding' (checks.check_sp_attention_pattern), and it supports only eager attention "
         "(_supports_sdpa/flash/flex False)",
         where=r"modeling_inkling2(_loop)?:get_relative_distance", line=r"_positions = torch\.arange\(|^q_length = ",
         fix="same as Inkling: refuse a non-None position_bias kwarg in the SP attention functions"),
    Rule("refused", "BLT's global (patch-level) transformer positions from torch.arange over the shard's patches "
         "(restart at 0 on every rank). Refused today: BltConfig has no num_attention_heads, so "
         "models.attention_shape raises; keep it so",
         where=r"modeling_blt:\*Model\.forward", line=r"global_position_ids = torch\.arange"),
    Rule("refused", "Zaya's CCA projection mixes neighbouring tokens (causal depthwise/grouped conv over the sequence, "
         "value half from the previous token): each shard starts from zero padding instead of the previous rank's "
         "last tokens. Refused today: its config's layer_types are 'hybrid' / 'hybrid_sliding', which "
         "checks.check_sp_attention_pattern refuses (not full / sliding attention); keep it so",
         where=r"modeling_zaya:\*CCAProjection\.forward"),
    Rule("refused", "BART-family decoders (the decoder's forward has no position_ids parameter) make their learned "
         "absolute positions as torch.arange(local length) + cache length: refused under SP by "
         "ds_longctx/patching/patch.py _check_model_against (a decoder taking no position_ids), found by this audit",
         where=r"modeling_(bart|mbart|marian|pegasus|blenderbot|blenderbot_small|plbart|bigbird_pegasus):\*Decoder\.forward",
         line=r"^position_ids = torch\.arange\(seq_length, device=inputs_embeds\.device\) \+ cache_length$|"
              r"embed_positions\(\(batch_size, seq_length\), cache_length, position_ids=position_ids\)",
         fix="refuse under SP (ConfigError) a model whose causal-LM forward has no position_ids parameter, or shift "
             "embed_positions by the shard's offset (SP rank x shard length) as models/temperature.py does"),
    Rule("refused", "MusicGen's sinusoidal positions are torch.arange(local length) + cache length (its forward takes no "
         "position_ids): refused under SP by ds_longctx/patching/patch.py _check_model_against, found by this audit",
         where=r"modeling_musicgen(_melody)?:\*SinusoidalPositionalEmbedding\.forward",
         line=r"^position_ids = torch\.arange\(seq_len",
         fix="refuse under SP any model whose causal-LM forward takes no position_ids and whose decoder does not "
             "read them from **kwargs (see model_types[*].forward_takes_position_ids; whisper reads them: fine)"),
    # ---- handled by ds_longctx -----------------------------------------------------------------------------------
    Rule("handled", "transformers' dynamic / LongRoPE update from max(position_ids)+1: ds_longctx/models/rope.py runs it "
         "on the SP group's length (sp_batch header)", where=r"modeling_rope_utils:dynamic_rope_update"),
    Rule("handled", "Llama 4 NoPE attention temperature from torch.arange over the shard: ds_longctx/models/temperature.py "
         "switches it off and scales the query with global token indices in the attention function",
         where=r"modeling_llama4:\*TextAttention\.forward",
         line=r"positions = torch\.arange\(hidden_states\.shape\[1\]|past_seen_tokens = "),
    # ---- review: not settled by this audit (the report lists them) -----------------------------------------------
    Rule("refused", "sparse attention / KV compression over the shard's keys (DeepSeek-V4's compressors and indexer, "
         "qwen4_exp's QSA indexer); refused: their layer_types (heavily_compressed_attention, "
         "compressed_sparse_attention, indexed_attention, linear_attention) fail checks.check_sp_attention_pattern",
         where=r"modeling_(deepseek_v4|qwen4_exp):\*(Text)?(CSACompressor|HCACompressor|Indexer|QSAIndexer)\.forward"),
    Rule("review", "MiniMax-M3's lightning indexer compares local key indices (arange(k_len)) with the global "
         "position_ids and selects top-k key blocks among the shard's keys; its layer_types pass the SP checks. With "
         "sdpa/eager the block mask goes to _check_mask (on ranks > 0 global positions vs local keys make it "
         "non-causal: an error there, while rank 0 may pass); with flash the block_indices kwarg is ignored by HF and "
         "by ds_longctx alike. Needs a run to settle",
         where=r"modeling_minimax_m3_vl:\*Indexer\.forward"),
    Rule("refused", "qwen4_exp's attention slices the indexer's full-length cos/sin to the last local length and its "
         "n-gram embedding takes EOS as the context of the shard's first tokens (ranks > 0 need the previous rank's "
         "tokens); refused: its layer_types (linear_attention, indexed_attention) fail checks.check_sp_attention_pattern",
         where=r"modeling_qwen4_exp:\*Text(Attention|NGramEmbedding)\.|modeling_qwen4_exp:\*TextNGramEmbedding"),
    Rule("review", "Dory's shared-KV loop path keeps the last sliding_window - 1 + local query length keys",
         where=r"modeling_dory:\*Attention\.forward", line=r"num_visible"),
    Rule("refused", "Doge's dynamic mask (a score bias): Doge keeps its own ALL_ATTENTION_FUNCTIONS table, which "
         "registry._check_own_tables refuses", where=r"modeling_doge:"),
    # ---- refused / out of the SP paths -----------------------------------------------------------------------------
    Rule("refused", _MIXER, where=_MIXER_WHERE),
    # ---- harmless ----------------------------------------------------------------------------------------------
    Rule("harmless", _MASK, where=r"^masking_utils:"),
    Rule("harmless", _DEFAULT_POS, guard=r"(?<!not \()position_ids is None"),
    Rule("harmless", _NO_CACHE, line=r"get_seq_length\(|^mask_seq_length = cache_length \+ seq_length$|"
         r"^if seq_len \+ cache_length > self\.weights\.size\(0\):$|^seq_length = past_seen_tokens \+ inputs_embeds"),
    Rule("harmless", _NO_CACHE + " (the offset added is 0)",
         line=r"^position_ids = \(position_ids \+ past_seen_tokens\)\.unsqueeze\(0\)$"),
    Rule("harmless", _MEDIA, where=_MEDIA_WHERE),
    Rule("harmless", _MEDIA, line=r"audio_features|pixel_values"),
    Rule("refused", "BLT's byte patching (patch shapes of the shard's bytes): the whole model mixes bytes into "
         "patches per shard; refused (BltConfig has no num_attention_heads: models.attention_shape)",
         where=r"modeling_blt:"),
    Rule("harmless", "OPT: the given position_ids are embedded (its cumsum default runs only without them)",
         where=r"modeling_opt:\*Decoder\.forward", line=r"embed_positions\(position_attention_mask"),
    Rule("harmless", "grows the sinusoidal table to the positions asked for", line=r"self\.make_weights\("),

    Rule("harmless", _DEFAULT_POS + " (called only under `if position_ids is None`)",
         where=r"create_position_ids_from_(inputs_embeds|input_ids)"),
    Rule("harmless", "sinusoidal table over the config's max positions (built in __init__ / grown), indexed by positions",
         where=r"create_sinusoidal_positions|positional_encoding|SinusoidalPositionalEmbedding\.get_embedding"),
    Rule("harmless", "multimodal rope (3/4-row position_ids): expands or selects rows of the position_ids passed in",
         line=r"^position_ids = position_ids\[None, \.\.\.\]\.expand\(|^position_ids = position_ids\[1:\]$|"
              r"^text_position_ids = position_ids\[0\]$"),
    Rule("harmless", "a mask of ones for the shard (no padding), used for masks / default positions only",
         line=r"(attention_mask|position_attention_mask) = torch\.ones\("),
    Rule("harmless", "length of the local sequence for token_type_ids / loop bookkeeping / early exits",
         line=r"^seq_length = inputs_embeds\.shape\[1\]$|^seq_length = input_shape\[1\]$|"
              r"^batch_size, seq_length = input_shape$|^if seq_len == 1 or any\(|^num_pre_loop_blocks = |"
              r"^\*inputs_embeds\.shape\[:-1\],$|torch\.full\(\[\*\w+\.size\(\)\[:-1\]\], -1"),

    Rule("harmless", _MOE, where=r"MoE|Moe|MoeBlock|Router|Experts|CDMoE|load_balancing_loss_func|TextMoe"),
    Rule("harmless", "rotary cos/sin from the position_ids passed in (global under SP)",
         line=r"position_ids\[\.\.\., None\]\.float\(\) \* (self\.)?inv_freq"),
    Rule("harmless", "repeat_kv / MLA expand of the shard's keys: local shapes", where=r":repeat_kv$|expand_kv$"),
    Rule("harmless", _RESHAPE,
         line=r"^(?!.*(arange|position|cumsum|offset)).*(\.(view|reshape|expand|new_empty|new_zeros|new_ones|unflatten|flatten)\(|hidden_shape = |input_shape = |"
              r"_shape = \(|kv_shape = |shape_[qkv]+ = |output_shape = )"),
    Rule("harmless", "the shard's length unpacked from a tensor shape: each later use of the name is a hit of its own",
         pattern="shape unpack"),
    Rule("harmless", "the shard's length unpacked from a tensor shape: each later use of the name is a hit of its own",
         line=r"^\(?\w+\s*,\s*\w+(\s*,\s*\w+)*\)?\s*=\s*[\w.\[\]]+\.(shape|size\(\))\s*(\[:-?\d\])?$"),
    Rule("harmless", "logits_to_keep / labels slicing of the shard's logits (ds_longctx computes the loss itself)",
         where=r"ForCausalLM\.forward|ForConditionalGeneration\.forward"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--md", default=None, help="write the markdown summary here")
    ap.add_argument("--model-type", action="append", default=None, help="audit only these (repeatable)")
    a = ap.parse_args(argv)
    res = audit(a.model_type)
    if a.out:
        with open(a.out, "w") as f:  # one hit per line: 2,700 groups stay readable and diffable
            body = {k: v for k, v in res.items() if k != "hits"}
            body["model_types"] = {k: {**v, "functions": len(v["functions"])} for k, v in res["model_types"].items()}
            body["rules"] = [dict(vars(r)) for r in RULES] + [{"verdict": NO_INTERFACE, "why": NO_INTERFACE_WHY}]
            # hits carry their rule's index (the why is in "rules"; index len(RULES): no_interface)
            hits = [{**{k: v for k, v in g.items() if k != "why"},
                     "rule": g["rule"] if g["verdict"] != NO_INTERFACE else len(RULES)} for g in res["hits"]]
            for g in hits:  # every location of what needs action; the first one of the rest
                if g["verdict"] not in ("WRONG", "review", "handled", None) and len(g["locations"]) > 1:
                    g["locations"] = g["locations"][:1] + [f"... {len(g['locations']) - 1} more"]
            text = json.dumps(body, indent=1)[:-2]
            text += ',\n "hits": [\n' + ",\n".join(json.dumps(g) for g in hits) + "\n ]\n}\n"
            f.write(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(res))
    unknown = [g for g in res["hits"] if g["verdict"] is None]
    print(f"{len(res['model_types'])} model types, {len(res['hits'])} distinct hits, "
          f"{res['counts_distinct_hits']}")
    for g in unknown:
        print(f"NO VERDICT: {g['pattern']}: {g['code']}  [{g['where']}]  {g['locations'][0]}  "
              f"({len(g['model_types'])} types)")
    for g in res["hits"]:
        if g["verdict"] == "WRONG":
            print(f"WRONG: {g['code']}  [{g['where']}]  {', '.join(g['model_types'])}")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
