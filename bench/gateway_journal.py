"""`python -m bench.gateway_journal`: what a gateway session's exactly-once journal costs as the session
grows: bytes made durable and the gateway's own event-loop time per answered call, for sessions of
100 and 200 calls.

A scripted agent calls one session over and over, each call the conversation so far plus the last
answer plus a new observation message (an agent loop's shape). Every answer is made durable through the
same hooks a rollout worker wires (`streaming/actors/worker.py`): into a real `ReplayBuffer` with a log
directory, flushed and fsynced like a durable append. Bytes written are the log directory's size after
the session minus its size after admission. The per-call overhead is the time of `Session.complete`
outside the engine and outside the buffer's own work (which runs in the buffer actor's process in a
real run): templating, placing the call on the record, building the durable record on the worker's
event loop. Reported as the median of the first and the last 20 calls of each session (flat means
the cost of a call does not depend on how many came before it) and of all.

The engine is a FakeEngine (no model), so the numbers are the gateway's alone.

    python -m bench.gateway_journal [--calls 100 200] [--label after] [--out bench/results/gateway_journal.json]

`--label` names the entry the run writes under `runs` of the output (other labels already there are
kept), so the same command run on two versions of the gateway lands side by side in one file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import machine

REPO = Path(__file__).resolve().parents[1]
ANSWER = "I looked at the numbers again and the next step is to call the calculator with the new values."
OBSERVATION = "Observation {i}: the calculator returned {v}; the remaining items still need a look."


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class _Hooks:
    """The worker's durable hooks over a local buffer, timing the buffer's share (another process in a run)."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.buffer_s = 0.0

    async def snapshot(self, data: Any) -> None:
        from streamrl.buffer.schema import trajectories_to_batch
        from streamrl.rollout.types import TrajectoryStatus

        batch = trajectories_to_batch([data.to_trajectory(TrajectoryStatus.PARTIAL)])  # the worker's side
        t0 = time.perf_counter()
        self.buffer.append(batch, durable=True)
        self.buffer_s += time.perf_counter() - t0

    async def append_journal(self, record: Any) -> None:
        t0 = time.perf_counter()
        self.buffer.append_journal([record])
        self.buffer_s += time.perf_counter() - t0


async def session_cost(num_calls: int, tokenizer: Any, root: Path) -> dict[str, Any]:
    """Run one session of `num_calls` calls; bytes written and per-call overhead."""
    from streamrl.buffer.config import BufferConfig
    from streamrl.buffer.store import ReplayBuffer
    from streamrl.engines.fake import FakeEngine
    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.config import AgentConfig
    from streamrl.rollout.gateway import protocol
    from streamrl.rollout.gateway.config import GatewayConfig
    from streamrl.rollout.gateway.session import CallStats, Session, call_key
    from streamrl.rollout.server_manager import ServerManager
    from streamrl.rollout.types import AgentData, AgentState, TrajectoryStatus

    answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    engine = FakeEngine(script=lambda prompt: answer)
    cfg = AgentConfig(
        prompt_length=1024, response_length=64 * num_calls * 2, max_tokens_per_turn=64, gateway=GatewayConfig()
    )
    ctx = AgentContext(
        cfg=cfg, server=ServerManager([engine]), tokenizer=tokenizer, encoder=ObservationEncoder(tokenizer)
    )
    buffer = ReplayBuffer(BufferConfig(root_dir=str(root), batch_size=1, group_size=1))
    hooks = _Hooks(buffer)
    ctx.snapshot = hooks.snapshot
    if hasattr(ctx, "append_journal"):
        ctx.append_journal = hooks.append_journal
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add up the items of the list, one at a time."}]
    data = AgentData(trajectory_id="bench/0", group_id="bench", agent_name="gateway", messages=list(messages))
    buffer.append([data.to_trajectory(TrajectoryStatus.PARTIAL)], durable=True)  # admission
    admitted = _dir_bytes(root)
    data.state = AgentState.INTERACTING
    session = Session(ctx, data, cfg.gateway)
    overhead_ms: list[float] = []
    for i in range(num_calls):
        body = {"model": "policy", "messages": messages, "max_tokens": 64}
        call = protocol.parse_openai(body, max_choices=8)
        key, body_sha = call_key(session.session_id, session.attempt, "chat/completions", body)
        stats, before = CallStats(), hooks.buffer_s
        t0 = time.perf_counter()
        response = await session.complete(call, key, body_sha, stats)
        elapsed = time.perf_counter() - t0
        overhead_ms.append((elapsed - stats.engine_s - (hooks.buffer_s - before)) * 1000)
        reply = response["choices"][0]["message"]
        messages = [*messages, reply, {"role": "user", "content": OBSERVATION.format(i=i, v=17 * i)}]
    buffer.flush()
    written = _dir_bytes(root) - admitted
    buffer.close()
    assert len(engine.requests_seen) == num_calls and session.state.num_forks == 0
    edge = min(20, num_calls // 2)
    return {
        "num_calls": num_calls,
        "bytes_written": written,
        "bytes_per_call": written / num_calls,
        "overhead_ms_median": statistics.median(overhead_ms),
        "overhead_ms_first": statistics.median(overhead_ms[:edge]),
        "overhead_ms_last": statistics.median(overhead_ms[-edge:]),
        "overhead_ms_max": max(overhead_ms),
        "num_response_tokens": len(data.response_ids),
    }


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[100, 200])
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", default="bench/results/gateway_journal.json")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from streamrl.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    sessions = []
    for n in args.calls:
        with tempfile.TemporaryDirectory(prefix="streamrl-journal-bench-") as tmp:
            sessions.append(asyncio.run(session_cost(n, tokenizer, Path(tmp))))
            print(json.dumps(sessions[-1]), flush=True)
    by_calls = {s["num_calls"]: s for s in sessions}
    run: dict[str, Any] = {"commit": _commit(), "sessions": sessions}
    if 100 in by_calls and 200 in by_calls:
        run["bytes_ratio_200_over_100"] = by_calls[200]["bytes_written"] / by_calls[100]["bytes_written"]
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["command"] = "python -m bench.gateway_journal " + " ".join(sys.argv[1:] if argv is None else argv)
    result["machine"] = machine()
    result.setdefault("runs", {})[args.label] = run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
