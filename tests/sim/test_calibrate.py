"""Calibration from a run directory: a small synthetic run (a real durable buffer, metrics lines and
timeline spans written from known costs) and the fits must give those costs back."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.sim.calibrate import calibrate, learner_idle_share, sim_config_of
from streamrl.sim.costs import ToolLatency
from streamrl.sim.observe import from_metrics
from streamrl.sim.validate import compare, measured
from tests.buffer.helpers import make_traj

CLOCK0 = 1_700_000_000.0  # unix time of the pipeline's zero
REQUEST_S, TOKEN_S = 0.3, 0.02  # per turn, per token (one trajectory at a time: batch 1)
STEP_BASE_S, STEP_TOKEN_S = 1.5, 0.001  # learner
TURNS = [1, 2, 3, 1, 2, 3, 2, 2, 3, 3, 1, 1, 2, 1, 3, 3]  # 16 trajectories: 4 steps of 2 groups of 2
TOOL = ToolLatency(0.5, 5.0)  # the run's latency environment (env.yaml below)
AGENT_S = 0.05  # per turn, outside generation and the tool's wait


def _trajectory(i: int, start: float) -> tuple:
    turns = [10 + 5 * ((i + k) % 3) for k in range(TURNS[i])]  # tokens of each assistant turn
    mask: list[int] = []
    for k, n in enumerate(turns):
        mask += [0] * 4 * (k > 0) + [1] * n  # 4 observation tokens before every later turn
    gen = REQUEST_S * len(turns) + TOKEN_S * sum(turns)
    t = make_traj(f"g{i // 2}", i % 2, num_response=len(mask), num_prompt=7)
    t = dataclasses.replace(
        t,
        response_mask=mask,
        policy_versions=[0 if m else -1 for m in mask],
        behavior_logprobs=[-0.5 if m else 0.0 for m in mask],
        generate_s=gen,
        created_at=CLOCK0 + start,
        finished_at=CLOCK0 + start + gen + len(turns) * (TOOL.mean_s + AGENT_S),
    )
    return t, gen + len(turns) * (TOOL.mean_s + AGENT_S)


def write_run(root, mode: str = "sync", *, learner_slowdown: float = 1.0, num_engines: int = 1):
    """A run of 4 steps of two groups of 2 (batch 4), every trajectory alone on the engine; each
    learner step takes `learner_slowdown` times its cost (the engines' share of the cores)."""
    root.mkdir(parents=True, exist_ok=True)
    run = root / "run"
    env = root / "env.yaml"
    env.write_text(
        "interaction:\n  - name: latency_env\n    class_name: x\n    config:\n"
        "      latency_s: 0.5\n      distribution: lognormal\n      p99_over_median: 10.0\n"
    )
    buf = ReplayBuffer(BufferConfig(root_dir=str(run / "buffer"), batch_size=4, group_size=2, max_staleness=2))
    t, lines, spans, idle, busy = 0.0, [], [], 0.0, 0.0
    for step in (1, 2, 3, 4):
        tokens = 0
        for i in range(4 * (step - 1), 4 * step):
            traj, dur = _trajectory(i, t)
            buf.append([traj])
            tokens += len(traj.prompt_ids) + len(traj.response_ids)
            t, idle, busy = t + dur, idle + dur, busy + traj.generate_s
        assert buf.sample(served_version=step - 1, learner_step=step) is not None
        step_s = (STEP_BASE_S + STEP_TOKEN_S * tokens) * learner_slowdown
        spans.append({"kind": "train", "who": "learner", "start": t, "end": t + step_s})
        t += step_s + 0.2 + 0.1  # train, sync, per-step overhead
        lines.append(_line(step, t, step_s, idle, busy))
    buf.close()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in spans))
    config = {
        "trainer": {"mode": mode, "sync_every": 1, "sync_generation_groups": 0},
        "rollout": {
            "num_engines": num_engines,
            "num_workers": 1,
            "max_concurrent_per_worker": 8,
            "agent": {"interaction_config": str(env)},
        },
        "buffer": {"batch_size": 4, "group_size": 2, "max_staleness": 2, "root_dir": None},
    }
    RunDir(run).write_info(RunInfo(run_name="run", model_path="tiny", mode=mode, config=config, started_at=CLOCK0))
    return run


