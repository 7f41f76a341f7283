"""Moving learner weights into running vLLM engines, transactionally (docs/architecture.md, "The interrupt protocol").

- `WeightSyncConfig` (config.py): transport, backend, bucket size, per-phase timeouts, pause mode,
  overlap (stage while serving).
- `WeightSyncCoordinator` (coordinator.py): transfer -> verify while the engines serve -> pause ->
  commit (load + relabel, repaired or dropped per engine) -> resume, every engine call fenced by the
  sync's epoch (`overlap = false`: pause first).
- `WeightTransport` (transport.py) with `DistributedTransport` (distributed.py, gloo/NCCL broadcast)
  and `FilesystemTransport` (filesystem.py, versioned safetensors folders).
- `WeightSyncWorkerExtension` (worker_extension.py): the engine side, a vLLM `worker_extension_cls`.

Heavy modules (torch, vLLM) are imported lazily inside functions; importing this package is cheap.
"""

from __future__ import annotations

from streamrl.weight_sync.config import BackendKind, SyncTimeouts, TransportKind, WeightSyncConfig
from streamrl.weight_sync.coordinator import PausableWorkers, WeightSyncCoordinator
from streamrl.weight_sync.transport import SyncEngine, TransferOutcome, WeightTransport, make_transport
from streamrl.weight_sync.types import BucketMeta, StageReport, SyncManifest, SyncResult, TensorMeta, WeightSyncError
from streamrl.weight_sync.worker_extension import WORKER_EXTENSION_CLS, WeightSyncWorkerExtension

__all__ = [
    "WORKER_EXTENSION_CLS",
    "BackendKind",
    "BucketMeta",
    "PausableWorkers",
    "StageReport",
    "SyncEngine",
    "SyncManifest",
    "SyncResult",
    "SyncTimeouts",
    "TensorMeta",
    "TransferOutcome",
    "TransportKind",
    "WeightSyncConfig",
    "WeightSyncCoordinator",
    "WeightSyncError",
    "WeightTransport",
    "WeightSyncWorkerExtension",
    "make_transport",
]
