"""One registry per component kind, with plugin discovery through entry points.

Every extension point of treelit (tree builders, attention backends, recurrent
layer backends, partition strategies, objectives, advantage estimators, models)
is a :class:`Registry`. Built-in components register themselves with a
decorator when their module is imported; third-party packages declare entry
points in the group ``treelit.<kind>`` and are loaded lazily, the first time a
name is looked up or the registry is listed. Unknown or duplicate names fail
loudly, listing what is known and where each entry came from, so a typo in a
config never turns into a silent fallback.

This module is the bottom of the package: it imports nothing of treelit and knows
no entries. The complete listing (every kind, its module imported) is
:func:`treelit.components.all_registries`, where the entries are known.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Dict, Iterator, List, Optional

__all__ = ["Registry", "RegistryError", "get_registry", "registries"]


class RegistryError(KeyError):
    """Raised for unknown or duplicate registry names."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    source: str  # "treelit" for built-ins, "plugin <dist> (<entry point>)" otherwise


class Registry:
    """A named collection of components of one kind.

    Args:
        kind: the component kind, e.g. ``"attention"``; plugins register through the
            entry-point group ``treelit.<kind>``.
        builtin_modules: modules imported on first use so that their decorators run.
    """

    def __init__(self, kind: str, builtin_modules: Optional[List[str]] = None) -> None:
        self.kind = kind
        self.group = f"treelit.{kind}"
        self._entries: Dict[str, Entry] = {}
        self._builtin_modules = list(builtin_modules or [])
        self._builtins_loaded = False
        self._plugins_loaded = False

    # registration -----------------------------------------------------------------
    def register(self, name: str, obj: Any = None, *, source: str = "treelit") -> Any:
        """Register ``obj`` under ``name``; usable as ``@registry.register("name")``."""
        if obj is None:
            return lambda o: self.register(name, o, source=source)
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind}: a component name must be a non-empty string, got {name!r}")
        if name in self._entries:
            old = self._entries[name]
            if old.obj is obj:
                return obj
            raise RegistryError(
                f"duplicate {self.kind} name {name!r}: already registered by {old.source}, "
                f"now again by {source}"
            )
        self._entries[name] = Entry(name, obj, source)
        return obj

    # discovery ---------------------------------------------------------------------
    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        for mod in self._builtin_modules:
            importlib.import_module(mod)

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.group):
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            source = f"plugin {dist} ({ep.value})"
            if ep.name in self._entries and self._entries[ep.name].source == source:
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not hide the others silently
                raise RegistryError(
                    f"failed to load {self.kind} plugin {ep.name!r} from {source}: {exc!r}"
                ) from exc
            # A plugin module may register itself on import; accept that as the same entry.
            existing = self._entries.get(ep.name)
            if existing is not None and existing.obj is obj:
                continue
            self.register(ep.name, obj, source=source)

    def _ensure_loaded(self) -> None:
        self._load_builtins()
        self._load_plugins()

    # lookup ------------------------------------------------------------------------
    def get(self, name: str) -> Any:
        self._load_builtins()
        if name not in self._entries:
            self._load_plugins()
        if name not in self._entries:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; known {self.kind} names: {self.describe()}"
            )
        return self._entries[name].obj

    def __contains__(self, name: str) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def names(self) -> List[str]:
        self._ensure_loaded()
        return sorted(self._entries)

    def entries(self) -> List[Entry]:
        self._ensure_loaded()
        return [self._entries[n] for n in sorted(self._entries)]

    def describe(self) -> str:
        return ", ".join(f"{e.name} [{e.source}]" for e in self.entries()) or "(none)"

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


_REGISTRIES: Dict[str, Registry] = {}


def get_registry(kind: str, builtin_modules: Optional[List[str]] = None) -> Registry:
    """Return the registry of ``kind``, creating it on first use."""
    reg = _REGISTRIES.get(kind)
    if reg is None:
        reg = _REGISTRIES[kind] = Registry(kind, builtin_modules)
    elif builtin_modules:
        for m in builtin_modules:
            if m not in reg._builtin_modules:
                reg._builtin_modules.append(m)
                reg._builtins_loaded = False
    return reg


def registries() -> Dict[str, Registry]:
    """The registries created so far, by kind (all of them: :func:`treelit.components.all_registries`)."""
    return dict(sorted(_REGISTRIES.items()))