def _line(step: int, t: float, step_s: float, idle: float, busy: float) -> dict:
    return {
        "time": CLOCK0 + t,
        "elapsed_s": t,
        "learner_step": step,
        "policy_version": step,
        "time/elapsed_s": t,
        "learner/step_s": step_s,
        "learner/idle_ratio": idle / t,
        "sync/total_s": 0.2,
        "sync/paused_s": 0.05,
        "sync/bytes": 1000.0,
        "engine/busy_s": busy,
        "engine/uptime_s": t + 10.0,
        "staleness/lag_mean": 0.0,
        "staleness/lag_frac/trajectories/0": 1.0,
        "staleness/lag_frac/trajectories/over": 0.0,
    }


def test_observations_read_the_run(tmp_path):
    obs = from_metrics(write_run(tmp_path))
    assert obs.mode == "sync" and list(obs.step) == [1, 2, 3, 4]
    assert [len(t) for t in obs.turn_tokens] == TURNS
    assert obs.observation_tokens[obs.observation_tokens > 0].tolist() == [4.0] * sum(n > 1 for n in TURNS)
    assert obs.created_s[0] == pytest.approx(0.0) and len(obs.train_spans) == 4
    assert sim_config_of(obs).buffer.batch_size == 4 and sim_config_of(obs).max_concurrent == 8


def test_calibration_gives_the_known_costs_back(tmp_path):
    costs = calibrate([write_run(tmp_path)])
    assert costs.engine.request_s == pytest.approx(REQUEST_S, rel=1e-3)
    assert costs.engine.base_s + costs.engine.per_seq_s == pytest.approx(TOKEN_S, rel=1e-3)  # batch 1 only
    assert costs.learner.base_s == pytest.approx(STEP_BASE_S, rel=1e-3)
    assert costs.learner.per_token_s == pytest.approx(STEP_TOKEN_S, rel=1e-3)
    assert costs.learner.step_overhead_s == pytest.approx(0.1, abs=1e-6)
    assert (costs.sync.base_s, costs.sync.pause_base_s) == (0.2, 0.05)
    assert costs.tool.median_s == 0.5 and costs.tool.p99_s == pytest.approx(5.0)
    assert costs.shape.turn_probs == pytest.approx((5 / 16, 5 / 16, 6 / 16))
    assert costs.shape.prompt_tokens == 7.0 and costs.shape.observation_tokens == 4.0


@pytest.mark.parametrize("num_engines", [1, 2])
def test_the_learner_slow_down_is_fitted_at_the_load_it_trained_beside(tmp_path, num_engines):
    """Async steps 1.4 times the sync run's, beside one engine or two taking turns on the same cores
    (one load): the fitted learner gives 1.4 back at the load of the batch the async run decoded."""
    sync = write_run(tmp_path / "sync", "sync")
    busy = write_run(tmp_path / "async", "async", learner_slowdown=1.4, num_engines=num_engines)
    costs = calibrate([sync, busy])
    load = costs.engine.load(costs.source["engine_fit"]["mean_batch"])
    assert 0 < load <= 1
    assert costs.learner.step_s(1000, load) == pytest.approx((STEP_BASE_S + STEP_TOKEN_S * 1000) * 1.4, rel=1e-3)


def test_the_agent_loops_own_time_per_turn(tmp_path):
    """Each trajectory lives its generation seconds, its turns' tool latency and AGENT_S per turn."""
    costs = calibrate([write_run(tmp_path)])
    assert costs.agent.turn_s == pytest.approx(AGENT_S, rel=1e-3)


def test_measured_numbers_of_a_run(tmp_path):
    obs = from_metrics(write_run(tmp_path))
    m = measured(obs)
    span = obs.elapsed_s[-1] - obs.elapsed_s[0]
    assert m["trained_samples_per_hour"] == pytest.approx(3 * 4 / span * 3600)
    rows = compare(m, {**m, "lag_mean": 0.0, "engine_busy_fraction": 1.2 * m["engine_busy_fraction"]})
    assert rows["trained_samples_per_hour"]["within"] and rows["lag_hist"]["within"]
    assert not rows["engine_busy_fraction"]["within"]


