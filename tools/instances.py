"""Per-trajectory instance state shared by tools and interactions (one instance per trajectory)."""

from __future__ import annotations

import uuid
from typing import Any


class InstanceStore:
    """Instance id -> mutable state dict; `kind` and `owner` only shape the error message."""

    def __init__(self, kind: str, owner: str) -> None:
        self.kind = kind
        self.owner = owner
        self._states: dict[str, dict[str, Any]] = {}

    def start(self, instance_id: str | None, state: dict[str, Any]) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._states[instance_id] = dict(state)
        return instance_id

    def get(self, instance_id: str) -> dict[str, Any]:
        try:
            return self._states[instance_id]
        except KeyError:
            raise ValueError(
                f"{self.kind} {self.owner!r} has no instance {instance_id!r} (not started or already released)"
            ) from None

    def drop(self, instance_id: str) -> None:
        self._states.pop(instance_id, None)

    def __len__(self) -> int:
        return len(self._states)
