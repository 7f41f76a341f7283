"""Configuration of the learner -> engine weight sync (transport, group, timeouts, pause mode).

`WeightSyncConfig` composes into the root run config under `[weight_sync]`. Every phase of a sync
has its own timeout so a dead peer turns into a failed sync with a clear error, never a hang.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from streamrl.engines.base import PauseMode

if TYPE_CHECKING:
    import torch


class TransportKind(StrEnum):
    DISTRIBUTED = "distributed"  # torch.distributed broadcast (gloo on CPU, NCCL on GPU)
    FILESYSTEM = "filesystem"  # safetensors into a versioned folder + reload in the engines


class BackendKind(StrEnum):
    AUTO = "auto"  # nccl when the learner's tensors live on CUDA, gloo otherwise
    GLOO = "gloo"
    NCCL = "nccl"


class SyncTimeouts(BaseModel):
    """Seconds allowed per phase; a phase that overruns fails the sync (old weights keep serving)."""

    model_config = ConfigDict(extra="forbid")

    pause: float = Field(default=30.0, gt=0)
    transfer: float = Field(default=120.0, gt=0)  # group (re)build + manifest + every bucket
    verify: float = Field(default=10.0, gt=0)
    load: float = Field(default=120.0, gt=0)  # commit of the staged weights inside every engine
    resume: float = Field(default=30.0, gt=0)
    probe: float = Field(
        default=5.0, gt=0
    )  # ping: a dropped engine before a sync (rejoin?), all after a failed overlapped staging


class WeightSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    transport: TransportKind = TransportKind.DISTRIBUTED
    backend: BackendKind = BackendKind.AUTO
    # Rendezvous address of the weight-sync group; None: the address Ray registered for the node
    # of the publishing process (learner rank 0), so one config serves one node and many.
    master_addr: str | None = None
    port: int = Field(default=0, ge=0, le=65535)  # 0 = the OS picks a free port at each group build
    bucket_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)  # upper bound of one flat buffer
    # Tensors of at least this size travel as their own zero-copy bucket; smaller ones are packed into
    # flat per-dtype buckets (packing amortizes per-collective latency; copying big tensors only costs).
    zero_copy_bytes: int = Field(default=1024 * 1024, ge=8)
    timeouts: SyncTimeouts = Field(default_factory=SyncTimeouts)
    # The dtype floating tensors travel (and are staged) in. "auto": the engines' dtype when
    # rollout.engine.dtype names one (set by the run config), else as the learner holds them. A bf16
    # engine fed fp32 master weights would cast them at load anyway: casting before the transfer
    # gives the same weights for half the bytes and half the staging memory.
    wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    verify_checksum: bool = True
    pause_mode: PauseMode = PauseMode.ABORT
    # Stage while serving: transfer and verify the new weights into each engine's staging copy while
    # it generates, then pause only for the commit (the in-place load). False: pause -> transfer ->
    # verify -> commit -> resume (no generation during the transfer; same staging memory either way).
    overlap: bool = True
    fs_dir: str = "runs/weights"  # filesystem transport: one `v{policy_version}` folder per sync
    keep_last_n: int = Field(default=2, ge=1)  # filesystem transport: versions kept on disk
    # Controlled staleness (the staleness lab): publish the weights of `publish_lag` versions ago, so
    # with trainer.mode = "sync" every trained token is exactly this many versions old. 0 = the newest.
    # Costs `publish_lag` CPU copies of the weights in the publishing process.
    publish_lag: int = Field(default=0, ge=0)

    @property
    def wire_torch_dtype(self) -> torch.dtype | None:
        """`wire_dtype` as a torch dtype; None for "auto" (tensors travel as they are)."""
        import torch

        return None if self.wire_dtype == "auto" else getattr(torch, self.wire_dtype)

    @property
    def group_timeout_s(self) -> float:
        """Process-group timeout = the transfer budget, so a blocked collective ends by itself."""
        return self.timeouts.transfer
