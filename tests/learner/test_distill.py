"""On-policy distillation's learner side: the per-token reverse-KL advantage against hand-computed
values, and the alignment of the teacher's log-probs with the tokens they score, from the buffer row
to the learner's [B, T] tensors (a teacher shifted by one token must show as a KL, not as zero)."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.buffer.padding import pad_table
from streamrl.buffer.schema import batch_to_trajectories, trajectories_to_batch
from streamrl.learner.config import DistillMode, DistillSignal
from streamrl.learner.distill import DistillSums, distill_advantages, reverse_kl_tokens
from streamrl.learner.types import TrainBatch
from streamrl.rollout.teacher import teacher_row
from streamrl.rollout.types import Trajectory

NAN = float("nan")


def test_reverse_kl_is_behaviour_minus_teacher_on_scored_action_tokens():
    behavior = torch.tensor([[0.0, -1.0, -2.0, 0.0, -0.5]])
    teacher = torch.tensor([[NAN, -1.5, -1.0, 0.0, NAN]])  # the last action token unscored
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    k, scored = reverse_kl_tokens(behavior, teacher, mask)
    assert scored.tolist() == [[False, True, True, False, False]]
    assert k.tolist() == [[0.0, 0.5, -1.0, 0.0, 0.0]]


def test_kl_mode_is_minus_coef_k_and_mixed_adds_the_task_advantage():
    task = torch.tensor([[0.0, 2.0, 2.0, 2.0]])
    k = torch.tensor([[0.0, 0.5, -1.0, 0.0]])
    scored = torch.tensor([[False, True, True, False]])
    kl = distill_advantages(task, k, scored, DistillSignal(mode=DistillMode.KL, coef=2.0))
    mixed = distill_advantages(task, k, scored, DistillSignal(mode=DistillMode.MIXED, coef=0.5))
    assert kl.tolist() == [[0.0, -1.0, 2.0, 0.0]]  # −2·k; an unscored token gets nothing
    assert mixed.tolist() == [[0.0, 1.75, 2.5, 2.0]]  # task − 0.5·k; an unscored token keeps the task's


def test_metrics_are_the_kl_mean_the_teacher_share_and_the_coverage():
    task = torch.tensor([[0.0, 1.0, -3.0, 2.0]])
    k = torch.tensor([[0.0, 0.5, -1.0, 0.0]])
    scored = torch.tensor([[False, True, True, False]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    mixed = DistillSums.of(task, k, scored, mask, DistillSignal(mode=DistillMode.MIXED, coef=2.0)).metrics()
    assert mixed["distill/kl_mean"] == pytest.approx(-0.25)  # (0.5 − 1) / 2 scored tokens
    assert mixed["distill/teacher_share"] == pytest.approx(3.0 / (3.0 + 6.0))  # |2·0.5| + |2·−1| vs 1 + 3 + 2
    assert mixed["distill/coverage"] == pytest.approx(2 / 3)
    kl = DistillSums.of(task, k, scored, mask, DistillSignal(mode=DistillMode.KL)).metrics()
    assert kl["distill/teacher_share"] == 1.0


def _row(tid: str, prompt: list[int], sampled: list[list[int]], observation: list[list[int]]) -> Trajectory:
    """A two-turn row: sampled segments with deterministic log-probs, observation tokens between them."""
    ids, mask, logps, versions = [], [], [], []
    for turn, seg in enumerate(sampled):
        for tok in seg:
            ids.append(tok)
            mask.append(1)
            logps.append(-0.125 * (1 + (tok + len(ids)) % 7))
            versions.append(turn)  # two segments of two policy versions (a resume between them)
        for tok in observation[turn] if turn < len(observation) else []:
            ids.append(tok)
            mask.append(0)
            logps.append(0.0)
            versions.append(-1)
    return Trajectory(
        trajectory_id=tid,
        group_id="g",
        sample_index=0,
        agent_name="tool_agent",
        prompt_ids=prompt,
        response_ids=ids,
        response_mask=mask,
        behavior_logprobs=logps,
        policy_versions=versions,
    )


def _teacher_scores(row: Trajectory, shift: int = 0) -> list[float]:
    """What a teacher with the student's weights returns for the row's response tokens: the behaviour
    log-prob of each token (observation tokens get an arbitrary score), `shift` tokens late."""
    logps = [lp if m else -9.0 for lp, m in zip(row.behavior_logprobs, row.response_mask)]
    return logps if shift == 0 else [-3.0] * shift + logps[:-shift]


def _train_batch(rows: list[Trajectory]) -> TrainBatch:
    batch = trajectories_to_batch(rows)
    assert batch_to_trajectories(batch)[0].teacher_logprobs == rows[0].teacher_logprobs  # float32-exact values
    return TrainBatch.from_padded(pad_table(batch))


def test_teacher_logprobs_line_up_with_their_tokens_from_row_to_learner():
    """A teacher with the student's weights scores every sampled token as the student did: k is 0 at
    every action token, of both segments, in rows of different prompt lengths (the padding places each
    row's scores after its own prompt); an unscored row gets no distillation term."""
    a = _row("a", [1, 2, 3], [[10, 11, 12], [13, 14]], [[90, 91]])
    b = _row("b", [1, 2, 3, 4, 5, 6], [[20, 21], [22, 23, 24]], [[92]])
    unscored = _row("c", [1, 2], [[30, 31]], [])
    for row in (a, b):
        row.teacher_logprobs = teacher_row(_teacher_scores(row), row.response_mask)
    tb = _train_batch([a, b, unscored])
    assert tb.teacher_logprobs is not None
    k, scored = reverse_kl_tokens(tb.behavior_logprobs, tb.teacher_logprobs, tb.loss_mask)
    assert scored.sum(dim=1).tolist() == [5, 5, 0]
    assert torch.equal(k, torch.zeros_like(k))


def test_a_teacher_shifted_by_one_token_shows_as_a_kl():
    """The same check fails when the teacher's scores are one token late (scored from the last prompt
    token instead of the first response token): the alignment test above is able to fail."""
    row = _row("a", [1, 2, 3], [[10, 11, 12], [13, 14]], [[90, 91]])
    row.teacher_logprobs = teacher_row(_teacher_scores(row, shift=1), row.response_mask)
    tb = _train_batch([row])
    assert tb.teacher_logprobs is not None
    k, scored = reverse_kl_tokens(tb.behavior_logprobs, tb.teacher_logprobs, tb.loss_mask)
    assert int(scored.sum()) == 5 and bool((k[scored].abs() > 1e-3).any())


def test_teacher_row_keeps_sampled_tokens_and_refuses_a_miscount():
    assert teacher_row([-1.0, -2.0, -3.0], [1, 0, 1]) == [-1.0, 0.0, -3.0]
    with pytest.raises(ValueError, match="2 log-probs for 3 response tokens"):
        teacher_row([-1.0, -2.0], [1, 0, 1])
    with pytest.raises(ValueError, match="non-finite"):
        teacher_row([-math.inf, -2.0], [1, 1])


def test_the_buffer_refuses_a_teacher_row_of_another_length_or_with_observation_scores():
    row = _row("a", [1, 2, 3], [[10, 11]], [[90]])
    row.teacher_logprobs = [-1.0, -1.0]  # 3 response tokens
    with pytest.raises(ValueError, match="teacher_logprobs"):
        trajectories_to_batch([row])
    row.teacher_logprobs = [-1.0, -1.0, -1.0]  # the observation token carries a score
    with pytest.raises(ValueError, match="teacher_logprobs"):
        trajectories_to_batch([row])


def _distill_batch(teacher_minus_behaviour: float):
    """The learner tests' batch with teacher log-probs `teacher_minus_behaviour` above the behaviour's
    at every action token (NaN elsewhere, as the buffer pads them)."""
    import numpy as np

    from tests.learner.test_engine import _batch

    pb = _batch()
    teacher = np.where(pb.loss_mask == 1, pb.behavior_logprobs + teacher_minus_behaviour, np.nan)
    pb.teacher_logprobs = teacher.astype(np.float32)
    return pb


@pytest.mark.timeout(120)
def test_a_learner_step_moves_the_student_toward_the_teacher_and_not_without_a_gap():
    """Mode "kl" on the tiny model: a teacher that agrees with the behaviour policy gives every token
    advantage 0 (the weights do not move); a teacher that likes the sampled tokens more raises their
    log-probs."""
    from streamrl.learner.engine import TrainingEngine
    from tests.learner.test_engine import _cfg, _params

    engine = TrainingEngine(_cfg(distill=DistillSignal(mode=DistillMode.KL)))
    before = _params(engine)
    metrics = engine.train_step(_distill_batch(0.0))
    assert metrics["distill/kl_mean"] == 0.0 and metrics["distill/coverage"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in _params(engine).items())

    batch = _distill_batch(2.0)
    mask = torch.as_tensor(batch.loss_mask) != 0
    start = engine.compute_logprobs(batch)[mask].mean()
    metrics = engine.train_step(batch)
    assert metrics["distill/kl_mean"] == pytest.approx(-2.0) and metrics["distill/teacher_share"] == 1.0
    assert engine.compute_logprobs(batch)[mask].mean() > start
