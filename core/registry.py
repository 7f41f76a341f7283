"""A name -> object registry, filled by a decorator where the object is defined: agent loops, tool
parsers, interactions and reward functions each keep one (`rollout.agent_loop.base.LOOPS`, ...); and
`import_object`, which finds an object a config names by its import path instead."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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


def import_object(path: str) -> Any:
    """Import `package.module:attr` or `package.module.attr`."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path like 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):  # `module:Class.method`
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj
