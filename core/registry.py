"""A name -> object registry, filled by a decorator where the object is defined: agent loops, tool
parsers, interactions and reward functions each keep one (`rollout.agent_loop.base.LOOPS`, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # what the error messages call an entry, e.g. "tool parser"
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under `name` (the same object twice is fine)."""

        def wrap(obj: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and existing is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered by {_label(existing)}")
            self._entries[name] = obj
            return obj

        return wrap

    def get(self, name: str, *, hint: str = "") -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}{hint}")
        return self._entries[name]

    def find(self, name: str) -> T | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _label(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)
