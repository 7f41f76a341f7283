"""TrainingEngine on the tiny model: metrics, masking, micro-batching, checkpoints, HF export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from tests.learner.helpers import padded_batch

pytestmark = pytest.mark.timeout(120)


def _cfg(**kw) -> LearnerConfig:
    base = dict(model="tiny", device="cpu", lr=1e-3, micro_batch_tokens=64, seed=3)
    base.update(kw)
    return LearnerConfig(**base)


def _batch(versions=(0, 0, 0, 0), garbage: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs, behav = [], []
    for b in range(4):
        prompt = torch.randint(10, 400, (3 + b,), generator=g).tolist()
        resp = torch.randint(10, 400, (6,), generator=g).tolist()
        mask = [1, 1, 0, 0, 1, 1] if b % 2 else [1, 1, 1, 1, 1, 0]
        seqs.append((prompt, resp, mask))
        behav.append((-6.0 - torch.rand(6, generator=g)).tolist())
    pb = padded_batch(
        seqs,
        rewards=[1.0, 0.0, 0.5, 2.0],
        group_index=[0, 0, 1, 1],
        behavior_logprobs=behav,
        policy_versions=list(versions),
        turn_scores=[[], [0.5], [], [0.1, 0.2]],
    )
    if garbage:  # values at mask-0 positions must be ignored entirely
        off = pb.loss_mask == 0
        pb.behavior_logprobs[off] = -50.0
        pb.policy_versions[off] = 99
    return pb


def _params(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.policy.state_dict().items()}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_train_step_metrics_and_policy_version(algo):
    engine = TrainingEngine(_cfg(algo=algo, num_minibatches=2))
    assert engine.policy_version == 0
    engine.train_step(_batch())
    metrics = engine.train_step(_batch(versions=(0, 1, 0, 1), seed=1))  # lags 1 and 0
    assert engine.policy_version == 2 and metrics["learner/policy_version"] == 2.0
    for key in [
        "learner/loss",
        "learner/pg_loss",
        "learner/grad_norm",
        "learner/tokens_per_s",
        "is/ratio_mean",
        "is/ratio_p99",
        "is/clip_frac",
        "is/mask_frac",
        "is/mismatch_kl",
        "is/ratio_mean/lag_0",
        "is/ratio_mean/lag_1",
        "is/token_frac/lag_1",
    ]:
        assert key in metrics, key
    assert metrics["is/token_frac/lag_1"] == pytest.approx(10 / 18)  # rows 0, 2: 5 action tokens each
    if algo == "ppo":
        assert "learner/value_loss" in metrics
    assert all(v == v for v in metrics.values())  # no NaN


def test_future_policy_version_is_rejected():
    engine = TrainingEngine(_cfg())
    with pytest.raises(ValueError, match="policy_version"):
        engine.train_step(_batch(versions=(0, 1, 0, 0)))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_off_mask_values_do_not_touch_the_update(algo):
    a, b = TrainingEngine(_cfg(algo=algo)), TrainingEngine(_cfg(algo=algo))
    a.train_step(_batch())
    b.train_step(_batch(garbage=True))
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_micro_batch_packing_does_not_change_the_step():
    small = TrainingEngine(_cfg(micro_batch_tokens=12, algo="ppo", correction={"mode": "tis"}))
    large = TrainingEngine(_cfg(micro_batch_tokens=4096, algo="ppo", correction={"mode": "tis"}))
    batch = _batch(seed=5)
    assert torch.allclose(small.compute_logprobs(batch), large.compute_logprobs(batch), atol=1e-5)
    ms, ml = small.train_step(_batch()), large.train_step(_batch())
    assert ms["learner/loss"] == pytest.approx(ml["learner/loss"], rel=1e-4, abs=1e-6)
    # gradients of the (single) optimiser step are left in .grad: accumulation must match one pass
    gs = {k: p.grad for k, p in small.policy.named_parameters()}
    gl = {k: p.grad for k, p in large.policy.named_parameters()}
    assert all(torch.allclose(gs[k], gl[k], rtol=1e-4, atol=1e-7) for k in gs)


@pytest.mark.parametrize(("algo", "prox"), [("grpo", "recompute"), ("ppo", "loglinear")])
def test_checkpoint_restart_gives_identical_next_step(tmp_path, algo, prox):
    cfg = _cfg(algo=algo, num_minibatches=2, correction={"mode": "decoupled", "prox": prox})
    first = TrainingEngine(cfg)
    first.train_step(_batch())
    first.save_checkpoint(tmp_path / "ckpt")
    expected = first.train_step(_batch(versions=(1, 0, 1, 1), seed=2))

    resumed = TrainingEngine(cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.policy_version == 1
    got = resumed.train_step(_batch(versions=(1, 0, 1, 1), seed=2))
    assert got["learner/loss"] == expected["learner/loss"]
    assert got["learner/grad_norm"] == expected["learner/grad_norm"]
    pa, pb = _params(first), _params(resumed)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # the rename is atomic: no temporary folders are left beside the checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    first.save_checkpoint(tmp_path / "ckpt")  # overwriting an existing checkpoint works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_load_checkpoint_rejects_non_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a learner checkpoint"):
        TrainingEngine(_cfg()).load_checkpoint(tmp_path)


def test_save_hf_round_trips_and_sync_names_match(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = TrainingEngine(_cfg())
    engine.train_step(_batch())
    out = engine.save_hf(tmp_path / "hf")
    saved = load_file(out / "model.safetensors")
    synced = dict(engine.named_parameters_for_sync())
    assert set(synced) == set(saved)
    assert all(torch.equal(synced[k], saved[k]) for k in saved)
    live = dict(engine.policy.lm.named_parameters())
    assert all(synced[k].data_ptr() == live[k].data_ptr() for k in synced)  # no second copy
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).eos_token == engine.tokenizer.eos_token
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = reloaded(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    batch = padded_batch([([5, 6], [7, 8], [1, 1])], rewards=[0.0], group_index=[0])
    assert torch.allclose(engine.compute_logprobs(batch)[0, 1:], ref, atol=1e-5)


def test_kl_to_reference_and_config_checks():
    with pytest.raises(ValueError, match="use_reference"):
        _cfg(kl_coef=0.1)
    with pytest.raises(ValueError, match="lr_schedule_steps"):
        _cfg(lr_schedule="cosine")
    engine = TrainingEngine(_cfg(kl_coef=0.1, use_reference=True, kl_estimator="k3"))
    m1 = engine.train_step(_batch())
    m2 = engine.train_step(_batch(versions=(1, 1, 1, 1), seed=1))
    assert m1["learner/kl"] == pytest.approx(0.0, abs=1e-7) and m2["learner/kl"] > 0


def _finite_and_equal(before: dict[str, torch.Tensor], engine: TrainingEngine) -> bool:
    after = _params(engine)
    return all(torch.isfinite(after[k]).all() and torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_nan_rewards_skip_the_update_and_leave_the_weights_finite(algo):
    engine = TrainingEngine(_cfg(algo=algo, num_minibatches=2))
    before, optimizer_state = _params(engine), engine.optimizer.state_dict()
    batch = _batch()
    batch.rewards[:] = np.nan  # one NaN poisons every advantage of its group; here all of them
    result = engine.step(batch)
    assert result.skipped_nonfinite and result.metrics["learner/num_nonfinite_steps"] == 2.0
    assert _finite_and_equal(before, engine)
    assert engine.num_optimizer_steps == 0 and engine.scheduler.last_epoch == 0
    assert engine.optimizer.state_dict()["state"] == optimizer_state["state"] == {}  # AdamW moments untouched
    assert all(p.grad is None for p in engine.policy.parameters())
    assert result.policy_version == engine.policy_version == 1  # the label still counts learner steps
    following = engine.step(_batch(versions=(1, 1, 1, 1)))  # a finite batch trains again
    assert not following.skipped_nonfinite and following.metrics["learner/num_nonfinite_steps"] == 0.0
    assert not _finite_and_equal(before, engine) and engine.num_optimizer_steps == 2


def test_a_loss_that_turns_nonfinite_in_one_minibatch_skips_only_that_update(monkeypatch):
    from streamrl.learner import engine as engine_module

    engine = TrainingEngine(_cfg(num_minibatches=2, shuffle_minibatches=False))
    real = engine_module.ppo_policy_loss
    calls = []

    def overflowing(*args, **kwargs):  # the second minibatch's loss overflows to inf
        calls.append(1)
        pg, clipped, dual = real(*args, **kwargs)
        return (pg * float("inf") if len(calls) == 2 else pg), clipped, dual

    monkeypatch.setattr(engine_module, "ppo_policy_loss", overflowing)
    result = engine.step(_batch())
    assert result.metrics["learner/num_nonfinite_steps"] == 1.0 and not result.skipped_nonfinite
    assert engine.num_optimizer_steps == 1 and engine.scheduler.last_epoch == 1
    assert all(torch.isfinite(p).all() for p in engine.policy.parameters())


def _stale_step(cfg: LearnerConfig) -> TrainingEngine:
    """One step at learner version 2 on tokens of versions 0, 1 and 2 (lags 2, 1, 0)."""
    engine = TrainingEngine(cfg)
    engine.policy_version = 2
    engine.train_step(_batch(versions=(0, 1, 2, 0), seed=7))
    return engine


@pytest.mark.parametrize(("ppo_epochs", "mode"), [(1, "decoupled"), (2, "decoupled"), (1, "tis"), (1, "masked")])
def test_loglinear_is_exact_while_the_weights_are_the_step_start(ppo_epochs, mode):
    """Before the step's first update the training forward is π_prox, so `loglinear` must train
    exactly like `recompute` (the old rule interpolated towards π_behav by 1/(lag + 1) even there,
    clipping stale tokens whose probability had already risen); with one mini-batch every later
    epoch reuses those exact values."""
    kw = dict(ppo_epochs=ppo_epochs, clip_low=0.05, clip_high=0.05)
    exact = _stale_step(_cfg(**kw, correction={"mode": mode, "prox": "recompute"}))
    approx = _stale_step(_cfg(**kw, correction={"mode": mode, "prox": "loglinear"}))
    pe, pa = _params(exact), _params(approx)
    assert all(torch.allclose(pe[k], pa[k], rtol=1e-5, atol=1e-7) for k in pe)


def test_loglinear_interpolates_only_rows_first_reached_after_an_update():
    """Two mini-batches: the second one's forward sees the first update, so its π_prox is the
    log-linear approximation and the step differs from `recompute`."""
    kw = dict(num_minibatches=2, shuffle_minibatches=False, clip_low=0.05, clip_high=0.05)
    exact = _stale_step(_cfg(**kw, correction={"mode": "decoupled", "prox": "recompute"}))
    approx = _stale_step(_cfg(**kw, correction={"mode": "decoupled", "prox": "loglinear"}))
    pe, pa = _params(exact), _params(approx)
    assert not all(torch.allclose(pe[k], pa[k], rtol=1e-5, atol=1e-7) for k in pe)


@pytest.mark.parametrize(
    ("num_minibatches", "mode", "extra_pass"), [(1, "decoupled", False), (2, "decoupled", True), (1, "m2po", True)]
)
def test_recompute_runs_its_pass_only_when_the_training_forward_cannot_give_prox(
    monkeypatch, num_minibatches, mode, extra_pass
):
    engine = TrainingEngine(_cfg(num_minibatches=num_minibatches, correction={"mode": mode, "prox": "recompute"}))
    batch = engine.to_train_batch(_batch(seed=3))
    num_micro = sum(len(engine.micro_batches(batch, rows)) for rows in torch.arange(4).chunk(num_minibatches))
    calls = []
    forward = engine.forward
    monkeypatch.setattr(engine, "forward", lambda model, mb, **kw: calls.append(mb) or forward(model, mb, **kw))
    engine.train_step(batch)
    start_pass = len(engine.micro_batches(batch, torch.arange(4))) if extra_pass else 0
    assert len(calls) == num_micro + start_pass
