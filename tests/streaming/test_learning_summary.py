"""The learning benchmark's arithmetic: time to sync's final reward, the speed-up, per seed."""

from __future__ import annotations

import pytest

from bench.learning import seed_speedups, summarize, time_to_reach


def _run(mode: str, seed: int, points: list[tuple[float, float]]) -> dict:
    scores = lambda r: {f"p{i}": float(i < round(r * 10)) for i in range(10)}  # noqa: E731
    curve = [
        {"served_step": 2 * i, "elapsed_s": t, "reward": r, "scores": scores(r)} for i, (t, r) in enumerate(points)
    ]
    return {"mode": mode, "seed": seed, "exit_code": 0, "wall_s": points[-1][0], "curve": curve, "gradient_share": None}


def test_time_to_reach_reads_between_measured_points():
    assert time_to_reach([(0.0, 0.0), (100.0, 0.4), (200.0, 0.6)], 0.5) == pytest.approx(150.0)
    assert time_to_reach([(0.0, 0.0), (100.0, 0.2)], 0.5) is None


def test_speedup_is_syncs_time_over_asyncs_time_to_syncs_final_reward():
    runs = [
        _run("sync", 0, [(0, 0.0), (400, 0.2), (800, 0.4)]),
        _run("async", 0, [(0, 0.0), (100, 0.2), (200, 0.6)]),  # reaches 0.4 at 150 s
        _run("sync", 1, [(0, 0.0), (400, 0.2), (800, 0.6)]),
        _run("async", 1, [(0, 0.0), (100, 0.2), (200, 0.3)]),  # never reaches 0.6
    ]
    assert seed_speedups(runs) == {"0": pytest.approx(800 / 150), "1": None}
    summary = summarize(runs)["async_vs_sync"]
    # seed means: sync ends at 0.5 after 800 s; async's mean curve 0, 0.2, 0.45 never reaches it
    assert summary["sync_final_reward"] == pytest.approx(0.5) and summary["speedup"] is None
    assert summary["target_met"] is False


def test_a_regime_map_cell_reads_the_speedup_and_its_seed_interval(tmp_path):
    import json

    from bench.regime_map import build, cell

    runs = [
        _run("sync", 0, [(0, 0.0), (400, 0.2), (800, 0.4)]),
        _run("async", 0, [(0, 0.0), (100, 0.2), (200, 0.6)]),
        _run("sync", 1, [(0, 0.0), (400, 0.2), (800, 0.4)]),
        _run("async", 1, [(0, 0.0), (100, 0.4), (200, 0.6)]),
    ]
    path = tmp_path / "learning.json"
    path.write_text(json.dumps({"summary": summarize(runs), "runs": runs, "commit": "x"}))
    got = cell(path)
    assert got["speedup"] == pytest.approx(800 / (100 + 100 / 3))  # the mean curve 0, .3, .6 reaches .4 at 133 s
    assert got["seed_interval"] == [pytest.approx(800 / 150), pytest.approx(800 / 100)]
    assert got["seeds_not_reached"] == 0 and got["num_seeds"] == 2
    grid = build({("none", "shared"): str(path)})
    assert sum(c["measured"] for c in grid["cells"]) == 1 and len(grid["cells"]) == 9


def test_time_to_the_same_reward_reads_both_curves_on_their_way_up():
    """Sync first crosses async's lower final reward 0.4 at 200 s, async at 150 s: ratio 4/3, although
    sync's whole run (800 s) is what `speedup` compares against."""
    runs = [
        _run("sync", 0, [(0, 0.0), (400, 0.8), (800, 0.5)]),  # up to 0.8, then down to 0.5
        _run("async", 0, [(0, 0.0), (100, 0.2), (200, 0.6), (300, 0.4)]),
    ]
    same = summarize(runs)["async_vs_sync"]["same_reward"]
    assert same["reward"] == pytest.approx(0.4)
    assert same["sync_time_s"] == pytest.approx(200.0) and same["async_time_s"] == pytest.approx(150.0)
    assert same["ratio"] == pytest.approx(200 / 150)
    assert summarize(runs)["async_vs_sync"]["same_reward_per_seed"]["0"]["ratio"] == pytest.approx(200 / 150)


def test_runs_merged_from_an_earlier_result_join_the_curves_and_not_the_paired_test(tmp_path):
    """A seed from an earlier JSON (its points without per-prompt scores) counts in the mean curves
    and the speed-ups; the rise test pools only the runs that carry scores."""
    import json

    from bench.learning import merged_runs

    earlier = _run("async", 0, [(0, 0.0), (100, 0.5)])
    for point in earlier["curve"]:
        del point["scores"]
    path = tmp_path / "learning.json"
    path.write_text(json.dumps({"commit": "abc", "command": "python -m bench.learning", "runs": [earlier]}))
    runs = [_run("async", 1, [(0, 0.0), (100, 0.3)])]
    runs += merged_runs(path, {("async", 1)})
    assert [r["seed"] for r in runs] == [1, 0] and runs[1]["merged_from"]["commit"] == "abc"
    assert merged_runs(path, {("async", 0)}) == []
    summary = summarize(runs)["async"]
    assert summary["num_seeds"] == 2 and summary["tested_seeds"] == [1]
    assert summary["after"] == pytest.approx(0.3)  # the test's pairs: seed 1 only
    assert summary["curve_wall"][-1][1] == pytest.approx(0.4)  # the mean curve: both seeds
