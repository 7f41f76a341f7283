"""bench/simulator.py's measuring side: the order of the real runs, the machine's speed probe beside
each, and the validation's record of both (real runs replaced by a fake `run_mode`)."""

from __future__ import annotations

import json

import pytest

import bench.simulator as bs
from bench.machine import cpu_pressure, settle, speed_probe


def test_the_runs_are_made_in_rounds():
    """Every workload's first run before any second run, and so on; within a round the workloads
    keep their order, and every run of every workload is made exactly once."""
    order = bs.schedule()
    expected = {(n, m, f) for n, w in bs.WORKLOADS.items() for m in w["steps"] for f in bs._repeats(w, m)}
    assert len(order) == len(expected) and {(n, m, f) for n, m, _, f in order} == expected
    seeds = [seed for _, _, seed, _ in order]
    assert seeds == sorted(seeds)
    rank = {name: i for i, name in enumerate(bs.WORKLOADS)}
    for r in set(seeds):
        names = [rank[n] for n, _, seed, _ in order if seed == r]
        assert names == sorted(names)
    assert [(n, f) for n, _, s, f in order if s == 0][0] == ("base", "async")  # calibration first


def test_the_speed_probe_times_a_fixed_product():
    """Milliseconds per 512^3 product: positive, and a product 8 times the work is slower."""
    small, large = speed_probe(size=128, calls=20, blocks=3), speed_probe(size=256, calls=20, blocks=3)
    assert 0 < small < large


def _psi(path, some: float) -> str:
    path.write_text(
        f"some avg10={some:.2f} avg60=1.00 avg300=1.00 total=5\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
    return str(path)


def test_cpu_pressure_reads_the_last_ten_seconds(tmp_path):
    assert cpu_pressure(_psi(tmp_path / "cpu", 67.7)) == pytest.approx(0.677)
    assert cpu_pressure(str(tmp_path / "missing")) is None
    (tmp_path / "garbled").write_text("some nonsense\n")
    assert cpu_pressure(str(tmp_path / "garbled")) is None


def test_settle_waits_for_quiet_cores_and_no_longer_than_its_timeout(tmp_path):
    """Quiet cores: no wait. Busy cores that stay busy: the timeout, then the probe goes ahead."""
    assert settle(path=_psi(tmp_path / "quiet", 3.0), poll_s=0.01) < 0.5
    waited = settle(path=_psi(tmp_path / "busy", 80.0), timeout_s=0.2, poll_s=0.01)
    assert 0.2 <= waited < 1.0


def test_each_run_is_probed_before_and_after_and_the_validation_reports_the_spread(tmp_path, monkeypatch):
    made, probes = [], iter(float(x) for x in range(1, 1000))
    monkeypatch.setattr(bs, "speed_probe", lambda: next(probes))
    monkeypatch.setattr(bs, "settle", lambda: 0.5)

    def fake_run(mode, root, steps, env, seed, name, extra):
        (root / name).mkdir(parents=True)
        made.append(f"{root.name}/{name}")

    monkeypatch.setattr(bs, "run_mode", fake_run)
    bs.measure(tmp_path, only=["tail/async", "split/async-seed1"])
    assert made == ["tail/async", "split/async-seed1"]  # the schedule's order, only those
    speed = {"before_ms": 1.0, "after_ms": 2.0, "settle_s": 0.5}
    assert json.loads((tmp_path / "tail/async" / bs.SPEED_FILE).read_text()) == speed
    assert bs._speed(tmp_path / "split/async-seed1") == {"before_ms": 3.0, "after_ms": 4.0, "settle_s": 0.5}
    assert bs._speed(tmp_path / "narrow/async") is None


def test_a_failed_run_leaves_no_speed_record(tmp_path, monkeypatch):
    """A run that raises stops the sitting; no probe file claims it was measured."""
    monkeypatch.setattr(bs, "speed_probe", lambda: 1.0)
    monkeypatch.setattr(bs, "settle", lambda: 0.0)

    def fake_run(mode, root, steps, env, seed, name, extra):
        (root / name).mkdir(parents=True)
        raise RuntimeError("the run failed")

    monkeypatch.setattr(bs, "run_mode", fake_run)
    with pytest.raises(RuntimeError):
        bs.measure(tmp_path, only=["tail/async"])
    assert bs._speed(tmp_path / "tail/async") is None
