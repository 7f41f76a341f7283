"""`LearnerGroup`: M Ray actors, each one rank of torch.distributed running a `TrainingEngine`
whose policy is sharded with FSDP2 `fully_shard` (per decoder layer, then the root).

Backend by device: NCCL on CUDA (one GPU per actor), gloo on CPU (FSDP2 runs on gloo; used by the
M = 2 CPU test). Every rank receives the whole batch and trains on its rows (see `engine.py`);
rank 0's metrics are returned. Collective operations — `train_step`, `compute_logprobs`,
`save_*`, and iterating `named_parameters_for_sync` (per-parameter all-gathers) — run on all ranks;
`run_on_all(fn)` is the hook weight_sync uses to iterate the full tensors on every rank while rank 0
sends them. Every `ray.get` has a timeout.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig

logger = logging.getLogger(__name__)


def fsdp_shard(model: Any) -> None:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, lm_head, value head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.lm.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)


class LearnerWorker:
    """One rank: process group + sharded TrainingEngine. Instantiated as a Ray actor."""

    def __init__(self, cfg_json: str, rank: int, world_size: int, master: str) -> None:
        self.cfg = LearnerConfig.model_validate_json(cfg_json)
        self.rank, self.world_size, self.master = rank, world_size, master
        self.engine: Any = None

    def setup(self) -> int:
        import torch
        import torch.distributed as dist

        from learner.engine import TrainingEngine

        cuda = self.cfg.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU
        else:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            init_method=f"tcp://{self.master}",
            rank=self.rank,
            world_size=self.world_size,
        )
        self.engine = TrainingEngine(self.cfg, shard=fsdp_shard)
        return self.engine.policy_version

    def train_step(self, batch: Any) -> dict[str, float]:
        return self.engine.train_step(batch)

    def compute_logprobs(self, batch: Any) -> Any:
        return self.engine.compute_logprobs(batch)

    def save_checkpoint(self, directory: str) -> None:
        self.engine.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        self.engine.load_checkpoint(directory)
        return self.engine.policy_version

    def save_hf(self, directory: str) -> None:
        self.engine.save_hf(directory)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.engine, *args)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LearnerGroup:
    """M learner ranks as Ray actors; the same methods as `TrainingEngine`, executed on all ranks."""

    def __init__(
        self,
        cfg: LearnerConfig,
        num_workers: int,
        *,
        num_cpus_per_worker: float = 1.0,
        timeout_s: float = 600.0,
    ) -> None:
        import ray

        from rollout.models import resolve_model

        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        device = cfg.device
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= num_workers else "cpu"
        # resolve once on the driver so every rank loads the same folder
        self.cfg = cfg.model_copy(update={"device": device, "model": str(resolve_model(cfg.model))})
        self.timeout_s = timeout_s
        master = f"127.0.0.1:{_free_port()}"
        actor = ray.remote(LearnerWorker).options(
            num_cpus=num_cpus_per_worker,
            num_gpus=1 if device == "cuda" else 0,
            runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}},
        )
        cfg_json = self.cfg.model_dump_json()
        self.workers = [actor.remote(cfg_json, rank, num_workers, master) for rank in range(num_workers)]
        versions = self._all("setup")
        self.policy_version = versions[0]
        logger.info("learner group of %d ranks on %s ready", num_workers, device)

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return ray.get(refs, timeout=self.timeout_s)

    @property
    def model_path(self) -> Path:
        return Path(self.cfg.model)

    def train_step(self, batch: Any) -> dict[str, float]:
        metrics = self._all("train_step", batch)[0]
        self.policy_version = int(metrics["learner/policy_version"])
        return metrics

    def compute_logprobs(self, batch: Any) -> Any:
        return self._all("compute_logprobs", batch)[0]

    def save_checkpoint(self, directory: str | Path) -> None:
        self._all("save_checkpoint", str(directory))

    def load_checkpoint(self, directory: str | Path) -> None:
        self.policy_version = self._all("load_checkpoint", str(directory))[0]

    def save_hf(self, directory: str | Path) -> Path:
        self._all("save_hf", str(directory))
        return Path(directory)

    def run_on_all(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(engine, *args)` on every rank (e.g. iterate `named_parameters_for_sync`; rank 0 sends)."""
        return self._all("run", fn, *args)

    def shutdown(self) -> None:
        import ray

        try:
            self._all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.workers = []
