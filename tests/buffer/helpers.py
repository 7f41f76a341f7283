"""Hand-written trajectories for buffer tests."""

from __future__ import annotations

from streamrl.rollout.types import AgentData, FinishReason, Trajectory, TrajectoryStatus


def make_traj(
    group_id: str,
    sample_index: int,
    *,
    reward: float = 0.0,
    status: TrajectoryStatus = TrajectoryStatus.FINISHED,
    version: int = 0,
    num_response: int = 4,
    num_prompt: int = 3,
) -> Trajectory:
    """Response = sampled tokens at `version` with one observation token in the middle."""
    tid = f"{group_id}/{sample_index}"
    mask = [1] * num_response
    if num_response >= 3:
        mask[num_response // 2] = 0
    versions = [version if m else -1 for m in mask]
    logprobs = [-0.5 - 0.25 * i if m else 0.0 for i, m in enumerate(mask)]  # float32-exact values
    partial = status is TrajectoryStatus.PARTIAL
    agent_json = None
    if partial:
        agent_json = AgentData(
            trajectory_id=tid,
            group_id=group_id,
            sample_index=sample_index,
            prompt_ids=list(range(100, 100 + num_prompt)),
        ).to_json()
    return Trajectory(
        trajectory_id=tid,
        group_id=group_id,
        sample_index=sample_index,
        agent_name="tool_agent",
        prompt_ids=list(range(100, 100 + num_prompt)),
        response_ids=list(range(200, 200 + num_response)),
        response_mask=mask,
        behavior_logprobs=logprobs,
        policy_versions=versions,
        reward=reward,
        status=status,
        finish_reason=FinishReason.ABORT if partial else FinishReason.STOP,
        agent_data_json=agent_json,
    )


def make_group(
    group_id: str, n: int, *, rewards: list[float] | None = None, version: int = 0, **kw
) -> list[Trajectory]:
    rewards = rewards if rewards is not None else [float(i) for i in range(n)]
    return [make_traj(group_id, i, reward=rewards[i], version=version, **kw) for i in range(n)]
