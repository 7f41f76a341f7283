"""Weight-sync benchmark, transport part (run by `python -m bench.weight_sync`): the `DistributedTransport`
against a raw per-tensor broadcast on the same group, and the bucket checksum's throughput.

The learner is this process (rank 0); the receiver is a spawned process running the real
`WeightSyncWorkerExtension` receive path (bucketing + checksums) behind a `SyncEngine` facade.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

from streamrl.weight_sync.worker_extension import WeightSyncWorkerExtension


class _Receiver(WeightSyncWorkerExtension):
    """The engine-side receive path without an engine (no load: the transport is what is timed)."""

    rank = 0

    def _ws_model_device(self):
        import torch

        return torch.device("cpu")

    def raw_receive(self, specs: list[tuple[list[int], str]]) -> int:
        import torch

        self._ws_staged = None
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in specs]
        for tensor in tensors:
            self._ws_group.broadcast(tensor, src=0)
        return sum(t.nbytes for t in tensors)


def _receiver_main(conn) -> None:
    worker = _Receiver()
    while True:
        method, args = conn.recv()
        if method is None:
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", repr(exc)))


class _ProcEngine:
    """`SyncEngine` facade over the receiver process (collective_rpc = one pipe round trip)."""

    def __init__(self, engine_id: str) -> None:
        ctx = mp.get_context("spawn")
        self.engine_id, self.policy_version = engine_id, 0
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child,), daemon=True)
        self.proc.start()

    def _call(self, method: str, args: tuple) -> Any:
        self.conn.send((method, args))
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        return [await asyncio.to_thread(self._call, method, tuple(args))]

    async def pause(self, mode=None) -> None: ...

    async def resume(self, epoch: int | None = None) -> None: ...

    async def set_policy_version(self, policy_version: int) -> None:
        self.policy_version = policy_version

    def close(self) -> None:
        self.conn.send((None, ()))
        self.proc.join(10)


def synthetic_state_dict(num_params: int) -> list[tuple[str, Any]]:
    """Transformer-shaped fp32 tensors adding up to `num_params` (hidden 1024, 12 tensors a layer)."""
    import torch

    hidden, out, total, layer = 1024, [], 0, 0
    out.append(("embed.weight", torch.full((32768, hidden), 0.5)))
    total += 32768 * hidden
    while total < num_params:
        for name, shape in (
            ("qkv", (3 * hidden, hidden)),
            ("o", (hidden, hidden)),
            ("up", (4 * hidden, hidden)),
            ("down", (hidden, 4 * hidden)),
            ("norm1", (hidden,)),
            ("norm2", (hidden,)),
        ):
            out.append((f"layers.{layer}.{name}.weight", torch.full(shape, 0.25)))
            total += out[-1][1].numel()
        layer += 1
    return out


def _broadcast_all(group: Any, named: list[tuple[str, Any]]) -> None:
    """The raw baseline: every tensor broadcast as is, one call each."""
    for _, t in named:
        group.broadcast(t.contiguous(), src=0)


async def bench_transport(named: list[tuple[str, Any]], label: str, repeats: int, verify: bool) -> dict[str, Any]:
    from streamrl.weight_sync.config import WeightSyncConfig
    from streamrl.weight_sync.distributed import DistributedTransport

    receiver = _ProcEngine(f"recv-{label}")
    transport = DistributedTransport(WeightSyncConfig(verify_checksum=verify))
    engines = [receiver]
    try:
        await transport.send(engines, named[:1], 0)  # forms the group, warms the sockets
        await receiver.collective_rpc("discard_weights")
        specs = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for _, t in named]
        sync_s, raw_s = [], []
        for i in range(repeats):
            t0 = time.monotonic()
            outcome = await transport.send(engines, named, i + 1)
            sync_s.append(time.monotonic() - t0)
            assert outcome.reports[0][0].checksums == outcome.manifest.checksums, "checksum mismatch"
            await receiver.collective_rpc("discard_weights")
            group = transport._group
            t0 = time.monotonic()
            recv = asyncio.ensure_future(receiver.collective_rpc("raw_receive", (specs,)))
            await asyncio.to_thread(_broadcast_all, group, named)
            await recv
            raw_s.append(time.monotonic() - t0)
        num_bytes = sum(t.nbytes for _, t in named)
        best_sync, best_raw = min(sync_s), min(raw_s)
        return {
            "state_dict": label,
            "verify_checksum": verify,
            "num_params": sum(t.numel() for _, t in named),
            "num_tensors": len(named),
            "bytes": num_bytes,
            "transport_s": sync_s,
            "raw_broadcast_s": raw_s,
            "best_transport_s": best_sync,
            "best_raw_broadcast_s": best_raw,
            "ratio_transport_over_raw": best_sync / best_raw,
            "transport_gb_per_s": num_bytes / best_sync / 1e9,
            "target_ratio": 1.3,
            "meets_target": best_sync / best_raw <= 1.3,
        }
    finally:
        await transport.reset(engines)
        receiver.close()


def bench_checksum(num_bytes: int = 256 * 1024 * 1024, repeats: int = 3) -> dict[str, Any]:
    """Throughput of `weight_sync.buckets.checksum` vs torch's intra-op-parallel int64 sum, one buffer.

    On an idle host both run at memory bandwidth; under load (gloo threads, other processes) torch's
    thread team waits for its slowest member, which the transport rows show when it is used.
    """
    import torch

    from streamrl.weight_sync.buckets import checksum

    flat = torch.empty(num_bytes, dtype=torch.uint8)
    flat.view(torch.float32).normal_()
    out: dict[str, Any] = {"bytes": num_bytes, "torch_threads": torch.get_num_threads()}
    reference = int(flat.view(torch.int64).sum().item()) & ((1 << 64) - 1)
    assert checksum(flat) == reference, "numpy and torch checksums disagree"
    candidates = (
        ("checksum", lambda: checksum(flat)),
        ("torch_int64_sum", lambda: flat.view(torch.int64).sum().item()),
    )
    for name, fn in candidates:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[f"{name}_gb_per_s"] = num_bytes / min(times) / 1e9
    return out
