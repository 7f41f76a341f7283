"""Records that cross the learner <-> engine boundary during a weight sync.

The `SyncManifest` travels first (as JSON through `collective_rpc`): it names every tensor, its shape,
dtype and place in a flat per-dtype bucket, the bucket checksums and the policy_version being
published, and for a LoRA adapter sync the adapter's `AdapterSpec`. Engines answer with a
`StageReport` per worker; the coordinator returns a `SyncResult`, and the publisher (in the learner)
returns one `Published` per publish to the driver.

Invariants: buckets hold one dtype each; tensor slots inside a bucket start at multiples of
`SLOT_ALIGN` bytes and the gaps are zero, so a bucket checksum equals the (wrapping) sum of its
tensors' checksums and a receiver can verify a bucket without knowing how it was assembled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SLOT_ALIGN = 8  # bytes; checksums sum 64-bit words


@dataclass(kw_only=True, slots=True)
class TensorMeta:
    name: str
    shape: list[int]  # [ndim]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    offset: int  # byte offset of the slot inside its bucket (multiple of SLOT_ALIGN)
    nbytes: int  # unpadded size of the tensor in bytes


@dataclass(kw_only=True, slots=True)
class BucketMeta:
    index: int
    dtype: str
    nbytes: int  # padded size of the flat buffer (multiple of SLOT_ALIGN)
    tensors: list[TensorMeta]  # [num_tensors_in_bucket], in slot order
    checksum: int | None = None  # buckets.checksum (position-weighted word sum), unsigned; None = not computed


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterSpec:
    """A LoRA adapter sync's peft config: the tensors are its A and B matrices under peft's names, and
    the engines serve them as a new adapter (`adapter_name`, `adapter_id`) on their base weights."""

    rank: int
    alpha: int
    target_modules: list[str]  # [num_targets], module names as peft matches them

    def peft_config(self, base_model: str) -> dict[str, Any]:
        """The `adapter_config.json` of a saved peft LoRA adapter (what vLLM's loader reads)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
        }


def adapter_name(policy_version: int) -> str:
    """The engine-side name of the adapter that serves `policy_version` (vLLM caches adapters by name
    and id, so every version gets its own: a reused name could serve stale weights)."""
    return f"policy-v{policy_version}"


def adapter_id(policy_version: int) -> int:
    """vLLM's integer id of that adapter (ids start at 1)."""
    return policy_version + 1


@dataclass(kw_only=True, slots=True)
class SyncManifest:
    """`adapter` is set for a LoRA adapter sync (the buckets then hold its A and B only) and None for
    full weights."""

    policy_version: int
    buckets: list[BucketMeta]  # [num_buckets], in broadcast order
    adapter: AdapterSpec | None = None

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    @property
    def checksums(self) -> list[int | None]:
        return [b.checksum for b in self.buckets]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SyncManifest:
        raw = json.loads(text)
        buckets = [
            BucketMeta(
                index=b["index"],
                dtype=b["dtype"],
                nbytes=b["nbytes"],
                checksum=b["checksum"],
                tensors=[TensorMeta(**t) for t in b["tensors"]],
            )
            for b in raw["buckets"]
        ]
        adapter = raw.get("adapter")
        return cls(
            policy_version=raw["policy_version"],
            buckets=buckets,
            adapter=None if adapter is None else AdapterSpec(**adapter),
        )


@dataclass(kw_only=True, slots=True)
class StageReport:
    """What one engine worker reports after receiving (staging, not yet loading) a manifest."""

    rank: int  # rank in the weight group (filesystem transport: the worker's rank in its engine)
    policy_version: int
    checksums: list[int | None]  # [num_buckets]; None where verification is off
    num_bytes: int

    @classmethod
    def from_dict(cls, raw: dict) -> StageReport:
        return cls(**raw)


@dataclass(kw_only=True, slots=True)
class SyncResult:
    """One sync. ok: every engine left in the sync set serves `policy_version` (engines that could not
    load it were dropped, see `dropped_engine_ids`); not ok: they all keep serving the old version."""

    ok: bool
    policy_version: int
    pause_s: float = 0.0
    transfer_s: float = 0.0
    verify_s: float = 0.0
    load_s: float = 0.0
    resume_s: float = 0.0
    paused_s: float = 0.0  # engines out of generation: from the pause call to the end of the resume
    total_s: float = 0.0
    num_bytes: int = 0
    error: str | None = None
    failed_phase: str | None = None  # "pause" | "transfer" | "verify" | "load"
    engine_ids: list[str] = field(default_factory=list)  # [num_engines] the sync ran on
    dropped_engine_ids: list[str] = field(default_factory=list)  # engines this sync removed from the sync set

    def metrics(self) -> dict[str, float]:
        return {
            "sync/pause_s": self.pause_s,
            "sync/transfer_s": self.transfer_s,
            "sync/verify_s": self.verify_s,
            "sync/load_s": self.load_s,
            "sync/resume_s": self.resume_s,
            "sync/paused_s": self.paused_s,
            "sync/total_s": self.total_s,
            "sync/bytes": float(self.num_bytes),
            "sync/failed": 0.0 if self.ok else 1.0,
            "sync/num_engines_dropped": float(len(self.dropped_engine_ids)),
            "sync/policy_version": float(self.policy_version),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """One publish, across the learner's actor boundary: everything the driver learns from it.

    Control: `policy_version`, the label the engines serve afterwards (the new one; the old one when the
    sync failed or there was nothing new to send), and `dropped_engines`, every engine out of the sync
    set now (engine_id -> why; the driver keeps them out of routing, and one that answers again rejoins
    at a later sync). Observability only: `metrics`, the sync's `sync/*` (empty when nothing was sent)."""

    policy_version: int
    dropped_engines: dict[str, str]
    metrics: dict[str, float]


class WeightSyncError(RuntimeError):
    """A sync failed; the engines keep serving the previous policy_version."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"weight sync failed in phase '{phase}': {message}")
        self.phase = phase
