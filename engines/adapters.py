"""Which LoRA adapter serves each policy_version on one engine, and when an old one may go.

With LoRA adapter sync (`learner.lora.sync = "adapter"`) an engine serves its base weights plus one
vLLM adapter per committed policy_version. Every request names the adapter that is current when it
is submitted and keeps it to its end (vLLM fixes a request's adapter at submission), so each of its
tokens is sampled by exactly that version, also when a KEEP pause lets it run on across a later
commit. An ABORT pause ends in-flight requests instead; their trajectories park, and the requests that
resume them are new ones that name the adapter current after the commit.

`AdapterTable` is the engine's bookkeeping (pure: no vLLM, no I/O; `VLLMEngine` carries out what it
returns). An adapter is unloaded only once it is not current and no request that names it is left:
when its last request ends, or at the commit that replaces it if none is left then. The table holds at
most `capacity` adapters (vLLM's `max_loras`). When a commit needs a slot and every adapter held is
still named by requests, the requests naming the oldest are ended first (aborted: they return their
tokens, each labelled with the version that sampled it, and their trajectories park and resume under
the new version), then it is unloaded. With capacity >= 2 the current adapter is never the one
evicted, so a commit that fails to load leaves the engine serving what it served.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedAdapter:
    """One adapter loaded in the engine's vLLM (what the worker's `load_adapter` returned)."""

    policy_version: int
    name: str  # vLLM's lora_name
    adapter_id: int  # vLLM's lora_int_id, >= 1
    path: str  # the peft folder vLLM loaded it from


@dataclass(kw_only=True, slots=True)
class Room:
    """What a commit must do before it loads a new adapter: end `abort` (request ids), then unload
    `unload` (policy_versions)."""

    unload: list[int]
    abort: list[str]


class AdapterTable:
    """One engine's adapters and the requests that name them (see the module doc)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(
                f"an engine serving LoRA adapters holds at least 2 (the served one and the next), got {capacity}"
            )
        self.capacity = capacity
        self.current: ServedAdapter | None = None  # None: no adapter yet, the base weights serve
        self._held: dict[int, ServedAdapter] = {}  # policy_version -> adapter, oldest first
        self._named: dict[str, int] = {}  # request id -> the policy_version of the adapter it names

    @property
    def held_versions(self) -> list[int]:
        """The policy_versions whose adapters are loaded, oldest first."""
        return list(self._held)

    def acquire(self, request_id: str) -> ServedAdapter | None:
        """The adapter a new request names: the current one (None before the first adapter)."""
        if request_id in self._named:
            raise ValueError(f"request {request_id} already names an adapter")
        if self.current is not None:
            self._named[request_id] = self.current.policy_version
        return self.current

    def release(self, request_id: str) -> list[int]:
        """The request ended (or was never started); returns the policy_versions to unload now."""
        self._named.pop(request_id, None)
        return self._take_idle()

    def make_room(self) -> Room:
        """Before a new adapter loads: the idle adapters to unload, and if every slot is still taken,
        the requests naming the oldest adapters to end first (and those adapters too)."""
        unload, abort = self._take_idle(), []
        while len(self._held) >= self.capacity:
            oldest = next(iter(self._held))
            assert self.current is None or oldest != self.current.policy_version, "the served adapter is never evicted"
            ending = [r for r, v in self._named.items() if v == oldest]
            for request_id in ending:
                del self._named[request_id]
            del self._held[oldest]
            abort += ending
            unload.append(oldest)
        return Room(unload=unload, abort=abort)

    def commit(self, adapter: ServedAdapter) -> list[int]:
        """`adapter` serves every request submitted from now on; returns the policy_versions to unload
        now (the one it replaces, when no request names it)."""
        if self.current is not None and adapter.policy_version < self.current.policy_version:
            raise ValueError(f"adapter of policy_version {adapter.policy_version} after {self.current.policy_version}")
        self._held.pop(adapter.policy_version, None)  # a re-commit replaces it
        self._held[adapter.policy_version] = adapter
        assert len(self._held) <= self.capacity, "make_room before every commit"
        self.current = adapter
        return self._take_idle()

    def _take_idle(self) -> list[int]:
        """Held adapters that are not current and named by no request, removed from the table."""
        named = set(self._named.values())
        current = None if self.current is None else self.current.policy_version
        idle = [v for v in self._held if v != current and v not in named]
        for version in idle:
            del self._held[version]
        return idle
