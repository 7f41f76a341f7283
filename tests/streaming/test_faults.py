"""The chaos suite's fault points: parsing, pass counting, and the delay action (a slow sink)."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrl.core import faults


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


def test_kill_job_from_a_process_in_its_own_group_kills_the_drivers_group(tmp_path):
    """Ray starts every worker in a process group of its own, so a `kill_job` inside an actor must
    reach the driver's group (forwarded as STREAMRL_FAULT_JOB_PGID), not only the actor's."""
    import os
    import signal
    import subprocess
    import sys

    actor = (
        "import os; os.setpgid(0, 0); from streamrl.core import faults; "  # like a Ray worker: a group of its own
        "faults.hit('tool.after_run'); open(os.environ['OUT'] + '.survived', 'w')"
    )
    driver = (
        "import os, subprocess, sys, time; from streamrl.core import faults; "
        "env = dict(os.environ, **faults.forwarded_env()); "
        f"subprocess.Popen([sys.executable, '-c', {actor!r}], env=env).wait(); "
        "time.sleep(30); open(os.environ['OUT'] + '.driver_survived', 'w')"
    )
    out = tmp_path / "out"
    env = dict(os.environ, STREAMRL_FAULTS="tool.after_run=kill_job@1", OUT=str(out))
    env.pop(faults.JOB_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", driver], env=env, start_new_session=True)
    assert proc.wait(60) == -signal.SIGKILL  # the driver died with the actor's fault, not 30 s later
    assert not (tmp_path / "out.survived").exists() and not (tmp_path / "out.driver_survived").exists()


def test_forwarded_env_carries_the_buffer_io_fault_plan_alone_or_with_fault_points(monkeypatch, tmp_path):
    """STREAMRL_IO_FAULTS is read by the buffer log's writers, which run in the buffer's Ray actor: it
    must reach the actors even when no STREAMRL_FAULTS point is armed."""
    from streamrl.core import iofaults

    assert faults.IO_ENV == iofaults.ENV
    for name in (faults.ENV, faults.LEDGER_ENV, faults.JOB_ENV, faults.IO_ENV, faults.ANSWER_LEDGER_ENV):
        monkeypatch.delenv(name, raising=False)
    assert faults.forwarded_env() == {}
    monkeypatch.setenv(faults.IO_ENV, "at=traj:write:3:torn")
    assert faults.forwarded_env() == {faults.IO_ENV: "at=traj:write:3:torn"}
    monkeypatch.setenv(faults.ENV, "worker.sink=raise%3")
    monkeypatch.setenv(faults.LEDGER_ENV, str(tmp_path / "ledger"))
    env = faults.forwarded_env()
    assert env[faults.IO_ENV] == "at=traj:write:3:torn" and env[faults.ENV] == "worker.sink=raise%3"
    assert env[faults.LEDGER_ENV] == str(tmp_path / "ledger") and env[faults.JOB_ENV]
