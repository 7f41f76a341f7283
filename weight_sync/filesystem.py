"""`FilesystemTransport`: safetensors into a versioned folder, staged by every engine from disk.

For setups without a network path between learner and engines (and as the fallback). Layout:
`{fs_dir}/v{policy_version}/model.safetensors` + `manifest.json`, written into a hidden temporary
folder and renamed into place, so an engine never reads a half-written version. Only the newest
`keep_last_n` versions stay on disk. Engines read the folder in `stage_weights_from_path`, pack it
into the manifest's bucket layout and report checksums, exactly like the broadcast path.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.core.atomic import atomic_dir
from streamrl.weight_sync.buckets import checksum, pack_bucket, plan_buckets, wire_dtype_of
from streamrl.weight_sync.transport import SyncEngine, TransferOutcome, WeightTransport, finish_staging, rpc_all
from streamrl.weight_sync.types import AdapterSpec, StageReport, SyncManifest, WeightSyncError

if TYPE_CHECKING:
    import torch

    from streamrl.weight_sync.transport import NamedTensors

logger = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^v(\d+)$")


class FilesystemTransport(WeightTransport):
    def version_dir(self, policy_version: int) -> Path:
        return Path(self.config.fs_dir) / f"v{policy_version}"

    async def _send(
        self,
        engines: Sequence[SyncEngine],
        tensors: NamedTensors,
        policy_version: int,
        *,
        adapter: AdapterSpec | None,
        timeout_s: float,
    ) -> TransferOutcome:
        try:
            manifest, folder = await asyncio.wait_for(
                asyncio.to_thread(self._write_version, tensors, policy_version, adapter), timeout=timeout_s
            )
        except TimeoutError as exc:
            raise WeightSyncError("transfer", f"writing v{policy_version} took longer than {timeout_s:.1f}s") from exc
        except OSError as exc:
            raise WeightSyncError(
                "transfer", f"writing v{policy_version} under {self.config.fs_dir} failed: {exc!r}"
            ) from exc
        args = [(str(folder.resolve()), manifest.to_json(), self.config.verify_checksum)] * len(engines)
        if self.config.overlap:  # engines read in a background thread and keep generating meanwhile
            await rpc_all(
                engines, "begin_stage_weights_from_path", timeout_s=timeout_s, phase="transfer", args_per_engine=args
            )
            raw = await finish_staging(engines, timeout_s=timeout_s)
        else:
            raw = await rpc_all(
                engines, "stage_weights_from_path", timeout_s=timeout_s, phase="transfer", args_per_engine=args
            )
        self._prune(keep=policy_version)
        return TransferOutcome(manifest=manifest, reports=[[StageReport.from_dict(r) for r in e] for e in raw])

    def _write_version(
        self, tensors: list[tuple[str, torch.Tensor]], policy_version: int, adapter: AdapterSpec | None
    ) -> tuple[SyncManifest, Path]:
        from safetensors.torch import save_file

        buckets = plan_buckets(
            tensors, self.config.bucket_bytes, self.config.zero_copy_bytes, self.config.wire_torch_dtype
        )
        manifest = SyncManifest(policy_version=policy_version, buckets=buckets, adapter=adapter)
        by_name = dict(tensors)
        if self.config.verify_checksum:
            for bucket in manifest.buckets:
                bucket.checksum = checksum(pack_bucket(bucket, by_name, "cpu"))

        def write(tmp: Path) -> None:
            host = _host_copies(tensors, self.config.wire_torch_dtype)
            save_file(host, str(tmp / "model.safetensors"), metadata={"policy_version": str(policy_version)})
            (tmp / "manifest.json").write_text(manifest.to_json())

        final = atomic_dir(self.version_dir(policy_version), write)  # a retried sync replaces the old attempt
        logger.info("wrote policy_version %d (%d bytes) to %s", policy_version, manifest.num_bytes, final)
        return manifest, final

    def _prune(self, keep: int) -> None:
        """Delete all but the newest `keep_last_n` version folders (never the one just written)."""
        root = Path(self.config.fs_dir)
        versions = sorted(
            (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))
        )
        for version, path in versions[: max(0, len(versions) - self.config.keep_last_n)]:
            if version != keep:
                shutil.rmtree(path, ignore_errors=True)


def _host_copies(tensors: list[tuple[str, torch.Tensor]], wire_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors in their wire dtype for safetensors; tensors sharing storage (tied
    weights) are cloned."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        host = tensor.detach().to("cpu", wire_dtype_of(tensor, wire_dtype)).contiguous()
        key = host.untyped_storage().data_ptr()
        out[name] = host.clone() if key in seen or host.untyped_storage().nbytes() != host.nbytes else host
        seen.add(key)
    return out
