"""A dedicated learner <-> engine-workers process group that never touches the default group.

Learner is rank 0 and hosts the `TCPStore`; engine workers are ranks 1..N. The backend object
(`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU) is built directly on a `PrefixStore`, so neither
side's `torch.distributed` default group (FSDP on the learner, tensor-parallel inside vLLM) is
created, read or changed. The group timeout bounds every blocking call: a peer that never joins or
dies mid-broadcast turns into an exception after `timeout_s`, not a hang.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

STORE_PREFIX = "streamrl/weight_sync"


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """`auto` -> nccl for CUDA tensors, gloo otherwise."""
    import torch

    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"weight-sync backend must be auto, gloo or nccl, got {backend!r}")
    if backend != "auto":
        return backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def backend_device(backend: str) -> torch.device:
    """Where the flat buckets live for a backend: NCCL moves CUDA memory, gloo host memory."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def rendezvous_address(configured: str | None) -> str:
    """`configured`, else the address Ray registered for this process's node (so engines on other
    nodes can reach the group's store), else 127.0.0.1 outside Ray."""
    if configured:
        return configured
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def create_master_store(master_addr: str, port: int, world_size: int, timeout_s: float):
    """Rank 0's store; `port=0` lets the OS pick (read it back from `store.port`)."""
    from torch.distributed import TCPStore

    return TCPStore(master_addr, port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightGroup:
    """One member's handle on the weight-sync group (rank, backend object, store)."""

    def __init__(self, *, store, backend_pg, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.store = store
        self.backend_pg = backend_pg
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s

    @classmethod
    def join(
        cls,
        *,
        master_addr: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        group_id: str,
        store=None,
    ) -> WeightGroup:
        """Blocks until all `world_size` ranks joined, or raises after `timeout_s`."""
        import torch.distributed as dist
        from torch.distributed import PrefixStore, TCPStore

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a weight group of size {world_size}")
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            if rank == 0:
                store = create_master_store(master_addr, port, world_size, timeout_s)
            else:
                store = TCPStore(master_addr, port, world_size, False, timeout)
        prefixed = PrefixStore(f"{STORE_PREFIX}/{group_id}", store)
        if backend == "gloo":
            backend_pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend_pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"unsupported weight-sync backend {backend!r}")
        logger.info("joined weight group %s as rank %d/%d (%s)", group_id, rank, world_size, backend)
        return cls(
            store=store, backend_pg=backend_pg, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s
        )

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0):
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        return self.backend_pg.broadcast([tensor], options)

    def wait(self, work) -> None:
        work.wait(timedelta(seconds=self.timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.wait(self.broadcast_async(tensor, src))

    def close(self) -> None:
        """Release sockets/communicators; safe to call twice."""
        pg, self.backend_pg = self.backend_pg, None
        if pg is not None:
            for name in ("abort", "shutdown"):
                hook = getattr(pg, name, None)
                if hook is not None and self.backend == "nccl":
                    try:
                        hook()
                    except Exception:  # noqa: BLE001 - best-effort teardown of a possibly broken group
                        logger.warning("weight group %s() failed", name, exc_info=True)
                    break
        self.store = None
