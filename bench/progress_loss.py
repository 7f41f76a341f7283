"""Tokens a crash loses, with and without durable generation progress (`rollout.agent.progress_every_s`).

    python -m bench.progress_loss [--model smollm2] [--settings off 30 10] [--crashes 2]
                                  [--out bench/results/progress_loss.json]

A real engine (vLLM in process, SmolLM2-135M-Instruct by default: it answers at length, as an agent
turn does), a real `RolloutWorker` with the tool agent, and a real `ReplayBuffer` on disk: rows go to
it as the worker writes them (parks, finishes), progress rows through the snapshot hook with
`durable=True`, as `streaming/actors/worker.py` wires them. The worker keeps `--concurrency`
trajectories in flight. At a seeded moment the run "crashes": every sampled token is counted, those
the loops hold and those the engine has streamed for requests still running, then the worker's
tasks are cancelled and the requests aborted. Tokens lost are the sampled tokens that no row in the
buffer holds: what a resumed run would sample again. The cost side is the throughput (sampled tokens
per second before the crash), the cuts and the tokens re-sent to the engine.

Each setting is measured `--crashes` times at different crash moments, interleaved over settings so
a slow spell of the machine touches them alike; one engine serves every trial.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def sampled(mask: list[int]) -> int:
    return sum(1 for m in mask if m)


async def trial(engine: Any, tokenizer: Any, records: list, every_s: float | None, crash_at_s: float, args) -> dict:
    """One run of the worker until the crash; the counts of what it sampled and what is durable."""
    from streamrl.buffer.config import BufferConfig
    from streamrl.buffer.store import ReplayBuffer
    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.config import AgentConfig, SamplingConfig
    from streamrl.rollout.parsers import get_parser
    from streamrl.rollout.rewards import get_reward_fn
    from streamrl.rollout.server_manager import ServerManager
    from streamrl.rollout.types import TrajectoryStatus
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.streaming.prompts import make_group

    root = Path(tempfile.mkdtemp(prefix="streamrl-progress-"))
    buffer = ReplayBuffer(BufferConfig(root_dir=str(root / "buffer"), group_size=1, batch_size=1))
    durable: dict[str, int] = {}  # trajectory id -> sampled tokens of its newest row in the buffer
    agent = AgentConfig(
        prompt_length=512,
        response_length=args.response_length,
        max_tokens_per_turn=args.response_length,
        sampling=SamplingConfig(temperature=1.0),
        progress_every_s=every_s,
    )
    ctx = AgentContext(
        cfg=agent,
        server=ServerManager([engine]),
        tokenizer=tokenizer,
        encoder=ObservationEncoder(tokenizer),
        parser=get_parser("hermes"),
        reward_fn=get_reward_fn("math_answer"),
    )

    async def sink(traj) -> bool:
        buffer.append([traj])
        durable[traj.trajectory_id] = sampled(traj.response_mask)
        return True

    async def snapshot(data) -> None:
        row = data.to_trajectory(TrajectoryStatus.PARTIAL)
        buffer.append([row], durable=True)
        durable[row.trajectory_id] = sampled(row.response_mask)

    ctx.snapshot = snapshot
    worker = RolloutWorker(ctx, sink, max_concurrent=args.concurrency)
    submitted = []
    for i, record in enumerate(records):
        (data,) = make_group(record, i, 1, None)
        data.agent_name = "tool_agent"
        submitted.append(data)
        worker.submit(data)
    start = time.monotonic()
    await asyncio.sleep(crash_at_s)
    # the crash: count first, then stop everything
    held = {d.trajectory_id: sampled(d.response_mask) for d in submitted}
    in_flight = sum(len(r.token_ids) for r in engine._requests.values())  # streamed, not yet returned
    running = len(worker._active)  # trajectories holding a slot: the ones a crash interrupts
    elapsed = time.monotonic() - start
    counters = ctx.counters
    await worker.shutdown()  # cancels every loop, as a killed process stops them
    for request_id in list(engine._requests):
        await engine.abort(request_id)
    buffer.close()
    produced = sum(held.values()) + in_flight
    kept = sum(durable.get(tid, 0) for tid in held)
    return {
        "progress_every_s": every_s,
        "crash_at_s": round(elapsed, 2),
        "sampled_tokens": produced,
        "durable_sampled_tokens": kept,
        "tokens_lost": produced - kept,
        "tokens_in_flight_at_crash": in_flight,
        "trajectories_running_at_crash": running,
        "trajectories_finished": worker.num_finished,
        "sampled_tokens_per_s": produced / elapsed,
        "progress_rows": counters.num_progress_rows,
        "progress_cuts": counters.num_progress_cuts,
        "reprefill_tokens": counters.num_reprefill_tokens,
    }


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from streamrl.engines.config import EngineConfig
    from streamrl.engines.vllm_engine import VLLMEngine
    from streamrl.models import resolve_model
    from streamrl.rollout.data import load_records

    model_path = str(resolve_model(args.model))
    cfg = EngineConfig(
        model=model_path,
        device="cpu",
        max_model_len=512 + args.response_length,
        kv_cache_space_gb=2,
        in_process=True,
    )
    engine = VLLMEngine(cfg, "progress-bench")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    settings = [None if s == "off" else float(s) for s in args.settings]
    rng = random.Random(args.seed)
    records = load_records("arithmetic", 4 * args.concurrency, args.seed)
    trials = []
    for crash in range(args.crashes):
        order = settings if crash % 2 == 0 else list(reversed(settings))
        crash_at = rng.uniform(args.crash_min_s, args.crash_max_s)
        for every in order:  # the same crash moment for every setting
            result = await trial(engine, tokenizer, records, every, crash_at, args)
            print(json.dumps(result), flush=True)
            trials.append(result)
    summary = {}
    for every in settings:
        mine = [t for t in trials if t["progress_every_s"] == every]
        summary["off" if every is None else f"{every:g}s"] = {
            "tokens_lost_mean": statistics.fmean(t["tokens_lost"] for t in mine),
            "tokens_lost_per_trajectory": statistics.fmean(
                t["tokens_lost"] / max(t["trajectories_running_at_crash"], 1) for t in mine
            ),
            "lost_share": statistics.fmean(t["tokens_lost"] / max(t["sampled_tokens"], 1) for t in mine),
            "sampled_tokens_per_s": statistics.fmean(t["sampled_tokens_per_s"] for t in mine),
            "progress_cuts_mean": statistics.fmean(t["progress_cuts"] for t in mine),
        }
    return {"model": args.model, "settings": args.settings, "trials": trials, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--settings", nargs="+", default=["off", "30", "10"], help="progress_every_s values or off")
    parser.add_argument("--crashes", type=int, default=2)
    parser.add_argument("--crash-min-s", type=float, default=40.0)
    parser.add_argument("--crash-max-s", type=float, default=70.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench/results/progress_loss.json"))
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    result = asyncio.run(run(args))
    result = {
        "command": "python -m bench.progress_loss " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.monotonic() - t0,
        **result,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, s in result["summary"].items():
        print(
            f"progress {name}: {s['tokens_lost_mean']:.0f} tokens lost per crash "
            f"({s['lost_share']:.0%} of those sampled, {s['tokens_lost_per_trajectory']:.0f} per running "
            f"trajectory), {s['sampled_tokens_per_s']:.1f} sampled tokens/s, {s['progress_cuts_mean']:.0f} cuts"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
