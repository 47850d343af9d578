"""Things known by name: the training sets, the objectives, the evaluation sets (tasks) and the decodings each keep
one `Registry`, so that configs, files and reports spell them alike, a plug-in adds one with `register`, and an
unknown name fails the same way everywhere (one line that lists the known names).

Light on purpose: an entry may be given as `"module:attribute"`, imported when it is first looked up, so that checking
a config's names imports nothing heavy (the decodings live beside torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from clozemath.errors import ClozeMathError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, listed in the order they came (the built-in ones first, then those registered)."""

    def __init__(self, kind: str, built_in: Iterable[tuple[str, T | str]], context: str = "") -> None:
        """`kind`: what an entry is called in the error ("objective"); `built_in`: (name, entry or "module:attribute")
        pairs; `context`: the error's prefix (`"decode: "`)."""
        self._kind, self._context = kind, context
        self._entries: dict[str, T | str] = dict(built_in)

    def register(self, name: str, entry: T) -> T:
        """Make `entry` known as `name` (registering a name again replaces it)."""
        self._entries[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self) -> Iterator[str]:
        """The names, as a dict's keys."""
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            known = ", ".join(self._entries)
            raise ClozeMathError(f"{self._context}unknown {self._kind} '{name}' (known: {known})")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), attribute)
        return entry

    def entries(self) -> list[T]:
        """Every entry, in the order of `names()`."""
        return [self[name] for name in self._entries]
