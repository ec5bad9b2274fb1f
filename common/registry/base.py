"""The one registry every link looks its backends up in: names -> entries (a backend's spec, or a factory)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """The backends of one link by name. `lookup` answers a name it does not know with the field that named it,
    the name and the names it knows; `load` imports a registered backend's module (`entry.module`: a path written in
    a registry table, never one taken from a config) and returns one of its functions. A dict: tests and plug-ins
    register a backend by setting a name."""

    def __init__(self, field: str, kind: str, entries: Mapping[str, T], *, otherwise: str = ""):
        """`field`: the config field (or argument) whose value is looked up; `kind`: what an entry is, for messages;
        `otherwise`: what else the field takes, appended to the list of names (e.g. ", or null for ...")."""
        super().__init__(entries)
        self.field, self.kind, self.otherwise = field, kind, otherwise

    def unknown(self, name: Any) -> str:
        """The message for a name that is not registered, without the field (pydantic puts it in front)."""
        return f"unknown {self.kind} {name!r}; choose one of {sorted(self)}{self.otherwise}"

    def lookup(self, name: str) -> T:
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"{self.field}: {self.unknown(name)}") from None

    def load(self, name: str, function: str) -> Callable[..., Any]:
        """`function` of the module that `name`'s entry names, imported on first use."""
        return getattr(importlib.import_module(self.lookup(name).module), function)
