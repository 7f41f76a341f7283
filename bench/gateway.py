"""`python -m bench.gateway`: an unmodified agent framework trained through the gateway on SmolLM2, and
what the gateway costs per call.

1. Training: `streamrl train --config configs/gateway_smollm2.toml` (SmolLM2-135M-Instruct, the OpenAI
   Agents SDK calculator agent of `workloads/agents/openai_sdk_calculator.py` run by the `gateway` agent
   loop) for `--steps` learner steps. From the run's own log: calls the gateway received, sampled and
   answered with an error; retries answered from the journal and replays; forks; calls a weight sync
   parked or interrupted; the in-run overhead (handler time outside the engine, the durable journal
   append included); trajectories finished / failed and rows trained.
2. Overhead, side by side on one engine: an in-process vLLM engine on the same model (prefix caching
   off, so neither path reuses the other's KV) answers the same greedy request two ways, in alternating
   order: a direct call through the worker's `ServerManager` on the pre-rendered token ids (what a
   built-in agent loop sends), and an `openai` SDK chat-completions call to a gateway session (HTTP,
   JSON, chat-template rendering, tool-call parsing, journal, response). Both sample the same tokens
   (checked); the difference is the gateway's overhead per call: median and p99 over `--pairs` pairs.
   This engine has no buffer behind it, so this number leaves out the durable journal append, which
   the in-run overhead of part 1 includes (`bench/gateway_journal.py` measures the journal alone).

Writes bench/results/gateway.json with the command and the machine.

    python -m bench.gateway [--steps 3] [--pairs 40] [--max-tokens 32] [--out bench/results/gateway.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import machine
from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/gateway_smollm2.toml"


def train(steps: int, root: Path, log: Path) -> tuple[Path, float, int]:
    """One `streamrl train` of the SDK agent; (run dir, wall seconds, exit code)."""
    args = [f"trainer.total_steps={steps}", f"trainer.run_root={root}", "trainer.run_name=gateway"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "streamrl.streaming.cli", "train", "--config", CONFIG, *args]
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return root / "gateway", time.monotonic() - t0, rc


def run_counts(run_dir: Path) -> dict[str, Any]:
    """The gateway's and the workers' counters summed over the run's metrics lines (increments)."""
    lines = RunDir(run_dir).metric_records()
    keys = [
        "rollout/gateway/num_requests",
        "rollout/gateway/num_sampled",
        "rollout/gateway/num_errors",
        "rollout/gateway/num_retries_answered",
        "rollout/gateway/num_replayed",
        "rollout/gateway/num_forks",
        "rollout/gateway/num_calls_across_sync",
        "rollout/gateway/overhead_sum_s",
        "rollout/num_finished",
        "rollout/num_failed",
        "rollout/num_interrupts",
        "rollout/num_generated_tokens",
    ]
    totals = {k.rsplit("/", 1)[1] if "gateway" in k else k: sum(m.get(k, 0.0) for m in lines) for k in keys}
    sampled = totals["num_sampled"]
    totals["overhead_mean_ms_in_run"] = 1000 * totals.pop("overhead_sum_s") / sampled if sampled else None
    steps = [m for m in lines if "learner/loss" in m]
    totals["learner_steps"] = max((int(m["learner_step"]) for m in steps), default=0)
    totals["reward_mean_per_step"] = [round(m.get("rollout/reward_mean", float("nan")), 3) for m in steps]
    return totals


