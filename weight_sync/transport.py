"""The weight transport seam (learner side): move one set of named tensors into every engine's staging.

Two implementations: `DistributedTransport` (torch.distributed broadcast over a dedicated group,
gloo on CPU / NCCL on GPU; `weight_sync/distributed.py`) and `FilesystemTransport` (safetensors in a
versioned folder; `weight_sync/filesystem.py`). A transport only *stages*: engines hold the new
weights next to the serving ones and report checksums. Verification, commit and the policy_version
bump belong to `WeightSyncCoordinator`, so a failed transfer never changes what engines serve.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from streamrl.core.aio import gather_within
from streamrl.weight_sync.config import TransportKind, WeightSyncConfig
from streamrl.weight_sync.types import AdapterSpec, StageReport, SyncManifest, WeightSyncError

if TYPE_CHECKING:
    import torch

    NamedTensors = list[tuple[str, torch.Tensor]]  # what a transport moves, in the learner's order


@runtime_checkable
class SyncEngine(Protocol):
    """What weight_sync needs from an engine: the fenced part of the `InferenceEngine` interface plus
    `collective_rpc` (every call carrying `epoch` goes through the engine's `SyncFence`)."""

    engine_id: str

    @property
    def policy_version(self) -> int:
        """The label the engine serves (weight_sync reads it; it changes only through `commit_weights`)."""
        ...

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]: ...

    async def pause(self, mode: Any = ..., *, epoch: int | None = None) -> None: ...

    async def resume(self, *, epoch: int | None = None) -> None: ...

    async def commit_weights(self, policy_version: int, *, epoch: int, timeout_s: float | None = None) -> None: ...

    async def ping(self) -> int: ...


@dataclass(kw_only=True, slots=True)
class TransferOutcome:
    manifest: SyncManifest  # with the learner-side bucket checksums filled in
    reports: list[list[StageReport]]  # [num_engines][num_workers_of_engine]


class WeightTransport(abc.ABC):
    """Learner-side sender; one instance serves every sync of a run."""

    def __init__(self, config: WeightSyncConfig) -> None:
        self.config = config

    async def send(
        self,
        engines: Sequence[SyncEngine],
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        policy_version: int,
        *,
        adapter: AdapterSpec | None = None,
    ) -> TransferOutcome:
        """Stage `named_tensors` as `policy_version` in every engine worker, within the transfer timeout;
        `adapter`: they are a LoRA adapter's A and B (its manifest says so). Raises WeightSyncError
        (ValueError for no tensors)."""
        tensors = list(named_tensors)
        if not tensors:
            raise ValueError("no tensors to sync")
        return await self._send(
            engines, tensors, policy_version, adapter=adapter, timeout_s=self.config.timeouts.transfer
        )

    @abc.abstractmethod
    async def _send(
        self,
        engines: Sequence[SyncEngine],
        tensors: NamedTensors,
        policy_version: int,
        *,
        adapter: AdapterSpec | None,
        timeout_s: float,
    ) -> TransferOutcome:
        """The transport's own `send`: `tensors` is not empty, the manifest carries `adapter`, and the
        whole transfer has `timeout_s`."""

    async def reset(self, engines: Sequence[SyncEngine]) -> None:  # noqa: B027 - stateless transports
        """Forget connection state after a failure so the next `send` rebuilds it."""

    async def close(self, engines: Sequence[SyncEngine]) -> None:
        await self.reset(engines)


async def rpc_all(
    engines: Sequence[SyncEngine],
    method: str,
    *,
    timeout_s: float,
    phase: str,
    args_per_engine: Sequence[tuple] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[list[Any]]:
    """`collective_rpc` on every engine concurrently; one clear WeightSyncError on failure or timeout."""

    async def one(i: int, engine: SyncEngine) -> list[Any]:
        args = args_per_engine[i] if args_per_engine is not None else ()
        try:
            return await engine.collective_rpc(method, args=args, kwargs=kwargs, timeout=timeout_s)
        except Exception as exc:
            raise WeightSyncError(phase, f"engine {engine.engine_id}: {method} failed: {exc!r}") from exc

    tasks = [asyncio.ensure_future(one(i, e)) for i, e in enumerate(engines)]
    try:
        return await gather_within(tasks, timeout_s)
    except TimeoutError as exc:
        raise WeightSyncError(phase, f"{method} did not finish on all engines within {timeout_s:.1f}s") from exc
    finally:
        for task in tasks:  # one engine failed: do not leave the others' calls running unobserved
            task.cancel()


async def finish_staging(engines: Sequence[SyncEngine], *, timeout_s: float, poll_s: float = 0.02) -> list[list[Any]]:
    """Overlapped staging: poll every engine until its background receive ended (each poll is one
    cheap RPC, so the engines' loops keep generating), then collect the StageReports."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise WeightSyncError("transfer", f"engines did not finish staging within {timeout_s:.1f}s")
        done = await rpc_all(engines, "receive_done", timeout_s=left, phase="transfer")
        if all(all(per_worker) for per_worker in done):
            break
        await asyncio.sleep(poll_s)
    return await rpc_all(
        engines,
        "finish_receive_weights",
        timeout_s=max(left, 5.0),
        phase="transfer",
        args_per_engine=[(max(left, 1.0),)] * len(engines),
    )


def make_transport(config: WeightSyncConfig) -> WeightTransport:
    if config.transport is TransportKind.DISTRIBUTED:
        from streamrl.weight_sync.distributed import DistributedTransport

        return DistributedTransport(config)
    from streamrl.weight_sync.filesystem import FilesystemTransport

    return FilesystemTransport(config)