def test_repeated_runs_are_compared_by_their_mean():
    from streamrl.sim.validate import mean_measured

    a = {"trained_samples_per_hour": 100.0, "engine_busy_fraction": 0.5, "learner_idle_fraction": 0.2}
    b = {"trained_samples_per_hour": 200.0, "engine_busy_fraction": 0.7, "learner_idle_fraction": 0.4}
    m = mean_measured(
        [
            {**a, "lag_mean": 1.0, "lag_hist": {"0": 0.6, "1": 0.4}},
            {**b, "lag_mean": 2.0, "lag_hist": {"1": 0.5, "over": 0.5}},
        ]
    )
    assert m["trained_samples_per_hour"] == 150.0 and m["engine_busy_fraction"] == pytest.approx(0.6)
    assert m["learner_idle_fraction"] == pytest.approx(0.3) and m["lag_mean"] == 1.5
    assert m["lag_hist"] == pytest.approx({"0": 0.3, "1": 0.45, "over": 0.25})  # a missing bin counts 0


def _numbers(tput: float) -> dict:
    return {
        "trained_samples_per_hour": tput,
        "engine_busy_fraction": 0.5,
        "learner_idle_fraction": 0.2,
        "lag_mean": 1.0,
    }


@pytest.mark.parametrize(
    ("repeats", "within_noise"),
    [
        ([1000.0, 1000.0, 1000.0], False),  # repeats that agree: a 12 % miss is the model's
        ([800.0, 1000.0, 1200.0], True),  # repeats 200 apart: the same miss is within their noise
    ],
)
def test_a_miss_is_weighed_against_the_repeats_own_spread(repeats, within_noise):
    """The measured mean of 3 runs is 1000 and the prediction 1120 (out of the 10 % bound either
    way). The simulated chance spread of one run is 10, of the mean of 20 seeds 10/sqrt(20). With
    repeats 200 apart (sd 200), the noise is sqrt(200^2/3 + 10^2/20) = 115.6: a 120 miss is within
    twice it. With repeats that agree, the simulated spread is the floor: noise sqrt(100/3 + 5)."""
    from streamrl.sim.validate import mean_measured, spread_measured

    runs = [{**_numbers(t), "lag_hist": {"0": 1.0}} for t in repeats]
    sd = spread_measured(runs)
    assert sd["trained_samples_per_hour"] == pytest.approx(np.std(repeats, ddof=1))
    pred = {**_numbers(1120.0), "lag_hist": {"0": 1.0}, "seeds": 20}
    pred["sd"] = {**_numbers(10.0), "lag_hist_max_bin": 0.0}
    rows = compare(mean_measured(runs), pred, sd, len(runs))
    row = rows["trained_samples_per_hour"]
    assert not row["within"] and row["within_noise"] is within_noise
    one_run = max(np.std(repeats, ddof=1), 10.0)
    assert row["noise"] == pytest.approx(np.sqrt(one_run**2 / 3 + 10.0**2 / 20))


def test_a_single_run_is_weighed_against_the_simulated_chance_spread():
    """One measured run: its noise is one simulated run's spread (and the simulated mean's)."""
    pred = {**_numbers(1120.0), "lag_hist": {"0": 1.0}, "seeds": 20}
    pred["sd"] = {**_numbers(70.0), "lag_hist_max_bin": 0.0}
    row = compare({**_numbers(1000.0), "lag_hist": {"0": 1.0}}, pred)["trained_samples_per_hour"]
    assert row["noise"] == pytest.approx(np.sqrt(70.0**2 + 70.0**2 / 20))
    assert row["within_noise"] and "measured_sd" not in row  # 120 <= 2 * 71.7
    pred["sd"]["trained_samples_per_hour"] = 50.0  # 120 > 2 * 51.2
    assert not compare({**_numbers(1000.0), "lag_hist": {"0": 1.0}}, pred)["trained_samples_per_hour"]["within_noise"]


