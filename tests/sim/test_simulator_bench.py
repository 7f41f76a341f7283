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


def test_the_speed_probe_is_the_median_block_and_leaves_the_thread_count_alone(monkeypatch):
    """Five timed blocks of 20 products at 3, 1, 2, 9 and 4 ms each (a fake clock): the probe is the
    median, 3 ms (not the mean, 3.8, which the one disturbed block pulls). Torch's thread count is
    put back after."""
    import time

    import torch

    def clock():
        t = 0.0
        for ms in (3, 1, 2, 9, 4):
            yield t
            t += ms * 20 / 1000
            yield t

    ticks = clock()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    threads = torch.get_num_threads()
    assert speed_probe(size=64, calls=20, blocks=5) == pytest.approx(3.0)
    assert torch.get_num_threads() == threads


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


@pytest.mark.parametrize(
    ("busy_polls", "waited"),
    [
        (0, 0.0),  # quiet already: no wait
        (3, 6.0),  # quiet after three 2-second polls
        (100, 60.0),  # never quiet: the timeout, then the probe goes ahead
    ],
)
def test_settle_waits_for_quiet_cores_and_no_longer_than_its_timeout(tmp_path, monkeypatch, busy_polls, waited):
    """A fake clock that each sleep advances; the pressure file reads busy for `busy_polls` polls."""
    import time

    now, psi = [0.0], tmp_path / "cpu"
    _psi(psi, 80.0 if busy_polls else 3.0)

    def sleep(s):
        now[0] += s
        if now[0] >= 2.0 * busy_polls:
            _psi(psi, 3.0)

    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", sleep)
    assert settle(path=str(psi)) == pytest.approx(waited)


def test_settle_without_pressure_information_waits_a_fixed_time(tmp_path, monkeypatch):
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    settle(path=str(tmp_path / "missing"), poll_s=2.0)
    assert slept == [10.0]


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
    """A run that raises stops the validation; no probe file claims it was measured."""
    monkeypatch.setattr(bs, "speed_probe", lambda: 1.0)
    monkeypatch.setattr(bs, "settle", lambda: 0.0)

    def fake_run(mode, root, steps, env, seed, name, extra):
        (root / name).mkdir(parents=True)
        raise RuntimeError("the run failed")

    monkeypatch.setattr(bs, "run_mode", fake_run)
    with pytest.raises(RuntimeError):
        bs.measure(tmp_path, only=["tail/async"])
    assert bs._speed(tmp_path / "tail/async") is None
