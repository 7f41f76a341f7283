"""`streamrl rollout`: run agent loops against a local engine (no learner), print and save trajectories.

Used to eyeball a model + tool set before training, and as the evaluation entry point. Decoded
trajectories are printed with policy-sampled tokens and observation tokens in different colours and
a marker wherever the policy_version changes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from streamrl.rollout.types import Trajectory

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 15.0  # how often a running evaluation or rollout says how far it is


def token_runs(traj: Trajectory) -> list[tuple[int, int, list[int]]]:
    """Split the response into runs of equal (mask, policy_version): [(mask, version, token_ids)]."""
    out: list[tuple[int, int, list[int]]] = []
    for tok, m, v in zip(traj.response_ids, traj.response_mask, traj.policy_versions):
        if out and out[-1][0] == m and out[-1][1] == v:
            out[-1][2].append(tok)
        else:
            out.append((m, v, [tok]))
    return out


def console_text(traj: Trajectory, tokenizer: Any) -> Any:
    """The terminal view of a trajectory (the report's HTML view is `report_viewer.render_trajectory`):
    a rich Text, prompt dim, sampled tokens green, observations yellow, [v=k] at version changes."""
    from streamrl.observability.safe_text import SafeText as Text  # model and tool text: escapes shown, not run

    text = Text()
    text.append(tokenizer.decode(traj.prompt_ids[-64:]), style="dim")
    for mask, version, ids in token_runs(traj):
        if mask:
            text.append(f"[v={version}]", style="bold magenta")
            text.append(tokenizer.decode(ids), style="green")
        else:
            text.append(tokenizer.decode(ids), style="yellow")
    text.append(
        f"\n  reward={traj.reward:.2f} turns={traj.num_turns} tool_calls={traj.num_tool_calls} "
        f"status={traj.status} finish={traj.finish_reason}",
        style="bold",
    )
    return text


async def rollouts_on(
    engines: list[Any], cfg: Any, model_path: str, records: list, *, group_size: int, timeout_s: float = 3600.0
) -> list[Trajectory]:
    """`group_size` trajectories per record through the run's agent loop on `engines`
    (`InferenceEngine`s), in this process; the finished and failed trajectories, in no particular order."""
    from streamrl.rollout.server_manager import ServerManager
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.streaming.actors.worker import build_agent_context
    from streamrl.streaming.prompts import make_group

    results: list[Trajectory] = []

    async def sink(traj: Trajectory) -> None:
        results.append(traj)

    server = ServerManager(engines, max_sticky_keys=cfg.rollout.sticky_lru_size)
    worker = RolloutWorker(
        build_agent_context(cfg, model_path, server), sink, max_concurrent=cfg.rollout.max_concurrent_per_worker
    )
    total = len(records) * group_size
    try:
        for record in records:
            for data in make_group(record, 0, group_size, cfg.rollout.agent.default_interaction):
                worker.submit(data)
        reporter = asyncio.create_task(_report_progress(results, total))
        try:
            await worker.wait_idle(timeout_s=timeout_s)
        finally:
            reporter.cancel()
        worker.check()
        for err in worker.errors:
            logger.error("failed trajectory: %s", err)
    finally:
        await worker.shutdown()
        if worker.ctx.tools is not None:  # its MCP servers and sandboxes end with it
            await asyncio.to_thread(worker.ctx.tools.close)
    return results


async def _report_progress(results: list[Trajectory], total: int, every_s: float = PROGRESS_EVERY_S) -> None:
    """A console line every `every_s` while rollouts run: samples done, elapsed time, an ETA."""
    from streamrl.observability.logs import format_duration

    started = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        done, elapsed = len(results), time.monotonic() - started
        eta = f" · eta {format_duration(elapsed / done * (total - done))}" if done else ""
        logger.info("rollouts: %d/%d samples done · %s elapsed%s", done, total, format_duration(elapsed), eta)


async def run_rollouts(cfg: Any, records: list, *, group_size: int) -> list[Trajectory]:
    """Run `group_size` trajectories per record on one local engine; returns finished trajectories.
    `cfg.model` is a resolved folder (`StreamRLConfig.with_model`)."""
    from streamrl.engines import make_engine

    engine = make_engine(cfg.rollout.engine, "engine-0")
    try:
        return await rollouts_on([engine], cfg, cfg.model, records, group_size=group_size)
    finally:
        await engine.shutdown()


def rollout_main(*, config: str | None, overrides: list[str], num_prompts: int, out: str | None, show: int) -> int:
    from rich.console import Console
    from transformers import AutoTokenizer

    from streamrl.models import resolve_model
    from streamrl.rollout.data import load_records
    from streamrl.streaming.config import load_config
    from streamrl.streaming.train import prepare_harness

    cfg = load_config(config, overrides)
    out_path = Path(out or f"runs/rollout-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cfg = prepare_harness(cfg, out_path.with_suffix("").resolve())  # a verifiers environment's or harness's dataset
    cfg = cfg.with_model(str(resolve_model(cfg.model)))  # resolved once; the engine and tokenizer load it
    records = load_records(cfg.data.source, max(num_prompts, 1), cfg.data.seed, cfg.data.difficulty)[:num_prompts]
    t0 = time.time()
    trajs = asyncio.run(run_rollouts(cfg, records, group_size=1))
    elapsed = time.time() - t0
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    console = Console()
    for traj in trajs[:show]:
        console.rule(traj.trajectory_id)
        console.print(console_text(traj, tokenizer))
    with open(out_path, "w") as f:
        for traj in trajs:
            f.write(json.dumps(traj.to_dict()) + "\n")
    rewards = [t.reward for t in trajs]
    console.print(
        f"{len(trajs)} trajectories in {elapsed:.1f}s, mean reward {sum(rewards) / max(len(rewards), 1):.3f}, "
        f"written to {out_path}"
    )
    return 0
