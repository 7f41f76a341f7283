"""Tokens a crash loses, with and without durable generation progress (`rollout.agent.progress_every_s`).

    python -m bench.progress_loss [--model smollm2] [--settings off 30 10] [--crashes 2]
                                  [--crash worker|engine|preempt] [--out bench/results/progress_loss.json]

A real engine (vLLM in process, SmolLM2-135M-Instruct by default: it answers at length, as an agent
turn does), a real `RolloutWorker` with the tool agent, and a real `ReplayBuffer` on disk: rows go to
it as the worker writes them (parks, finishes), progress rows through the snapshot hook with
`durable=True`, as `streaming/actors/worker.py` wires them. The worker keeps `--concurrency`
trajectories in flight. At a seeded moment the run "crashes": every sampled token is counted, those
the loops hold and those the engine has streamed for requests still running, then the worker's
tasks are cancelled and the requests aborted. Tokens lost are the sampled tokens that no row in the
buffer holds: what a resumed run would sample again. The cost side is the throughput (sampled tokens
per second before the crash), the cuts and the tokens re-sent to the engine.

`--crash engine` kills an engine instead of the worker (default out: `progress_loss_engine.json`).
The worker routes over two engines (`ServerManager`, as a worker with two engines does); both are
views of the one real engine, so the bench needs one model's memory. At the crash moment engine A
dies: its running requests are aborted inside vLLM and each of its calls raises, as a call to a dead
engine actor does, so the tokens A streamed for them never reach a loop: they are the loss. The worker
goes on (`--after-s`), retrying on engine B from prompt + tokens so far. The trial checks what the
claim rests on: no trajectory failed, every trajectory still holds each token it held at the crash
(the same ids, as a prefix), and each one A was running sampled more or finished afterwards.

`--crash preempt` (default out: `progress_loss_preempt.json`) drains engine A on notice instead, as
the worker actor does (`ServerManager.retire`): its running requests are aborted and return what
they streamed. Lost: the tokens A had streamed for a trajectory that do not follow the tokens that
trajectory held at the notice, once the drain is over (a drain loses none when it works).

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
# the result file of each `--crash`, in bench/results/
RESULT_FILES = {
    "worker": "progress_loss.json",
    "engine": "progress_loss_engine.json",
    "preempt": "progress_loss_preempt.json",
}


def sampled(mask: list[int]) -> int:
    return sum(1 for m in mask if m)


class EngineDied(RuntimeError):
    """What a call to a dead engine raises (a dead Ray actor raises `RayActorError`): not the request's
    fault, so the router marks the engine unhealthy and retries the request on another one."""


class DyingEngine:
    """One view of the real engine that can die: after `die()` every call raises `EngineDied`, and the
    requests it was running are aborted inside vLLM with their streamed tokens thrown away."""

    def __init__(self, engine: Any, engine_id: str) -> None:
        self._engine = engine
        self.engine_id = engine_id
        self.running: set[str] = set()
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        if self.dead:
            raise EngineDied(f"{self.engine_id} is dead")
        self.running.add(request_id)
        try:
            output = await self._engine.generate(request_id, *args, **kwargs)
        finally:
            self.running.discard(request_id)
        if self.dead:  # aborted by the death: its tokens died with the engine
            raise EngineDied(f"{self.engine_id} died while generating {request_id}")
        return output

    async def abort(self, request_id: str) -> None:
        if not self.dead:
            await self._engine.abort(request_id)

    async def die(self) -> int:
        """Die now; returns the tokens streamed for the requests it was running (lost with it)."""
        self.dead = True
        running = [r for r in self.running if r in self._engine._requests]
        lost = sum(len(self._engine._requests[r].token_ids) for r in running)
        for request_id in running:
            await self._engine.abort(request_id)
        return lost


async def trial(engine: Any, tokenizer: Any, records: list, every_s: float | None, crash_at_s: float, args) -> dict:
    """One run of the worker until the crash; the counts of what it sampled and what is durable (a
    worker crash) or what the surviving worker still holds (an engine crash)."""
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
    two = args.crash in ("engine", "preempt")
    engines = [DyingEngine(engine, "engine-a"), DyingEngine(engine, "engine-b")] if two else [engine]
    ctx = AgentContext(
        cfg=agent,
        server=ServerManager(engines),
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
    if args.crash == "engine":
        result = await engine_death(engines, submitted, worker, start, args.after_s)
    elif args.crash == "preempt":
        result = await engine_preempted(engines, ctx.server, submitted, worker, start, args.after_s)
    else:
        result = worker_death(engine, submitted, worker, durable, start)
    await worker.shutdown()  # cancels every loop, as a killed process stops them
    for request_id in list(engine._requests):
        await engine.abort(request_id)
    buffer.close()
    counters = ctx.counters
    return {
        "crash": args.crash,
        "progress_every_s": every_s,
        **result,
        "trajectories_finished": worker.num_finished,
        "progress_rows": counters.num_progress_rows,
        "progress_cuts": counters.num_progress_cuts,
        "reprefill_tokens": counters.num_reprefill_tokens,
    }


def worker_death(engine: Any, submitted: list, worker: Any, durable: dict[str, int], start: float) -> dict:
    """The worker's process dies now: every sampled token that no buffer row holds is lost."""
    held = {d.trajectory_id: sampled(d.response_mask) for d in submitted}
    in_flight = sum(len(r.token_ids) for r in engine._requests.values())  # streamed, not yet returned
    running = len(worker._active)  # trajectories holding a slot: the ones a crash interrupts
    elapsed = time.monotonic() - start
    produced = sum(held.values()) + in_flight
    kept = sum(durable.get(tid, 0) for tid in held)
    return {
        "crash_at_s": round(elapsed, 2),
        "sampled_tokens": produced,
        "durable_sampled_tokens": kept,
        "tokens_lost": produced - kept,
        "tokens_in_flight_at_crash": in_flight,
        "trajectories_running_at_crash": running,
        "sampled_tokens_per_s": produced / elapsed,
    }


