"""`DistributedTransport`: one torch.distributed broadcast from learner rank 0 into every engine worker.

The group (learner = rank 0, engine workers = ranks 1..N in engine order) is built lazily on the
first send, reused while the engine set is unchanged, and torn down after any failure so the next
sync rebuilds it from scratch (fresh store port and key prefix, so a half-dead old group can never
be joined by mistake). The manifest goes first as the `receive_weights` RPC argument (with
`overlap`: `begin_receive_weights`, which receives in a background thread of the engine so it keeps
generating, then `finish_receive_weights` once the learner's broadcast is done); then buckets are
packed, checksummed and broadcast with at most two in flight (packing bucket i+1 overlaps sending
bucket i, and learner memory stays bounded by two buckets). A bucket's checksum is computed while its
own broadcast is in flight (both only read it); receivers sum bucket k while bucket k+1 arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from streamrl.core.aio import gather_within
from streamrl.weight_sync.buckets import checksum, pack_bucket, plan_buckets
from streamrl.weight_sync.config import WeightSyncConfig
from streamrl.weight_sync.group import (
    WeightGroup,
    backend_device,
    create_master_store,
    rendezvous_address,
    resolve_backend,
)
from streamrl.weight_sync.transport import SyncEngine, TransferOutcome, WeightTransport, finish_staging, rpc_all
from streamrl.weight_sync.types import AdapterSpec, StageReport, SyncManifest, WeightSyncError

if TYPE_CHECKING:
    import torch

    from streamrl.weight_sync.transport import NamedTensors

logger = logging.getLogger(__name__)

CorruptHook = Callable[[int, "torch.Tensor"], None]  # (bucket_index, flat buffer) -> mutate in place


class DistributedTransport(WeightTransport):
    """Broadcast transport. `corrupt_hook` is fault injection for tests: it runs on each packed bucket
    after the learner computed its checksum and before the broadcast (i.e. corruption in flight)."""

    def __init__(self, config: WeightSyncConfig, *, corrupt_hook: CorruptHook | None = None) -> None:
        super().__init__(config)
        self.corrupt_hook = corrupt_hook
        self._group: WeightGroup | None = None
        self._members: tuple[str, ...] = ()
        self._run_id = uuid.uuid4().hex[:8]
        self._num_builds = 0

    @property
    def connected(self) -> bool:
        return self._group is not None

    async def _send(
        self,
        engines: Sequence[SyncEngine],
        tensors: NamedTensors,
        policy_version: int,
        *,
        adapter: AdapterSpec | None,
        timeout_s: float,
    ) -> TransferOutcome:
        backend = resolve_backend(self.config.backend, tensors[0][1].device)
        group = await self._ensure_group(engines, backend)
        buckets = plan_buckets(
            tensors, self.config.bucket_bytes, self.config.zero_copy_bytes, self.config.wire_torch_dtype
        )
        manifest = SyncManifest(policy_version=policy_version, buckets=buckets, adapter=adapter)
        started = time.monotonic()
        args = [(manifest.to_json(), self.config.verify_checksum)] * len(engines)
        # overlap: engines receive in a background thread (generation goes on) and `finish` joins it.
        method = "begin_receive_weights" if self.config.overlap else "receive_weights"
        receive = asyncio.ensure_future(
            rpc_all(engines, method, timeout_s=timeout_s, phase="transfer", args_per_engine=args)
        )
        broadcast = asyncio.ensure_future(asyncio.to_thread(self._broadcast_buckets, group, manifest, dict(tensors)))
        try:
            _, raw_reports = await gather_within([broadcast, receive], timeout_s)
            if self.config.overlap:
                raw_reports = await finish_staging(
                    engines, timeout_s=max(1.0, timeout_s - (time.monotonic() - started))
                )
        except TimeoutError as exc:
            raise WeightSyncError("transfer", f"broadcast did not finish within {timeout_s:.1f}s") from exc
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError("transfer", f"broadcast from learner rank 0 failed: {exc!r}") from exc
        finally:
            receive.cancel()
            broadcast.cancel()  # a thread cannot be stopped; the group timeout ends it, result dropped
        reports = [[StageReport.from_dict(r) for r in per_engine] for per_engine in raw_reports]
        return TransferOutcome(manifest=manifest, reports=reports)

    def _broadcast_buckets(self, group: WeightGroup, manifest: SyncManifest, tensors: dict[str, torch.Tensor]) -> None:
        """Runs in a thread: pack -> checksum -> (hook) -> broadcast, two buckets in flight at most."""
        device = backend_device(group.backend)
        started = time.monotonic()
        inflight: deque = deque()
        for bucket in manifest.buckets:
            flat = pack_bucket(bucket, tensors, device)
            if self.corrupt_hook is not None:
                bucket.checksum = checksum(flat)
                flat = flat.clone()  # the bucket may be a zero-copy view of a learner tensor
                self.corrupt_hook(bucket.index, flat)
                inflight.append((group.broadcast_async(flat, src=0), flat))
            else:
                inflight.append((group.broadcast_async(flat, src=0), flat))
                if self.config.verify_checksum:  # both only read `flat`: checksum while it is sent
                    bucket.checksum = checksum(flat)
            if len(inflight) > 1:
                group.wait(inflight.popleft()[0])
        while inflight:
            group.wait(inflight.popleft()[0])
        logger.info(
            "broadcast %d buckets (%d bytes) in %.3fs",
            len(manifest.buckets),
            manifest.num_bytes,
            time.monotonic() - started,
        )

    async def _ensure_group(self, engines: Sequence[SyncEngine], backend: str) -> WeightGroup:
        members = tuple(e.engine_id for e in engines)
        if self._group is not None and self._members == members and self._group.backend == backend:
            return self._group
        await self.reset(engines)
        cfg = self.config
        timeout_s = cfg.timeouts.transfer
        infos = await rpc_all(engines, "weight_sync_info", timeout_s=timeout_s, phase="transfer")
        offsets, next_rank = [], 1
        for per_engine in infos:
            offsets.append(next_rank)
            next_rank += len(per_engine)
        world_size = next_rank
        master_addr = rendezvous_address(cfg.master_addr)
        store = create_master_store(master_addr, cfg.port, world_size, cfg.group_timeout_s)
        self._num_builds += 1
        group_id = f"{self._run_id}-{self._num_builds}"
        learner = asyncio.ensure_future(
            asyncio.to_thread(
                WeightGroup.join,
                master_addr=master_addr,
                port=store.port,
                rank=0,
                world_size=world_size,
                backend=backend,
                timeout_s=cfg.group_timeout_s,
                group_id=group_id,
                store=store,
            )
        )
        args = [(master_addr, store.port, off, world_size, backend, cfg.group_timeout_s, group_id) for off in offsets]
        joins = asyncio.ensure_future(
            rpc_all(engines, "init_weight_group", timeout_s=timeout_s, phase="transfer", args_per_engine=args)
        )
        try:
            group = await self._form(learner, joins, world_size, timeout_s)
        except BaseException:
            _close_if_formed(learner)
            raise
        finally:
            joins.cancel()
            learner.cancel()
        self._group, self._members = group, members
        logger.info(
            "weight group %s formed: %d ranks over %d engines (%s)", group_id, world_size, len(engines), backend
        )
        return group

    async def _form(self, learner, joins, world_size: int, timeout_s: float) -> WeightGroup:
        try:
            group, _ = await gather_within([learner, joins], timeout_s)
            return group
        except WeightSyncError as exc:
            raise WeightSyncError("transfer", f"weight group of {world_size} ranks did not form: {exc}") from exc
        except TimeoutError as exc:
            raise WeightSyncError(
                "transfer", f"weight group of {world_size} ranks did not form within {timeout_s:.1f}s"
            ) from exc
        except Exception as exc:
            raise WeightSyncError(
                "transfer", f"weight group of {world_size} ranks did not form within {timeout_s:.1f}s: {exc!r}"
            ) from exc

    async def reset(self, engines: Sequence[SyncEngine]) -> None:
        group, self._group, self._members = self._group, None, ()
        if group is None:
            return
        group.close()
        try:  # engines also drop their side when they join the next group; this frees it earlier
            await rpc_all(engines, "close_weight_group", timeout_s=min(5.0, self.config.timeouts.resume), phase="reset")
        except WeightSyncError as exc:
            logger.warning("could not close the weight group on every engine: %s", exc)


def _close_if_formed(learner: asyncio.Future) -> None:
    """The learner side formed but an engine failed: release the learner's half of the group."""
    if learner.done() and not learner.cancelled() and learner.exception() is None:
        learner.result().close()
