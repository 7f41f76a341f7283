"""Whole tensors and global norms of FSDP2 (DTensor) parameters through plain c10d collectives.

`DTensor.full_tensor()` and `clip_grad_norm_` on DTensors go through torch's *functional*
collectives (an async work registry drained by `wait_tensor`). On CPU/gloo with torch 2.13 that
path failed intermittently inside `wait_tensor` ("pybind11_object_dealloc(): Tried to deallocate
unregistered instance!", a flaky CI failure of the two-rank publish test), so the learner does not
use it: FSDP2 shards every parameter on dim 0 (`Shard(0)`, `torch.chunk` layout), which one
blocking `all_gather_into_tensor` / `all_reduce` on the mesh's process group covers exactly.
Anything else (replicated, or another placement) is returned or reduced as torch does it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dim0_sharded(param: torch.Tensor | None) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(param, DTensor)
        and param.device_mesh.ndim == 1
        and len(param.placements) == 1
        and isinstance(param.placements[0], Shard)
        and param.placements[0].dim == 0
    )


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The unsharded value of `param` (collective over its mesh when sharded: every rank calls)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(param, DTensor):
        return param
    if all(isinstance(p, Replicate) for p in param.placements):
        return param.to_local()
    if not _dim0_sharded(param):
        return param.full_tensor()
    group = param.device_mesh.get_group()
    world = dist.get_world_size(group)
    local = param.to_local().detach()
    rows = math.ceil(param.shape[0] / world) if param.shape[0] else 0
    padded = local.new_zeros((rows, *param.shape[1:]))
    padded[: local.shape[0]].copy_(local)  # torch.chunk: every rank but the last ones holds `rows` rows
    out = local.new_empty((rows * world, *param.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[: param.shape[0]]


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Global L2 norm of the gradients of `params` (summed over every rank's shards), and scale them
    to `max_norm` when above it, as `torch.nn.utils.clip_grad_norm_` does. Collective when sharded."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    if not any(isinstance(p, DTensor) for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    shards = [(p, p.grad) for p in params if _dim0_sharded(p) and _dim0_sharded(p.grad)]
    if len(shards) < len(params):  # some parameter or gradient is not sharded on dim 0
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    grads = [g.to_local() for _, g in shards]
    local = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        local += g.detach().double().pow(2).sum()
    dist.all_reduce(local, group=shards[0][0].device_mesh.get_group())  # the shards partition each tensor
    norm = float(local.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
