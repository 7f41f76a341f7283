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
    assert sum(c["measured"] for c in grid["cells"]) == 1 and len(grid["cells"]) == 6
