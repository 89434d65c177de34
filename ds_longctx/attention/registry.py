"""The one writer of transformers' attention table (``ALL_ATTENTION_FUNCTIONS``).

HF models look their attention function up by name (``config._attn_implementation``) in a
process-global table, so an SP attention has to be installed there. Every install in ds_longctx
(DeepSpeed's Ulysses and our function-level untied attention) goes through :func:`install`, which
puts ONE dispatcher per implementation name into the table and routes by module: modules of a
patched model get that model's function, every other module (a second, unpatched model; a
reference model in a test) keeps the function the table held before. :func:`uninstall` undoes one
install and puts the original back when the last one is gone; :func:`restored` undoes everything
installed inside it (the planner runs many configurations in one process). :func:`displace` takes a
foreign SP wrapper (DeepSpeed's ``register_with_transformers``) out of the table while ds_longctx
owns the name, and puts it back when ds_longctx releases it.

Only the public mapping interface of the table is used (``table[name]`` / ``table[name] = fn``).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

from ..errors import ConfigError


def _table():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


@dataclass
class _Slot:
    """One implementation name we took over: the function it held before and our dispatcher."""
    original: Callable
    dispatcher: Callable
    # module -> attention function (weak: a freed model leaves no trace)
    modules: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = field(default_factory=weakref.WeakKeyDictionary)


_SLOTS: Dict[str, _Slot] = {}
# impl -> a foreign wrapper :func:`displace` took out (DeepSpeed's register_with_transformers); it goes
# back into the table when ds_longctx releases that name
_DISPLACED: Dict[str, Callable] = {}


@dataclass
class Installation:
    """Handle of one :func:`install`: the modules routed to ``fn`` under ``impl``."""
    impl: str
    fn: Callable
    label: str
    modules: List["weakref.ref"]
    active: bool = True

    def remove(self) -> None:
        uninstall(self)


def original(impl: str) -> Callable:
    """The function the table held for ``impl`` before ds_longctx took it over (the core attention an
    SP wrapper calls on the gathered sequence)."""
    slot = _SLOTS.get(impl)
    return slot.original if slot is not None else _table()[impl]


def is_installed(module: torch.nn.Module) -> bool:
    return any(module in slot.modules for slot in _SLOTS.values())


def _make_dispatcher(impl: str, original_fn: Callable) -> Callable:
    def dispatch(module, query, key, value, attention_mask, *args, **kwargs):
        slot = _SLOTS.get(impl)
        fn = slot.modules.get(module) if slot is not None else None
        if fn is None:  # the slot's original, which displace() may have replaced by the core it wrapped
            orig = slot.original if slot is not None else original_fn
            return orig(module, query, key, value, attention_mask, *args, **kwargs)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    dispatch._ds_longctx_dispatcher = impl
    return dispatch


def install(model: torch.nn.Module, impl: str, fn: Callable, label: str) -> Installation:
    """Route attention calls of every module of ``model`` under implementation name ``impl`` to ``fn``
    (same signature as transformers' attention functions). ``label`` names the install in errors."""
    table = _table()
    if impl not in table:
        raise KeyError(f"{impl!r} is not in transformers' attention table (known: {sorted(table)})")
    mods = list(model.modules())
    for slot_impl, slot in _SLOTS.items():
        taken = next((m for m in mods if m in slot.modules), None)
        if taken is not None:
            raise RuntimeError(f"{label}: the model's attention is already installed under {slot_impl!r}; "
                               "remove the earlier patch first")
    slot = _SLOTS.get(impl)
    if slot is None:
        prev = table[impl]
        slot = _Slot(original=prev, dispatcher=_make_dispatcher(impl, prev))
        _SLOTS[impl] = slot
        table[impl] = slot.dispatcher
    _check_own_tables(mods, impl, table, label)
    for m in mods:
        slot.modules[m] = fn
    return Installation(impl=impl, fn=fn, label=label, modules=[weakref.ref(m) for m in mods])


def _check_own_tables(mods, impl: str, table, label: str) -> None:
    """A modeling file may keep its own attention table (transformers: "a model that needs to locally
    overwrite an existing attention function ... declares a new instance", Doge does); its modules look
    ``impl`` up there and would never reach our dispatcher: its attention would run as is, on the local
    sequence shard. Refused, before anything is routed."""
    import sys

    for cls in {type(m) for m in mods}:
        own = getattr(sys.modules.get(cls.__module__), "ALL_ATTENTION_FUNCTIONS", None)
        if own is None or own is table or not hasattr(own, "get_interface"):
            continue
        try:
            theirs = own[impl]
        except KeyError:
            continue
        if theirs is not table[impl]:
            raise ConfigError("long_context.attention.implementation",
                              f"{label}: {cls.__name__} looks its attention up in its own table "
                              f"({cls.__module__}.ALL_ATTENTION_FUNCTIONS), where {impl!r} is not ds_longctx's: its "
                              "attention would run unchanged on each rank's sequence shard",
                              "this model has no sequence-parallel path yet: train it at sequence_parallel_size 1 "
                              "with long_context.attention.implementation 'none'")


def uninstall(inst: Installation) -> None:
    """Undo one :func:`install` (idempotent). The table gets its original function back once no module
    is routed any more."""
    if not inst.active:
        return
    inst.active = False
    slot = _SLOTS.get(inst.impl)
    if slot is None:
        return
    for ref in inst.modules:
        m = ref()
        if m is not None and slot.modules.get(m) is inst.fn:
            del slot.modules[m]
    if len(slot.modules) == 0:
        _release(inst.impl)


def _release(impl: str) -> None:
    slot = _SLOTS.pop(impl)
    table = _table()
    # someone who wrote the table after us (DeepSpeed's register_with_transformers) keeps their entry
    if table[impl] is slot.dispatcher:
        table[impl] = _DISPLACED.pop(impl, slot.original)


def displace(impl: str, core: Callable) -> None:
    """Put ``core`` where a foreign wrapper around it sits under ``impl`` (DeepSpeed's
    ``register_with_transformers`` wrapper: our SP attention on top of it would all-to-all twice).
    The wrapper is kept and goes back into the table when ds_longctx releases ``impl`` (the last
    install under it is removed, or :func:`undisplace`), so the table ends as the user left it."""
    table = _table()
    slot = _SLOTS.get(impl)
    if slot is not None and table[impl] is slot.dispatcher:
        # registered before our first install: the wrapper is what our dispatcher falls back to
        _DISPLACED.setdefault(impl, slot.original)
        slot.original = core
        return
    # in the table itself (no slot yet, or written over our dispatcher: then ``core`` is the dispatcher)
    _DISPLACED.setdefault(impl, table[impl])
    table[impl] = core


def undisplace(impl: str) -> None:
    """Undo :func:`displace` for ``impl`` now (no-op when nothing is displaced)."""
    if impl not in _DISPLACED:
        return
    wrapper = _DISPLACED.pop(impl)
    table = _table()
    slot = _SLOTS.get(impl)
    if slot is not None and table[impl] is slot.dispatcher and wrapper is not slot.dispatcher:
        slot.original = wrapper
    else:
        table[impl] = wrapper


@contextlib.contextmanager
def restored():
    """Everything installed inside the block is undone at its end, and the table holds what it held
    at the start: for callers that patch many throwaway models in one process (the planner)."""
    before = {impl: dict(slot.modules) for impl, slot in _SLOTS.items()}
    displaced_before = set(_DISPLACED)
    try:
        yield
    finally:
        for impl in set(_DISPLACED) - displaced_before:
            undisplace(impl)
        for impl in list(_SLOTS):
            if impl not in before:
                _release(impl)
            else:
                slot = _SLOTS[impl]
                slot.modules.clear()
                slot.modules.update(before[impl])


def installed_labels(model: torch.nn.Module) -> List[str]:
    """Implementation names under which ``model``'s modules are routed (for ``extra_repr``)."""
    mods = set(map(id, model.modules()))
    return [impl for impl, slot in _SLOTS.items() if any(id(m) in mods for m in list(slot.modules.keys()))]


__all__ = ["install", "uninstall", "restored", "original", "is_installed", "Installation", "displace", "undisplace",
           "wrap"]


def wrap(inst: Installation, modules, wrapper: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Route ``modules`` (routed by ``inst``) to ``wrapper(fn)`` instead of ``inst``'s function (a per-module step
    before or after it, e.g. models/temperature.py's query scaling); returns the undo."""
    slot = _SLOTS[inst.impl]
    mods = [m for m in modules if m in slot.modules]
    for m in mods:
        slot.modules[m] = wrapper(slot.modules[m])

    def undo():
        for m in mods:
            if m in slot.modules:
                slot.modules[m] = inst.fn

    return undo