@pytest.mark.parametrize("pair_slowdown", [2.0, 1.3])
def test_a_second_engine_process_costs_the_learner_what_the_pair_run_showed(tmp_path, pair_slowdown):
    """A sync run, a one-engine async run at 1.4 and a two-engine async run at `pair_slowdown`: the
    one-engine run alone gives `shared_frac` (1.4 back at its load), and the second process's cost is
    what the pair run shows beyond its own engines' load, at the share of time both engines decode.
    A pair run no slower than its load accounts for gives no negative cost. The engine's cost curve
    comes from the one-engine runs alone."""
    from streamrl.sim.calibrate import expected_extra_processes, run_mean_batch

    sync = write_run(tmp_path / "sync", "sync")
    one = write_run(tmp_path / "one", "async", learner_slowdown=1.4)
    pair = write_run(tmp_path / "pair", "async", learner_slowdown=pair_slowdown, num_engines=2)
    costs = calibrate([sync, one, pair])
    fitted = costs.learner
    base_load = costs.engine.load(costs.source["engine_fit"]["mean_batch"])
    assert fitted.slowdown(base_load) == pytest.approx(1.4, rel=1e-3)
    obs = from_metrics(pair)
    load, both = costs.engine.load(run_mean_batch(obs)), expected_extra_processes(obs)
    assert 0 < both < 1  # the engines are busy part of the time, and both together less often
    if pair_slowdown == 2.0:
        assert fitted.process_frac > 0
        assert fitted.slowdown(load, 0) + fitted.process_frac * both == pytest.approx(2.0, rel=1e-3)
    else:
        assert fitted.process_frac == 0
    assert costs.source["learner_fit"]["process_frac_from"] == 1
    assert costs.engine == calibrate([sync, one]).engine


def test_the_expected_extra_processes_of_independent_engines():
    """E[max(active - 1, 0)] for n engines each busy b of the time: b**2 for two, 0 when idle, n - 1
    when always busy."""
    from streamrl.sim.calibrate import expected_extra_processes

    class Run:
        def __init__(self, n: int, busy: float) -> None:
            self.num_engines = n
            self.engine_busy_s, self.engine_uptime_s = [0.0, busy * 100], [0.0, 100.0]

    assert expected_extra_processes(Run(2, 0.9)) == pytest.approx(0.81)
    assert expected_extra_processes(Run(3, 0.0)) == pytest.approx(0.0)
    assert expected_extra_processes(Run(3, 1.0)) == pytest.approx(2.0)
    assert expected_extra_processes(Run(1, 0.7)) == pytest.approx(0.0)


def test_streamrl_calibrate_fits_the_runs_and_predicts_each_of_them(tmp_path, capsys):
    """`streamrl calibrate`: the costs, then every run measured against predicted with a verdict per
    number, and the same as JSON with each number's noise."""
    from streamrl.streaming.cli import main

    runs = [write_run(tmp_path / "sync", "sync"), write_run(tmp_path / "async", "async", learner_slowdown=1.4)]
    out = tmp_path / "calibration.json"
    assert main(["calibrate", *map(str, runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["costs"]["learner"]["base_s"] == pytest.approx(STEP_BASE_S, rel=1e-3)
    assert set(report["runs"]) == set(map(str, runs))
    for rows in report["runs"].values():
        for key in ("trained_samples_per_hour", "engine_busy_fraction", "learner_idle_fraction", "lag_mean"):
            row = rows[key]
            assert row["noise"] >= 0 and row["within_noise"] == (
                abs(row["predicted"] - row["measured"]) <= 2 * row["noise"]
            )
            verdict = "ok" if row["within"] else ("OFF (within the noise)" if row["within_noise"] else "OFF")
            assert f"{100 * row['rel_error']:+.1f} %) {verdict}\n" in printed


def test_the_batch_fetch_comes_from_learner_bound_runs_only(tmp_path):
    """Found in review: fitted on a run whose learner waits for data at every step (narrow: idle 93 %),
    the batch fetch (`sample_s`, the 10th-percentile wait) came out 8 s, and the simulated lag of that
    run rose from 0.23 to 0.9. The synthetic async run's learner waits for every batch too: it says
    nothing of the fetch, which is then 0, not the waits. A learner-bound run (its waits cut to the
    fetch) gives it back."""
    waiting = write_run(tmp_path / "waiting", "async")
    obs = from_metrics(waiting)
    assert learner_idle_share(obs) > 0.5 and np.percentile(np.diff(obs.idle_s), 10) > 1.0
    assert calibrate([write_run(tmp_path / "sync", "sync"), waiting]).learner.sample_s == 0.0
    bound = write_run(tmp_path / "bound", "async")
    lines = [json.loads(x) for x in (bound / "metrics.jsonl").read_text().splitlines()]
    for k, line in enumerate(lines):  # 0.03 s of waiting per step: the batch was always ready
        line["learner/idle_ratio"] = 0.03 * (k + 1) / line["time/elapsed_s"]
    (bound / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert learner_idle_share(from_metrics(bound)) < 0.5
    fitted = calibrate([write_run(tmp_path / "sync2", "sync"), bound]).learner.sample_s
    assert fitted == pytest.approx(0.03, rel=1e-6)
