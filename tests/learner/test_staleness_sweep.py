"""bench/staleness_sweep.py: the lag the learner sees is exactly the swept k, behaviour log-probs at
lag 0 are the learner's own, and the JSON holds every cell (a 2-cell, 3-step sweep in-process)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.staleness_sweep import Sampler, Settings, learner_config, main
from streamrl.learner.engine import TrainingEngine

STEPS = 3
LAGS = (0, 2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The sweep's setting (and `main --workers 1 --threads 1` sets it anyway); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sweep")
    main(
        [
            "--lags",
            *map(str, LAGS),
            "--corrections",
            "decoupled",
            "--seeds",
            "0",
            "--steps",
            str(STEPS),
            "--workers",
            "1",
            "--threads",
            "1",
            "--out",
            str(out / "sweep.json"),
            "--figure",
            str(out / "sweep.png"),
        ]
    )
    assert (out / "sweep.png").stat().st_size > 0
    return json.loads((out / "sweep.json").read_text())


@pytest.mark.timeout(60)
def test_json_has_every_cell_and_the_summary(sweep):
    assert {(c["lag"], c["correction"], c["seed"]) for c in sweep["cells"]} == {(k, "decoupled", 0) for k in LAGS}
    assert {(r["lag"], r["correction"]) for r in sweep["summary"]} == {(k, "decoupled") for k in LAGS}
    for cell in sweep["cells"]:
        assert all(len(column) == STEPS for column in cell["per_step"].values())
        assert cell["per_step"]["step"] == list(range(STEPS))
        assert np.isfinite(cell["final_reward"]) and cell["wall_s"] > 0
    assert sweep["commit"] and sweep["machine"]["cpu_count"]


@pytest.mark.timeout(60)
def test_every_trained_token_has_lag_k_after_warm_up(sweep):
    for cell in sweep["cells"]:
        k, cols = cell["lag"], cell["per_step"]
        expected = [min(step, k) for step in cols["step"]]  # warm-up: fewer than k versions exist yet
        assert cols["behaviour_version"] == [step - lag for step, lag in zip(cols["step"], expected)]
        assert cols["learner_lag_frac"] == [1.0] * STEPS  # the learner put every token at that lag
        assert cols["learner_lag"] == pytest.approx(expected)
        assert cols["learner_lag"][-1] == k  # STEPS > max(LAGS): the last step is past warm-up


@pytest.mark.timeout(60)
def test_behaviour_logprobs_at_lag_0_are_the_learners_own():
    settings = Settings(steps=2)
    engine = TrainingEngine(learner_config("decoupled", 0, settings, max_lag=2))
    fresh, stale = Sampler(engine, 0, settings, seed=0), Sampler(engine, 2, settings, seed=0)
    for step in range(2):
        batch, version = fresh.train_batch(step)
        assert version == engine.policy_version == step
        on = batch.loss_mask == 1
        learner = engine.compute_logprobs(batch).numpy()
        np.testing.assert_allclose(batch.behavior_logprobs[on], learner[on], atol=1e-4)
        engine.train_step(batch)
        fresh.record(engine)
        stale.record(engine)
    batch, version = stale.train_batch(2)  # lag 2: sampled by the initial weights, now 2 steps old
    assert version == 0 and set(np.unique(batch.policy_versions[batch.loss_mask == 1])) == {0}
    on = batch.loss_mask == 1
    assert np.abs(batch.behavior_logprobs[on] - engine.compute_logprobs(batch).numpy()[on]).max() > 1e-2
