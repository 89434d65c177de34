"""The one owner of the process-wide patches ``enable()`` installs: every patch is (owner, attribute, replacement),
recorded with the original it replaced, so ``disable()`` undoes them all, in reverse order, by construction (no
per-patch undo code that could miss one). Keyed by a short name ("initialize", "sp_adapter", "skip:<module>", ...)
so the wrappers find the original they wrap."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

_MISSING = object()


class PatchTable:
    """Installed patches, in installation order. Reads like a dict of the originals (``table["initialize"]``)."""

    def __init__(self):
        self._entries: Dict[str, Tuple[Any, str, Any]] = {}   # key -> (owner, attribute, original)
        self._order: List[str] = []

    def install(self, key: str, owner, attribute: str, replacement, original=_MISSING) -> None:
        """``setattr(owner, attribute, replacement)``, remembering the original (``original``: what to put back,
        e.g. a classmethod's raw ``__dict__`` entry, when it differs from ``getattr``)."""
        if key in self._entries:
            raise RuntimeError(f"patch {key!r} is already installed")
        if original is _MISSING:
            original = getattr(owner, attribute)
        self._entries[key] = (owner, attribute, original)
        self._order.append(key)
        setattr(owner, attribute, replacement)

    def undo(self) -> None:
        """Every patch undone, the last installed first."""
        for key in reversed(self._order):
            owner, attribute, original = self._entries.pop(key)
            setattr(owner, attribute, original)
        self._order.clear()

    # the originals, as a mapping
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __getitem__(self, key: str):
        return self._entries[key][2]

    def __setitem__(self, key: str, original) -> None:
        """Replace the original an installed patch will restore and wrap (tests inject a stand-in this way)."""
        owner, attribute, _ = self._entries[key]
        self._entries[key] = (owner, attribute, original)

    def get(self, key: str, default=None):
        entry = self._entries.get(key)
        return default if entry is None else entry[2]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


__all__ = ["PatchTable"]
