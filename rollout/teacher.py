"""The distillation teacher's side of a rollout worker: every finished trajectory is scored by the
teacher before its row is written (docs/distillation.md).

`TeacherScorer.score` sends one request per trajectory to the teacher's engines (a `ServerManager`
of its own: least-outstanding routing, an engine that fails leaves routing and the request is retried
on another, the driver's health loop probes it back): the whole sequence `prompt_ids +
response_ids`, scored from the first response token. However many segments generated the response
(a trajectory parked at a weight sync and resumed under newer weights has several), the teacher sees
it once, in one forward, exactly as the learner will. Its log-prob of each response token is kept in
`Trajectory.teacher_logprobs`, beside `behavior_logprobs`, 0.0 at observation tokens (the policy did
not sample them; the learner never reads them).

The teacher never syncs weights: its engines are outside the weight-sync group, serve one fixed
model, and their `policy_version` stays at 0. A scoring error fails the trajectory (the worker's
fault boundary counts it by reason), so a dead teacher shows in `rollout/num_failed` and in the
driver's failed-trajectory check instead of in rows without a signal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.types import Trajectory


def teacher_row(scores: Sequence[float], response_mask: Sequence[int]) -> list[float]:
    """The teacher's log-prob of each response token ([num_response_tokens]), 0.0 where the mask is 0.
    ValueError when the engine returned another count, or a non-finite score for a sampled token."""
    if len(scores) != len(response_mask):
        raise ValueError(f"teacher returned {len(scores)} log-probs for {len(response_mask)} response tokens")
    row = [float(s) if m else 0.0 for s, m in zip(scores, response_mask, strict=True)]
    if not all(math.isfinite(s) for s in row):
        raise ValueError("teacher returned a non-finite log-prob for a sampled token")
    return row


class TeacherScorer:
    """Scores finished trajectories on the teacher's engines; counts what it did for `distill/*`."""

    def __init__(self, server: ServerManager) -> None:
        self.server = server
        self.num_scored = 0  # trajectories scored
        self.num_scored_tokens = 0  # sampled tokens scored
        self.score_s_sum = 0.0  # wall time of the scoring requests

    async def score(self, traj: Trajectory) -> Trajectory:
        """`traj` with `teacher_logprobs` set (one request over its whole sequence)."""
        start = time.monotonic()
        request_id = f"{traj.trajectory_id}-teacher-{traj.attempt}"
        scores = await self.server.score(
            traj.trajectory_id, request_id, traj.prompt_ids + traj.response_ids, len(traj.prompt_ids)
        )
        self.server.release(traj.trajectory_id)
        traj.teacher_logprobs = teacher_row(scores, traj.response_mask)
        self.score_s_sum += time.monotonic() - start
        self.num_scored += 1
        self.num_scored_tokens += traj.num_sampled_tokens
        return traj

    def metrics(self) -> dict[str, float]:
        """Counters summed over workers by the driver (`distill/teacher_latency_mean_s` is derived there)."""
        return {
            "distill/num_scored": float(self.num_scored),
            "distill/num_scored_tokens": float(self.num_scored_tokens),
            "distill/score_s_sum": self.score_s_sum,
        }


def check_same_tokenizer(student_path: str, teacher_path: str) -> None:
    """ValueError unless the teacher's tokenizer (HF folder) has the student's vocabulary: the teacher
    scores the student's token ids as they are."""
    from transformers import AutoTokenizer

    def vocab(path: str) -> dict[str, int]:
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert tokenizer is not None  # transformers types it as possibly None (backends import conditionally)
        return tokenizer.get_vocab()

    a, b = vocab(student_path), vocab(teacher_path)
    if a != b:
        raise ValueError(
            f"the distillation teacher {teacher_path} has another vocabulary than the student {student_path} "
            f"({len(b)} vs {len(a)} tokens): the teacher must share the student's tokenizer"
        )
