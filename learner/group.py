"""`LearnerGroup`: M Ray actors, each one rank of torch.distributed running a `TrainingEngine`
whose policy is sharded with FSDP2 `fully_shard` (per decoder layer, then the root).

Backend by device: NCCL on CUDA (one GPU per actor), gloo on CPU (FSDP2 runs on gloo; used by the
M = 2 CPU tests). Resources per rank come from `LearnerConfig` (`num_gpus_per_worker`,
`num_cpus_per_worker`; `placement()` resolves them), so Ray never puts a rank on an engine's GPU.
The rendezvous is on rank 0's node (loopback when all ranks share it), so ranks may span nodes.

Every rank receives the whole batch and trains on its rows (see `engine.py`); rank 0's metrics are
returned. Collective operations — `train_step`, `compute_logprobs`, `save_*`, and iterating
`named_parameters_for_sync` (per-parameter all-gathers) — run on all ranks. Rank 0 may be a
subclass of `LearnerWorker` (`rank0_cls`) that adds methods of its own — streaming's weight
publisher, which iterates the gathers while `run` makes ranks 1..M-1 iterate them in lockstep.
`submit` returns the object refs of one call on all ranks for callers that await them; every
blocking `ray.get` here has a timeout.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.learner.config import LearnerConfig
from streamrl.learner.types import StepResult

if TYPE_CHECKING:
    from streamrl.learner.engine import TrainingEngine

logger = logging.getLogger(__name__)


def fsdp_shard(model: Any) -> None:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, lm_head, value head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.lm.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)


@dataclass(kw_only=True, slots=True, frozen=True)
class LearnerPlacement:
    """Resolved device and Ray resources of each learner process."""

    device: str  # "cpu" | "cuda"
    num_workers: int
    num_cpus_per_worker: float
    num_gpus_per_worker: float
    resources_per_worker: dict[str, float] = field(default_factory=dict)

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus_per_worker, "num_gpus": self.num_gpus_per_worker}
        if self.resources_per_worker:
            options["resources"] = dict(self.resources_per_worker)
        return options


def placement(cfg: LearnerConfig, cluster_gpus: float | None = None) -> LearnerPlacement:
    """`device = "auto"` becomes cuda when the cluster has a GPU for every rank (`cluster_gpus`,
    default: ask Ray), else cpu; then the per-rank resources follow the config."""
    device = cfg.device
    if device == "auto":
        if cluster_gpus is None:
            import ray

            cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        device = "cuda" if cluster_gpus >= cfg.num_workers else "cpu"
    return LearnerPlacement(
        device=device,
        num_workers=cfg.num_workers,
        num_cpus_per_worker=cfg.num_cpus_per_worker,
        num_gpus_per_worker=cfg.resolved_num_gpus_per_worker(device),
        resources_per_worker=dict(cfg.resources_per_worker),
    )


class LearnerWorker:
    """One rank: process group + sharded TrainingEngine. Instantiated as a Ray actor."""

    def __init__(self, cfg: LearnerConfig, rank: int, world_size: int) -> None:
        logging.basicConfig(level=logging.INFO)
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.engine: Any = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def master_address(self, loopback: bool) -> str:
        """`ip:port` for the rendezvous (called on rank 0) with a port free here: 127.0.0.1 when every
        rank runs on this node, else the address Ray registered for this node."""
        import ray

        ip = "127.0.0.1"
        if not loopback:
            node_id = self.node_id()
            ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def setup(self, master: str, timeout_s: float) -> int:
        """Join the default process group (its timeout bounds every collective, so a dead rank is an
        error after `timeout_s`, not a hang) and build the sharded engine."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from streamrl.learner.engine import TrainingEngine

        cuda = self.cfg.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU
        else:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            init_method=f"tcp://{master}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.engine = TrainingEngine(self.cfg, shard=fsdp_shard)
        return self.engine.policy_version

    def train_step(self, batch: Any) -> StepResult:
        return self.engine.step(batch)

    def compute_logprobs(self, batch: Any) -> Any:
        return self.engine.compute_logprobs(batch)

    def save_checkpoint(self, directory: str) -> None:
        self.engine.save_checkpoint(directory)

    def start_checkpoint(self, directory: str) -> None:
        """Every rank joins the snapshot's gathers; rank 0 then writes it in the background."""
        self.engine.start_checkpoint(directory)

    def finish_checkpoint(self) -> str | None:
        return self.engine.finish_checkpoint()

    def checkpoint_busy(self) -> bool:
        return self.engine.checkpoint_busy

    def load_checkpoint(self, directory: str) -> int:
        self.engine.load_checkpoint(directory)
        return self.engine.policy_version

    def set_policy_version(self, version: int) -> None:
        self.engine.policy_version = version

    def save_hf(self, directory: str) -> None:
        self.engine.save_hf(directory)

    def end_of_step_memory(self) -> dict[str, float]:
        """This rank's peak memory of the step just trained (`core.memory.end_of_step`)."""
        from streamrl.core.memory import end_of_step

        return end_of_step(str(self.engine.device))

    def inspect(self, fn: Callable[[TrainingEngine], Any]) -> Any:
        """`fn(engine)` on this rank: a diagnostic seam (tests read a rank's parameters or environment);
        the run itself only calls the methods above."""
        return fn(self.engine)

    def join_sync_gather(self) -> int:
        """Ranks 1..M-1 of a publish: join every per-parameter all-gather rank 0 runs, keep nothing."""
        return sum(1 for _ in self.engine.named_parameters_for_sync())

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerGroup:
    """M learner ranks as Ray actors; the same methods as `TrainingEngine`, executed on all ranks.

    `num_workers`, `num_cpus_per_worker` and `num_gpus_per_worker` default to the config's;
    `env_vars` join every rank's environment (the caller's allocator settings, for instance)."""

    def __init__(
        self,
        cfg: LearnerConfig,
        num_workers: int | None = None,
        *,
        num_cpus_per_worker: float | None = None,
        num_gpus_per_worker: float | None = None,
        timeout_s: float = 600.0,
        rank0_cls: type[LearnerWorker] = LearnerWorker,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        import ray

        from streamrl.models import resolve_model

        overrides = {
            "num_workers": num_workers,
            "num_cpus_per_worker": num_cpus_per_worker,
            "num_gpus_per_worker": num_gpus_per_worker,
        }
        data = cfg.model_dump() | {k: v for k, v in overrides.items() if v is not None}
        cfg = LearnerConfig.model_validate(data)  # overrides are validated like the config itself
        where = placement(cfg)
        # resolve once here so every rank loads the same folder
        self.cfg = cfg.model_copy(update={"device": where.device, "model": str(resolve_model(cfg.model))})
        self.placement = where
        self.timeout_s = timeout_s
        rank_env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **(env_vars or {})}
        if where.device == "cpu":  # Ray pins OMP_NUM_THREADS to num_cpus; CPU ranks share the cores instead
            rank_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // where.num_workers))
        env = {"env_vars": rank_env}
        self.workers = []
        for rank in range(where.num_workers):
            actor = ray.remote(rank0_cls if rank == 0 else LearnerWorker).options(
                **where.actor_options(), runtime_env=env
            )
            self.workers.append(actor.remote(self.cfg, rank, where.num_workers))
        try:
            nodes = set(self._wait(self.start_node_ids()))
            master = ray.get(self.rank0.master_address.remote(len(nodes) == 1), timeout=self.timeout_s)
            versions = self._wait([w.setup.remote(master, timeout_s) for w in self.workers])
        except BaseException:
            self.kill()
            raise
        self.policy_version = versions[0]
        logger.info("learner group of %d ranks on %s ready (rendezvous %s)", where.num_workers, where.device, master)

    @property
    def rank0(self) -> Any:
        """Rank 0's actor handle (an instance of `rank0_cls`)."""
        return self.workers[0]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    # ---- the calls on every rank, started: each returns one object ref per rank (await them with a
    # deadline); the blocking methods below wait for them
    def start_train_step(self, batch_ref: Any) -> list[Any]:
        return [w.train_step.remote(batch_ref) for w in self.workers]

    def start_end_of_step_memory(self) -> list[Any]:
        return [w.end_of_step_memory.remote() for w in self.workers]

    def start_join_sync_gather(self) -> list[Any]:
        """Ranks 1..M-1 only: rank 0 runs its side of the gather inside its publish."""
        return [w.join_sync_gather.remote() for w in self.workers[1:]]

    def start_node_ids(self) -> list[Any]:
        return [w.node_id.remote() for w in self.workers]

    def start_save_checkpoint(self, directory: str | Path) -> list[Any]:
        return [w.save_checkpoint.remote(str(directory)) for w in self.workers]

    def start_snapshot(self, directory: str | Path) -> list[Any]:
        """Every rank's part of `TrainingEngine.start_checkpoint` (rank 0 writes in the background)."""
        return [w.start_checkpoint.remote(str(directory)) for w in self.workers]

    def start_save_hf(self, directory: str | Path) -> list[Any]:
        return [w.save_hf.remote(str(directory)) for w in self.workers]

    def start_shutdown(self) -> list[Any]:
        return [w.shutdown.remote() for w in self.workers]

    def _wait(self, refs: list[Any]) -> list[Any]:
        import ray

        return ray.get(refs, timeout=self.timeout_s)

    @property
    def model_path(self) -> Path:
        return Path(self.cfg.model)

    def train_step(self, batch: Any) -> dict[str, float]:
        import ray

        result: StepResult = self._wait(self.start_train_step(ray.put(batch)))[0]  # one object-store copy for M ranks
        self.policy_version = result.policy_version
        return result.metrics

    def compute_logprobs(self, batch: Any) -> Any:
        import ray

        return self._wait([w.compute_logprobs.remote(ray.put(batch)) for w in self.workers])[0]

    def save_checkpoint(self, directory: str | Path) -> None:
        self._wait(self.start_save_checkpoint(directory))

    def load_checkpoint(self, directory: str | Path) -> None:
        self.policy_version = self._wait([w.load_checkpoint.remote(str(directory)) for w in self.workers])[0]

    def set_policy_version(self, version: int) -> None:
        """Relabel the current weights (a resume labels them above every version used before)."""
        self._wait([w.set_policy_version.remote(version) for w in self.workers])
        self.policy_version = version

    def save_hf(self, directory: str | Path) -> Path:
        self._wait(self.start_save_hf(directory))
        return Path(directory)

    def inspect_all(self, fn: Callable[[TrainingEngine], Any]) -> list[Any]:
        """`fn(engine)` on every rank (`LearnerWorker.inspect`), for tests and diagnostics."""
        return self._wait([w.inspect.remote(fn) for w in self.workers])

    def shutdown(self) -> None:
        try:
            self._wait(self.start_shutdown())
        finally:
            self.kill()

    def kill(self) -> None:
        """End every rank's actor now (after `shutdown`, or when a rank is already broken)."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
