"""`streamrl plan`: the recommended split is the best one simulated, and the command prints it."""

from __future__ import annotations

import json

import pytest

from streamrl.sim.costs import ToolLatency
from streamrl.sim.plan import plan, render
from streamrl.sim.published import MODELS, engine_cost
from streamrl.streaming.cli import main


def test_plan_recommends_the_best_split_it_simulated():
    result = plan("7B", 32, ToolLatency(2.0, 60.0, 120.0), steps=6, shares=(0.25, 0.5, 0.75), batch=64)
    best = result["recommended"]
    assert best["samples_per_hour"] == max(r["samples_per_hour"] for r in result["tried"])
    assert best["engine_gpus"] + best["learner_gpus"] == 32
    assert result["async_over_sync"] > 1.0  # a long tool tail: async must beat a sync round at the same split
    text = render(result)
    assert f"recommended split: {best['engine_gpus']} engine GPUs : {best['learner_gpus']} learner GPUs" in text


def test_streamrl_plan_prints_the_split_busy_lag_and_throughput(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "7B",
                "--gpus",
                "16",
                "--tool-latency",
                "p50=2s,p99=60s",
                "--steps",
                "5",
                "--batch",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for needle in ("recommended split:", "expected engine busy", "mean lag", "trained samples/h", "async/sync"):
        assert needle in out
    assert main(["plan", "--model", "7B", "--gpus", "16", "--steps", "4", "--batch", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == 16


def test_plan_refuses_what_it_cannot_simulate(capsys):
    assert main(["plan", "--model", "235B", "--gpus", "8"]) == 2  # one engine takes all 8 GPUs
    assert "give at least 16" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown model"):
        plan("13B", 64, ToolLatency(1.0, 2.0))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_published_engines_reach_their_published_throughput(name):
    model = MODELS[name]
    engine = engine_cost(model, mean_ctx=1024)
    batch = min(engine.max_batch, 256)
    assert engine.tokens_per_s(batch, 1024) == pytest.approx(model.engine_tokens_per_s, rel=0.05)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "latency", ["p50=nan,p99=60s", "p50=2s,p99=inf", "p50=2s,p99=60s,max=nan", "p50=2s,p99=60s,max=-1"]
)
def test_plan_refuses_latencies_that_are_not_finite_times(latency, capsys):
    """NaN passes every comparison and made the simulation spin for minutes: a clear error instead."""
    with pytest.raises(ValueError, match="tool latency"):
        ToolLatency.parse(latency)
    assert main(["plan", "--model", "7B", "--gpus", "16", "--steps", "2", "--tool-latency", latency]) == 2
    assert "tool latency" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--sync-every", "0"], ["--batch", "0"], ["--max-staleness", "-1"]])
def test_plan_refuses_counts_it_cannot_simulate(flag, capsys):
    assert main(["plan", "--model", "7B", "--gpus", "16", *flag]) == 2
    assert "need steps >= 1" in capsys.readouterr().err