def trajectory_of(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]  # request ids are `<trajectory id>-<hex>`


async def engine_death(engines: list[DyingEngine], submitted: list, worker: Any, start: float, after_s: float) -> dict:
    """Engine A dies now; the worker goes on for `after_s` on engine B. Lost: what A had streamed."""
    dying, survivor = engines
    running_on_a = {trajectory_of(r) for r in dying.running}
    held = {d.trajectory_id: (list(d.response_ids), sampled(d.response_mask)) for d in submitted}
    in_flight = sum(len(r.token_ids) for r in dying._engine._requests.values())
    elapsed = time.monotonic() - start
    failed_before = worker.num_failed
    lost = await dying.die()
    await asyncio.sleep(after_s)
    by_id = {d.trajectory_id: d for d in submitted}
    prefix_kept = all(list(by_id[t].response_ids[: len(ids)]) == ids for t, (ids, _) in held.items())
    on_b = {trajectory_of(r) for r in survivor.running}
    moved_on = sum(  # generating on engine B now, or sampled more there, or finished (left the worker's slots)
        1 for t in running_on_a if t in on_b or sampled(by_id[t].response_mask) > held[t][1] or t not in worker._active
    )
    produced = sum(n for _, n in held.values()) + in_flight
    return {
        "crash_at_s": round(elapsed, 2),
        "sampled_tokens": produced,
        "tokens_lost": lost,
        "tokens_in_flight_at_crash": in_flight,
        "trajectories_running_at_crash": len(running_on_a),
        "trajectories_running_on_dead_engine_that_went_on": moved_on,
        "trajectories_failed_after_crash": worker.num_failed - failed_before,
        "held_tokens_kept_as_prefix": prefix_kept,
        "sampled_tokens_per_s": produced / elapsed,
    }


async def engine_preempted(
    engines: list[DyingEngine], server: Any, submitted: list, worker: Any, start: float, after_s: float
) -> dict:
    """Engine A is preempted on notice: the worker drains it (`ServerManager.retire`, as the worker
    actor does on the notice), its running requests return what they streamed and go on on engine B.
    Lost: the tokens A had streamed that do not follow a trajectory's held tokens afterwards."""
    draining, survivor = engines
    streamed = {
        trajectory_of(r): list(draining._engine._requests[r].token_ids)
        for r in draining.running
        if r in draining._engine._requests
    }
    held = {d.trajectory_id: list(d.response_ids) for d in submitted}
    in_flight = sum(len(r.token_ids) for r in draining._engine._requests.values())
    produced = sum(sampled(d.response_mask) for d in submitted) + in_flight
    elapsed = time.monotonic() - start
    failed_before = worker.num_failed
    await server.retire(draining.engine_id)
    await asyncio.sleep(after_s)
    by_id = {d.trajectory_id: d for d in submitted}
    lost = sum(
        len(ids)
        for t, ids in streamed.items()
        if list(by_id[t].response_ids[: len(held[t]) + len(ids)]) != held[t] + ids
    )
    on_b = {trajectory_of(r) for r in survivor.running}
    moved_on = sum(
        1 for t in streamed if t in on_b or len(by_id[t].response_ids) > len(held[t]) or t not in worker._active
    )
    return {
        "crash_at_s": round(elapsed, 2),
        "sampled_tokens": produced,
        "tokens_lost": lost,
        "tokens_streamed_by_drained_engine": sum(len(ids) for ids in streamed.values()),
        "tokens_in_flight_at_crash": in_flight,
        "trajectories_running_at_crash": len(streamed),
        "trajectories_running_on_drained_engine_that_went_on": moved_on,
        "trajectories_failed_after_crash": worker.num_failed - failed_before,
        "held_tokens_kept_as_prefix": all(list(by_id[t].response_ids[: len(ids)]) == ids for t, ids in held.items()),
        "sampled_tokens_per_s": produced / elapsed,
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
    parser.add_argument(
        "--crash", choices=["worker", "engine", "preempt"], default="worker", help="which process dies (or is drained)"
    )
    parser.add_argument("--after-s", type=float, default=20.0, help="engine crash: how long the worker goes on")
    parser.add_argument("--out", default=None, help="default: bench/results/progress_loss[_engine].json")
    args = parser.parse_args(argv)
    args.out = args.out or str(REPO / "bench/results" / RESULT_FILES[args.crash])
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
