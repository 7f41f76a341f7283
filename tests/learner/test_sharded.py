"""learner.sharded against torch's own DTensor paths, on a 3-rank gloo group with uneven shards
(torch.chunk layout: a rank may hold fewer rows, or none)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(5, 3), (2, 4), (7,), (3, 2, 2)]  # 2/2/1, 1/1/0, 3/3/1 and 1/1/1 rows per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from streamrl.learner.sharded import clip_grad_norm, full_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        fulls = [torch.randn(s, generator=gen) for s in SHAPES]
        grads = [torch.randn(s, generator=gen) * 3 for s in SHAPES]
        params = []
        for full, grad in zip(fulls, grads):
            p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
            p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            params.append(p)
        gathered = [full_tensor(p) for p in params]
        theirs = [p.full_tensor() for p in params]
        norm = clip_grad_norm(params, max_norm=1.0)
        clipped = [full_tensor(p.grad) for p in params]
        results[rank] = {
            "gathered_equal": all(torch.equal(a, b) and torch.equal(a, f) for a, b, f in zip(gathered, theirs, fulls)),
            "norm": norm,
            "clipped": [c.clone() for c in clipped],
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_full_tensor_and_clip_match_torch_on_uneven_shards():
    world = 3
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(world, _free_port(), results), nprocs=world, start_method="spawn", join=True)
    gen = torch.Generator().manual_seed(0)
    [torch.randn(s, generator=gen) for s in SHAPES]  # the parameters, drawn first as in the workers
    grads = [torch.randn(s, generator=gen) * 3 for s in SHAPES]
    expected_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    reference = [g.clone() for g in grads]
    for g in reference:
        g.mul_(1.0 / (expected_norm + 1e-6))
    assert sorted(results.keys()) == list(range(world))
    for rank in range(world):
        r = results[rank]
        assert r["gathered_equal"], f"rank {rank}: gathered tensors differ from DTensor.full_tensor()"
        assert r["norm"] == pytest.approx(expected_norm, rel=1e-6)
        for got, want in zip(r["clipped"], reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
