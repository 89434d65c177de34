"""The package's import layers (DESIGN.md: data flows config -> checks -> layout -> patch -> engine -> step; no
module reaches back up): every ds_longctx module imports, at module or at function level, only modules of its own
layer or below; the config schema is a leaf (it imports errors.py alone); and every import of a ds_longctx module inside a
function is listed below with the reason it stays there (a new one fails here until it is hoisted or justified).

Read statically (ast), as /work/shared/tools/import_cycles.py reads the package: a package's ``__init__`` is a
module of the layer of what it exports (``memory``: the install ``apply_memory_stack``), and importing a submodule
(``memory.keep``) is an edge to that submodule only."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_longctx")

# bottom to top; a module may import its own layer and the layers before it. Folders (README's layout) group modules
# by job; a folder's modules may sit on several layers (job/checkpoint's low, job/agreement's above the planner).
KERNELS = tuple(f"attention.kernels.{m}" for m in ("base", "banded", "sdpa", "flash_attn", "ops", "choice",
                                                   "reference"))
CHECKPOINT = tuple(f"job.checkpoint.{m}" for m in ("tags", "savedir", "resume", "universal", "record", "export",
                                                                 "manifest"))
LAYERS = (
    ("leaves", ("_version", "config.shipped", "dist.preemptible", "errors", "config", "config.schema", "loss",
                "dist.comm", "planner.units", "planner.recurrent", "measure", "measure.fake", "measure.allocator",
                "measure.flops", "measure.simulation", "memory.arena", "memory.keep", "memory.tiles",
                "job.checkpoint.faults", "train.log", "hf.patches", "dist", "eval", "hf", "job", "patching", "objectives")),
    ("facts", ("models", "models._common", "models.gemma", "models.llama", "models.others", "models.qwen",
               "models.windows", "models.logits", "models.loading", "models.hybrid", "models.adapters", "models.rope",
               "models.temperature", "models.moe", "models.packing", "models.weights", "config.rope_scaling",
               "dist.layout", "dist.launch", "dist.verdicts", "data.batch", "data.sources", "data.token_cache",
               "data.corpus", "measure.formula", "planner.model_states", "planner.rates", "planner.objectives")),
    ("process and data", ("dist.runtime", "data", "data.loaders", "data.turns", "hf.loader", "eval.evaluate",
                          "measure.live_bytes", "job.checkpoint", "job.metrics", "job.adam", "objectives.pack",
                          "objectives.reduce", "objectives.distill") + CHECKPOINT),
    ("ops", ("attention.kernels", "attention.documents", "attention.untied", "attention.block", "attention.registry",
             "attention.ring",
             "memory.offload", "memory.nvme", "memory.norm", "memory.checkpointing", "memory.tiling") + KERNELS),
    ("checks and spec", ("patching.checks", "patching.spec", "patching.compat")),
    ("installs", ("attention", "attention.hf", "attention.ulysses", "attention.mixers", "memory",
                  "objectives.replicated", "patching.sp_batch")),
    ("patch", ("patching.patch",)),
    ("planner and profiler", ("planner", "planner.simulate", "planner.host", "planner.search", "planner.core",
                              "planner.cli", "job.profiler")),
    ("orchestration", ("", "initialize", "hf.integration", "job.agreement", "job.hostmem", "job.watchdog",
                       "job.preflight", "objectives.logprobs", "hf.rl")),
    ("the commands", ("train", "train.__main__", "train.args", "train.stages", "train.job", "train.loop",
                      "eval.needle", "eval.needle_cli", "eval.ruler", "eval.ruler_cli", "cli")),
)

# (module, imported module) -> why the import stays inside a function (a new one fails here until it is hoisted or
# justified): a public wrapper defined with its own docstring in the package __init__.
FUNCTION_LEVEL = {
    ("", "hf.integration"): "ds_longctx.enable()/disable(): documented wrappers in the package __init__ (hoistable)",
    ("", "planner"): "ds_longctx.plan(): a documented wrapper in the package __init__ (hoistable)",
}
# cli.py dispatches: each verb imports the module it runs when it runs (ds-longctx configs and launch load none)
FUNCTION_LEVEL.update({("cli", m): "cli.py's lazy dispatch per verb" for m in (
    "dist.preemptible", "eval.needle_cli", "eval.ruler_cli", "job.checkpoint", "models.loading", "planner.cli")})


def _modules():
    out = {}
    for root, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[:-len("__init__")].rstrip(".") if name.endswith("__init__") else name] = path
    return out


def _imports(name, path, modules):
    """(imported module, inside a function) for every ds_longctx import of ``name``."""
    is_pkg = path.endswith("__init__.py")
    tree = ast.parse(open(path).read())
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = name.split(".") if (is_pkg and name) else name.split(".")[:-1]
            base = [p for p in base if p]
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            prefix = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{prefix}.{a.name}".lstrip(".") if f"{prefix}.{a.name}".lstrip(".") in modules else prefix
                       for a in node.names]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            targets = [m[len("ds_longctx"):].lstrip(".") for m in mods if m == "ds_longctx" or
                       m.startswith("ds_longctx.")]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t != name and t in modules:
                found.add((t, id(node) in in_function))
    return found


def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_layer():
    modules, _ = _graph()
    placed = [m for _, ms in LAYERS for m in ms]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    missing = sorted(set(modules) - set(placed))
    assert not missing, f"give these modules a layer in tests/test_layers.py LAYERS: {missing}"


def test_no_module_imports_a_higher_layer():
    modules, graph = _graph()
    layer = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}
    upward = sorted(f"{m or 'ds_longctx'} ({LAYERS[layer[m]][0]}) imports {t} ({LAYERS[layer[t]][0]})"
                    for m, edges in graph.items() for t, _ in edges
                    if m in layer and t in layer and layer[t] > layer[m])
    assert upward == [], "\n".join(upward)


def test_config_is_a_leaf():
    """The schema imports errors.py alone; the config package re-exports the schema alone."""
    _, graph = _graph()
    assert {t for t, _ in graph["config.schema"]} == {"errors"}
    assert {t for t, _ in graph["config"]} == {"config.schema"}


def test_function_level_imports_are_counted_and_justified():
    _, graph = _graph()
    inside = {(m, t) for m, edges in graph.items() for t, fn in edges if fn}
    unlisted = sorted(inside - set(FUNCTION_LEVEL))
    stale = sorted(set(FUNCTION_LEVEL) - inside)
    assert not unlisted, f"hoist these to module level (no cycle forces them) or justify them: {unlisted}"
    assert not stale, f"no longer inside a function: remove them from FUNCTION_LEVEL: {stale}"
