"""ToolAgentLoop + RolloutWorker logic on a scripted engine, the tiny tokenizer and the real tools.

The scripted engine continues whatever assistant turn the prompt ends in, so the tests can interrupt
a generation anywhere and check that the resumed trajectory is the same token sequence.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.agent_loop import AgentContext, ToolAgentLoop
from streamrl.rollout.agent_loop.observation import ObservationEncoder, truncate_text
from streamrl.rollout.config import AgentConfig
from streamrl.rollout.parsers import get_parser
from streamrl.rollout.rewards import get_reward_fn
from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.types import AgentData, AgentState, FinishReason, TrajectoryStatus
from streamrl.rollout.worker import RolloutWorker
from streamrl.tools.config import load_tool_config

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
ANSWER = "The answer is \\boxed{84}."
SLOW_CALL = '<tool_call>\n{"name": "sleep", "arguments": {"text": "hi"}}\n</tool_call>'


def turn_script(tokenizer, turns: list[str]):
    """An engine script: continue turn k (k = assistant headers in the prompt after the first user turn)."""
    eos = tokenizer.eos_token_id
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    turn_ids = [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in turns]

    def script(prompt_ids: list[int]) -> list[int]:
        starts = [i + len(header) for i in range(len(prompt_ids)) if prompt_ids[i : i + len(header)] == header]
        k = len(starts) - 1
        done = prompt_ids[starts[-1] :]
        target = turn_ids[min(k, len(turn_ids) - 1)]
        assert target[: len(done)] == done, "resumed prompt is not a prefix of the scripted turn"
        return target[len(done) :]

    return script, turn_ids


def make_ctx(tokenizer, engine, tool_yaml="configs/tools/calculator.yaml", **cfg) -> AgentContext:
    cfg.setdefault("prompt_length", 1024)
    agent_cfg = AgentConfig(response_length=400, max_tokens_per_turn=120, **cfg)
    return AgentContext(
        cfg=agent_cfg,
        server=ServerManager([engine]),
        tokenizer=tokenizer,
        encoder=ObservationEncoder(tokenizer),
        tools=load_tool_config(tool_yaml),
        parser=get_parser("hermes"),
        reward_fn=get_reward_fn("math_answer"),
    )


def new_data(tid: str = "g0/0") -> AgentData:
    return AgentData(
        trajectory_id=tid,
        group_id="g0",
        messages=[{"role": "user", "content": "What is 12 times 7?"}],
        ground_truth="84",
    )


async def test_multi_turn_tool_trajectory_is_engine_tokens_plus_observations(tiny_tokenizer):
    tok = tiny_tokenizer
    script, turn_ids = turn_script(tok, [CALL, ANSWER])
    engine = FakeEngine(script=script, policy_version=3)
    ctx = make_ctx(tok, engine)
    traj = await ToolAgentLoop(ctx).run(new_data())

    traj.validate()
    assert traj.status is TrajectoryStatus.FINISHED and traj.finish_reason is FinishReason.STOP
    obs = ctx.encoder.encode_new_messages([{"role": "tool", "content": "84"}])
    assert traj.response_ids == turn_ids[0] + obs + turn_ids[1]
    assert traj.response_mask == [1] * len(turn_ids[0]) + [0] * len(obs) + [1] * len(turn_ids[1])
    assert set(v for v, m in zip(traj.policy_versions, traj.response_mask) if m) == {3}
    assert traj.reward == 1.0 and traj.num_tool_calls == 1 and traj.num_tool_errors == 0
    assert traj.num_turns == 3  # two assistant turns, one tool turn
    # The observation is exactly the template's continuation after an assistant turn.
    assert tok.decode(obs).startswith("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>")
    full = tok.decode(traj.prompt_ids + traj.response_ids)
    assert full.endswith("The answer is \\boxed{84}.<|im_end|>")


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',  # bad JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>',  # wrong type
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}',  # unclosed
    ],
)
async def test_malformed_call_becomes_error_observation(tiny_tokenizer, bad):
    script, _ = turn_script(tiny_tokenizer, [bad, ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    traj = await ToolAgentLoop(ctx).run(new_data())
    traj.validate()
    assert traj.status is TrajectoryStatus.FINISHED
    data = traj  # error surfaced as an observation the model sees, counted
    text = tiny_tokenizer.decode([t for t, m in zip(data.response_ids, data.response_mask) if m == 0])
    assert "rror" in text
    assert ctx.counters.num_parse_errors + ctx.counters.num_tool_errors >= 1


async def test_interrupt_mid_generation_resumes_same_sequence(tiny_tokenizer):
    tok = tiny_tokenizer
    script, turn_ids = turn_script(tok, [CALL, ANSWER])
    engine = FakeEngine(script=script, token_delay_s=0.002, policy_version=0)
    ctx = make_ctx(tok, engine)
    data = new_data()
    task = asyncio.create_task(ToolAgentLoop(ctx).run(data))
    while len(data.response_ids) == 0 and engine.stats().num_running == 0:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)  # some tokens of the first turn streamed
    ctx.cancel.set()
    partial = await task
    assert partial.status is TrajectoryStatus.PARTIAL and partial.finish_reason is FinishReason.ABORT
    n_kept = len(partial.response_ids)
    assert 0 < n_kept < len(turn_ids[0])
    assert partial.response_ids == turn_ids[0][:n_kept]

    # Weights change while parked; resume from the serialized AgentData in a fresh context.
    engine.policy_version = 1
    ctx2 = make_ctx(tok, engine)
    restored = AgentData.from_json(partial.agent_data_json)
    assert restored.state is AgentState.GENERATING and restored.num_interrupts == 1
    final = await ToolAgentLoop(ctx2).run(restored)
    final.validate()
    obs = ctx2.encoder.encode_new_messages([{"role": "tool", "content": "84"}])
    assert final.response_ids == turn_ids[0] + obs + turn_ids[1]
    sampled_versions = [v for v, m in zip(final.policy_versions, final.response_mask) if m]
    assert sampled_versions == [0] * n_kept + [1] * (len(sampled_versions) - n_kept)
    assert final.num_tool_calls == 1 and final.reward == 1.0 and final.num_interrupts == 1
    # re-prefill: the resumed request's prompt is prompt + the kept tokens
    assert engine.requests_seen[1][1] == final.prompt_ids + turn_ids[0][:n_kept]


@pytest.mark.timeout(60)
async def test_interrupt_during_tool_keeps_running_tool_then_parks(tiny_tokenizer):
    tok = tiny_tokenizer
    script, turn_ids = turn_script(tok, [SLOW_CALL, ANSWER])
    engine = FakeEngine(script=script)
    ctx = make_ctx(tok, engine, tool_yaml="configs/tools/sleep.yaml")
    sink: list = []

    async def collect(traj):
        sink.append(traj)

    worker = RolloutWorker(ctx, collect)
    data = new_data()
    worker.submit(data)
    for _ in range(2000):
        if data.state is AgentState.PROCESSING_TOOLS:
            break
        await asyncio.sleep(0.005)
    assert data.state is AgentState.PROCESSING_TOOLS, worker.errors
    await worker.pause(timeout_s=5)  # returns at once: nothing is in the engine
    assert ctx.num_in_engine == 0
    await asyncio.sleep(0.8)  # the tool (0.5 s +- 0.1) finishes during the pause, then the loop parks
    assert len(sink) == 1 and sink[0].status is TrajectoryStatus.PARTIAL
    parked = AgentData.from_json(sink[0].agent_data_json)
    assert parked.state is AgentState.GENERATING and len(parked.tool_results) == 1
    assert parked.response_mask[-1] == 0  # the tool observation is in, the next turn not started
    engine.policy_version = 5
    await worker.resume()
    await worker.wait_idle(10)
    final = sink[-1]
    final.validate()
    assert final.status is TrajectoryStatus.FINISHED
    assert final.num_tool_calls == 1  # the tool ran exactly once across the park
    assert worker.num_partial == 1 and worker.num_resumed == 1
    versions = [v for v, m in zip(final.policy_versions, final.response_mask) if m]
    assert versions == [0] * len(turn_ids[0]) + [5] * len(turn_ids[1])


async def test_pause_waits_for_generations_to_park_and_holds_admissions(tiny_tokenizer):
    tok = tiny_tokenizer
    script, _ = turn_script(tok, [CALL, ANSWER])
    engine = FakeEngine(script=script, token_delay_s=0.003)
    ctx = make_ctx(tok, engine)
    sink: list = []

    async def collect(traj):
        sink.append(traj)

    worker = RolloutWorker(ctx, collect, max_concurrent=8)
    for i in range(6):
        worker.submit(new_data(f"g0/{i}"))
    await asyncio.sleep(0.03)
    await worker.pause(timeout_s=5)
    assert ctx.num_in_engine == 0 and engine.stats().num_running == 0
    parked = [t for t in sink if t.status is TrajectoryStatus.PARTIAL]
    assert parked, "generations in flight must park with partial rows before pause returns"
    worker.submit(new_data("g1/0"))  # held while paused
    assert worker.num_held >= 1
    await worker.resume()
    await worker.wait_idle(20)
    finished = {t.trajectory_id: t for t in sink if t.status is TrajectoryStatus.FINISHED}
    assert len(finished) == 7
    for t in finished.values():
        t.validate()
        assert t.reward == 1.0


async def test_failed_trajectory_is_a_failed_row_not_a_crash(tiny_tokenizer):
    engine = FakeEngine(script=[[1, 2, 3]])
    engine.fail_with = RuntimeError("engine exploded")
    ctx = make_ctx(tiny_tokenizer, engine)
    sink: list = []

    async def collect(traj):
        sink.append(traj)

    worker = RolloutWorker(ctx, collect)
    worker.submit(new_data())
    await worker.wait_idle(5)
    assert sink[0].status is TrajectoryStatus.FAILED and sink[0].finish_reason is FinishReason.ERROR
    assert worker.num_failed == 1 and "engine exploded" in worker.errors[0]


def test_prompt_too_long_is_rejected_clearly(tiny_tokenizer):
    ctx = make_ctx(tiny_tokenizer, FakeEngine(), prompt_length=8)
    with pytest.raises(ValueError, match="prompt_length"):
        asyncio.run(ToolAgentLoop(ctx).handle_pending(new_data()))


def test_truncate_text_sides():
    text = "a" * 50 + "b" * 50
    assert truncate_text(text, 200, "left") == text
    assert truncate_text(text, 40, "left").startswith("a" * 23)
    assert truncate_text(text, 40, "right").endswith("b" * 23)
    mid = truncate_text(text, 40, "middle")
    assert mid.startswith("a") and mid.endswith("b") and len(mid) == 40
    with pytest.raises(ValueError):
        truncate_text(text, 10, "up")


async def test_interaction_turns_are_observations_and_end_the_episode(tiny_tokenizer):
    from streamrl.rollout.interactions import load_interaction_config

    tok = tiny_tokenizer
    script, turn_ids = turn_script(tok, ["I think it is \\boxed{80}.", ANSWER])
    ctx = make_ctx(tok, FakeEngine(script=script))
    ctx.tools = None
    ctx.interactions = load_interaction_config("configs/interactions/math_feedback.yaml")
    data = new_data()
    data.interaction_name = "math_feedback"
    traj = await ToolAgentLoop(ctx).run(data)
    traj.validate()
    assert traj.finish_reason is FinishReason.INTERACTION_DONE
    assert traj.turn_scores == [0.0, 1.0] and traj.reward == 1.0
    feedback = tok.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if m == 0])
    assert "incorrect" in feedback.lower()
    assert traj.response_ids[: len(turn_ids[0])] == turn_ids[0]
    assert traj.response_ids[-len(turn_ids[1]) :] == turn_ids[1]


async def test_turn_cut_by_per_turn_budget_still_reaches_the_environment(tiny_tokenizer):
    from streamrl.rollout.interactions import load_interaction_config

    tok = tiny_tokenizer
    long_turn = "word " * 200  # longer than max_tokens_per_turn: the engine stops with "length"
    script, turn_ids = turn_script(tok, [long_turn, ANSWER])
    ctx = make_ctx(tok, FakeEngine(script=script))
    ctx.tools = None
    ctx.interactions = load_interaction_config(
        {
            "interaction": [
                {
                    "name": "latency_env",
                    "class_name": "streamrl.workloads.interactions.latency_env.LatencyEnvironment",
                    "config": {"latency_s": 0.0, "num_turns": 2},
                }
            ]
        }
    )
    data = new_data()
    data.interaction_name = "latency_env"
    traj = await ToolAgentLoop(ctx).run(data)
    traj.validate()
    n = ctx.cfg.max_tokens_per_turn
    assert traj.response_ids[:n] == turn_ids[0][:n] and traj.response_mask[n] == 0
    # the observation re-opens the template with the eos the cut turn lacked
    obs_start = tok.decode(traj.response_ids[n : n + 3])
    assert obs_start.startswith(tok.eos_token)
    assert traj.finish_reason is FinishReason.INTERACTION_DONE and traj.num_turns == 4


async def test_duplicate_submission_is_dropped_running_or_held(tiny_tokenizer):
    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script, token_delay_s=0.002))
    sink: list = []

    async def collect(traj):
        sink.append(traj)

    worker = RolloutWorker(ctx, collect)
    await worker.pause(timeout_s=5)
    assert worker.submit(new_data()) is True
    assert worker.submit(new_data()) is False  # held twice -> once
    await worker.resume()
    assert worker.submit(new_data()) is False  # running -> not again
    await worker.wait_idle(10)
    assert [t.status for t in sink] == [TrajectoryStatus.FINISHED]


async def test_interaction_attempts_survive_a_resume_in_another_process(tiny_tokenizer):
    from streamrl.rollout.interactions import MathFeedbackInteraction

    class PausingFeedback(MathFeedbackInteraction):
        """A weight sync arrives while the environment answers: the loop parks at the next turn."""

        async def generate_response(self, instance_id, messages, **kwargs):
            ctx.cancel.set()
            return await super().generate_response(instance_id, messages, **kwargs)

    tok = tiny_tokenizer
    script, _ = turn_script(tok, ["It is \\boxed{80}.", "It is \\boxed{81}.", ANSWER])
    ctx = make_ctx(tok, FakeEngine(script=script))
    ctx.tools = None
    ctx.interactions = {"math_feedback": PausingFeedback({"name": "math_feedback", "max_attempts": 2})}
    data = new_data()
    data.interaction_name = "math_feedback"
    partial = await ToolAgentLoop(ctx).run(data)
    assert partial.status is TrajectoryStatus.PARTIAL and partial.turn_scores == [0.0]

    ctx2 = make_ctx(tok, FakeEngine(script=script))  # another process: a fresh interaction instance
    ctx2.tools = None
    ctx2.interactions = {"math_feedback": MathFeedbackInteraction({"name": "math_feedback", "max_attempts": 2})}
    final = await ToolAgentLoop(ctx2).run(AgentData.from_json(partial.agent_data_json))
    final.validate()
    # The second wrong answer is the last of max_attempts=2: the episode ends, no third attempt.
    assert final.finish_reason is FinishReason.INTERACTION_DONE
    assert final.turn_scores == [0.0, 0.0] and final.reward == 0.0 and final.num_turns == 4
    assert len(ctx2.interactions["math_feedback"]._instances) == 0  # finalized at the end