def trained_rows(run_dir: Path) -> dict[str, Any]:
    from streamrl.buffer.cli import load_frame

    frame = load_frame(run_dir / "buffer")
    latest = frame[frame["is_latest"]]
    consumed = latest[latest["num_consumed"] > 0]
    return {
        "rows_trained": int(len(consumed)),
        "agents": sorted(set(consumed["agent_name"])),
        "sampled_tokens_trained": int(sum(int(sum(m)) for m in consumed["response_mask"])),
        "observation_tokens_trained": int(sum(len(m) - int(sum(m)) for m in consumed["response_mask"])),
        "tool_calls_in_trained_rows": int(consumed["num_tool_calls"].sum()),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _stats(values: list[float]) -> dict[str, float]:
    ms = [1000 * v for v in values]
    return {"median_ms": round(statistics.median(ms), 2), "p99_ms": round(_pct(ms, 0.99), 2)}


async def _gateway_ctx(model_path: str):
    """An engine on `model_path` behind a ServerManager, the agent context and a started gateway."""
    from transformers import AutoTokenizer

    from streamrl.engines.config import EngineConfig
    from streamrl.engines.vllm_engine import VLLMEngine
    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.config import AgentConfig, SamplingConfig
    from streamrl.rollout.gateway.config import GatewayConfig
    from streamrl.rollout.gateway.server import GatewayServer
    from streamrl.rollout.parsers import get_parser
    from streamrl.rollout.rewards import get_reward_fn
    from streamrl.rollout.server_manager import ServerManager

    engine_cfg = EngineConfig(
        model=model_path, device="cpu", max_model_len=1024, kv_cache_space_gb=1, enable_prefix_caching=False
    )
    engine = VLLMEngine(engine_cfg.model_copy(update={"in_process": True}), "bench-0")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    agent = AgentConfig(
        prompt_length=768, response_length=256, sampling=SamplingConfig(temperature=0.0), gateway=GatewayConfig()
    )
    ctx = AgentContext(
        cfg=agent,
        server=ServerManager([engine]),
        tokenizer=tokenizer,
        encoder=ObservationEncoder(tokenizer),
        parser=get_parser("hermes"),
        reward_fn=get_reward_fn("math_answer"),
    )
    server = GatewayServer(agent.gateway or GatewayConfig())
    await server.start()
    return engine, ctx, server


async def _pair(ctx: Any, server: Any, client: Any, i: int, messages: list, tools: list, max_tokens: int):
    """(direct s, gateway s, the gateway handler's own overhead s, same tokens?) for one prompt, the order
    alternating with i."""
    from streamrl.engines.base import SamplingParams
    from streamrl.rollout.gateway.session import Session
    from streamrl.rollout.types import AgentData, AgentState

    ids = ctx.encoder.encode_prompt(messages, tools)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=ctx.stop_token_ids)
    data = AgentData(trajectory_id=f"bench/{i}", group_id="bench", agent_name="gateway", state=AgentState.INTERACTING)
    session = Session(ctx, data, ctx.cfg.gateway)
    server.add(session)
    client = client.with_options(base_url=server.base_url(session), api_key=session.token)

    async def direct() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out, _ = await ctx.server.generate(f"direct-{i}", f"direct-{i}", ids, params)
        return time.perf_counter() - t0, list(out.token_ids)

    async def gateway() -> float:
        t0 = time.perf_counter()
        await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=max_tokens)
        return time.perf_counter() - t0

    handler_before = server.counts["overhead_sum_s"]
    if i % 2:
        (direct_s, tokens), gateway_s = await direct(), await gateway()
    else:
        gateway_s, (direct_s, tokens) = await gateway(), await direct()
    server.remove(session)
    same = session.state.branches[0].token_ids == tokens
    return direct_s, gateway_s, server.counts["overhead_sum_s"] - handler_before, same


async def overhead(model_path: str, pairs: int, max_tokens: int) -> dict[str, Any]:
    """The gateway's cost per call against a direct call on the same engine (module docstring, 2.)."""
    import openai

    from streamrl.rollout.data import load_records
    from streamrl.workloads.agents.openai_sdk_calculator import calculator

    tools = [{"type": "function", "function": {"name": calculator.name, "parameters": calculator.params_json_schema}}]
    records = load_records("arithmetic", pairs + 2, 0)
    engine, ctx, server = await _gateway_ctx(model_path)
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1/unused", api_key="per-session", max_retries=0)
    try:
        for w in range(2):  # warm-up: the engine's first requests and the HTTP connection
            await _pair(ctx, server, client, 10_000 + w, records[pairs + w].messages, tools, max_tokens)
        direct, via, diffs, handler, same = [], [], [], [], 0
        for i in range(pairs):
            d, g, h, ok = await _pair(ctx, server, client, i, records[i].messages, tools, max_tokens)
            direct.append(d)
            via.append(g)
            diffs.append(g - d)
            handler.append(h)
            same += ok
            print(f"pair {i + 1}/{pairs}: direct {d:.3f} s, gateway {g:.3f} s", file=sys.stderr, flush=True)
    finally:
        await client.close()
        await server.stop()
        await engine.shutdown()
    return {
        "pairs": pairs,
        "max_tokens": max_tokens,
        "pairs_with_the_same_tokens": same,
        "direct_call": _stats(direct),
        "gateway_call": _stats(via),
        "overhead_per_call": _stats(diffs),  # gateway call - direct call, pair by pair
        "gateway_handler_overhead": _stats(handler),  # the server's own count: handler time outside the engine
        "overhead_fraction_of_median_call": round(statistics.median(diffs) / statistics.median(direct), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "bench/results/gateway.json"))
    args = p.parse_args(argv)
    t0 = time.monotonic()
    from streamrl.models import resolve_model

    model_path = str(resolve_model("smollm2"))
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        root = Path(tmp)
        run_dir, wall_s, rc = train(args.steps, root, root / "train.log")
        if rc != 0:
            print((root / "train.log").read_text()[-6000:], file=sys.stderr)
            raise SystemExit(f"streamrl train exited with {rc}")
        training = {"config": CONFIG, "exit_code": rc, "wall_s": round(wall_s, 1)}
        training |= run_counts(run_dir) | trained_rows(run_dir)
    result = {
        "command": "python -m bench.gateway " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(model="smollm2 (SmolLM2-135M-Instruct)", openai_agents=_version("openai-agents")),
        "training": training,
        "overhead": None,  # written first without it: a slow machine keeps the training part
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["overhead"] = asyncio.run(overhead(model_path, args.pairs, args.max_tokens))
    result["runtime_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
