"""The chaos suite's fault points: parsing, pass counting, and the delay action (a slow sink)."""

from __future__ import annotations

import asyncio
import time

import pytest

from streaming import faults


@pytest.fixture
def armed(monkeypatch, tmp_path):
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(faults.LEDGER_ENV, str(ledger))

    def arm(spec: str):
        monkeypatch.setattr(faults, "_armed", faults._parse(spec))
        monkeypatch.setattr(faults, "_hits", {})
        return ledger

    return arm


def test_parse_accepts_every_action_and_rejects_unknown_ones():
    armed = faults._parse("worker.sink=raise%3,buffer.append=delay2.5@4,engine.generate=kill_self")
    assert armed == {
        "worker.sink": ("raise", 3, True),
        "buffer.append": ("delay2.5", 4, False),
        "engine.generate": ("kill_self", 1, False),
    }
    for bad in ("worker.sink=explode@1", "worker.sink=delay@1", "no.such.point=raise@1", "worker.sink=delayx%2"):
        with pytest.raises(ValueError, match="bad STREAMRL_FAULTS entry"):
            faults._parse(bad)


def test_raise_fires_on_every_kth_pass_and_is_ledgered(armed):
    ledger = armed("worker.sink=raise%3")
    fired = []
    for i in range(1, 10):
        try:
            faults.hit("worker.sink")
        except faults.FaultInjected:
            fired.append(i)
    assert fired == [3, 6, 9]
    assert [line.split()[:3] for line in ledger.read_text().splitlines()] == [
        ["worker.sink", "raise", str(n)] for n in (3, 6, 9)
    ]
    faults.hit("admit.after_append")  # not armed: nothing happens, nothing counted
    assert "admit.after_append" not in faults._hits


def test_async_delay_sleeps_without_blocking_the_loop(armed):
    ledger = armed("buffer.append=delay0.4@2")

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        task = asyncio.create_task(ticker())
        t0 = time.monotonic()
        await faults.ahit("buffer.append")  # pass 1: no delay
        first = time.monotonic() - t0
        await faults.ahit("buffer.append")  # pass 2: the armed delay
        second = time.monotonic() - t0 - first
        task.cancel()
        return first, second, ticks

    first, second, ticks = asyncio.run(scenario())
    assert first < 0.2 and second >= 0.4
    assert ticks >= 5  # the loop kept running while the append was delayed
    assert len(ledger.read_text().splitlines()) == 1
