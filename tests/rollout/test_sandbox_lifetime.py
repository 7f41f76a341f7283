"""The code-interpreter sandbox's lifetime and budgets: a sandbox dies with the worker that started
it, leftovers of a dead worker are swept, memory and processes are bounded per sandbox (a cgroup v2
where one is writable; the per-process fallback elsewhere), the number of sandboxes running at once is
capped, and the sandbox's /proc shows neither the host's paths nor the stages' command lines.

Process checks use the helpers of `test_sandbox.py`: this process is the child subreaper while they
run, so a sandbox that outlives its worker is re-parented here and still found.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from streamrl.rollout.tools import sandbox_reaper
from streamrl.rollout.tools.code_interpreter import CodeInterpreterTool
from streamrl.rollout.tools.sandbox import DEFAULT_MAX_CONCURRENT, SLOTS, Sandbox, SandboxLimits, SandboxSettings
from tests.rollout.test_sandbox import (  # noqa: F401 (_adopt_orphans: the module's subreaper fixture)
    FAST,
    NAMESPACED,
    _adopt_orphans,
    _pids_with,
    _run,
    _runner_pids,
    needs_namespaces,
)

LAYERS = ["auto", "none"] if NAMESPACED else ["none"]
WORKER = """
import asyncio, sys
from streamrl.rollout.tools.code_interpreter import CodeInterpreterTool

async def main():
    tool = CodeInterpreterTool({"isolation": sys.argv[1], "timeout_s": 120, "cpu_s": 5})
    await tool.execute(await tool.create(), {"code": sys.argv[2]})

asyncio.run(main())
"""


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(0.05)


def _tag() -> str:
    return f"{time.time_ns() % 10**6}.{os.getpid()}{len(_pids_with(''))}"


@pytest.mark.parametrize("isolation", LAYERS)
def test_a_sandbox_dies_with_the_worker_that_started_it(isolation):
    """Found by the audit: as root the unshare layer's first stage had no parent-death signal, so a cell
    that cancels its alarm and sleeps outlived a SIGKILLed worker indefinitely."""
    tag = _tag()
    cell = (
        "import signal, subprocess, time\nsignal.alarm(0)\n"
        f"subprocess.Popen(['sleep', '{tag}'])\nprint('started', flush=True)\ntime.sleep(600)"
    )
    worker = subprocess.Popen([sys.executable, "-c", WORKER, isolation, cell])
    try:
        _wait_until(lambda: _pids_with(tag) and _runner_pids(), 60, "the cell started")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    _wait_until(lambda: not _pids_with(tag) and not _runner_pids(), 10, "the cell's processes died with the worker")


def test_the_sweep_kills_the_sandboxes_of_dead_workers_only(tmp_path):
    tag = _tag()
    leftover = subprocess.Popen(["sleep", tag], start_new_session=True)  # a dead worker's sandbox
    mine = subprocess.Popen(["sleep", tag + "1"], start_new_session=True)  # this process's running one
    try:
        dead_owner = tmp_path / "999999999-1"
        dead_owner.mkdir()
        (dead_owner / sandbox_reaper.process_key(leftover.pid)).touch()
        registry = sandbox_reaper.SandboxRegistry(tmp_path)
        registry.add(mine.pid)

        assert sandbox_reaper.sweep(tmp_path) == 1
        assert leftover.wait(5) == -signal.SIGKILL and not dead_owner.exists()
        assert mine.poll() is None  # its worker (this process) is alive
        assert registry.kill_owned() == 1 and mine.wait(5) == -signal.SIGKILL
    finally:
        for proc in (leftover, mine):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def restore_slots():
    yield
    SLOTS.resize(DEFAULT_MAX_CONCURRENT)
    SLOTS.reset_peak()


async def test_the_cap_bounds_how_many_sandboxes_run_at_once(restore_slots):
    sandbox = Sandbox(SandboxSettings(max_concurrent=2, limits=SandboxLimits(cpu_s=10)))
    SLOTS.reset_peak()
    program = "import time\nprint(time.monotonic())\ntime.sleep(0.4)\nprint(time.monotonic())"
    results = await asyncio.gather(*(sandbox.run(program, timeout_s=30) for _ in range(5)))
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert all(r.exit_code == 0 for r in results) and len(spans) == 5
    overlap = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert overlap <= 2 and SLOTS.peak <= 2
    assert sum(r.queued_s > 0.2 for r in results) >= 2  # the others waited for a slot
    assert SLOTS.num_held == 0


ALLOCATE = """
import os
def child(mb):
    try:
        block = bytearray(mb << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, not just reserved
        os._exit(0)
    except MemoryError:
        os._exit(7)
codes = []
for mb in {sizes}:
    pid = os.fork()
    if pid == 0:
        child(mb)
    codes.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in codes], flush=True)
"""


async def test_a_cgroup_budget_bounds_all_the_processes_of_a_sandbox_together():
    sandbox = Sandbox(SandboxSettings(limits=SandboxLimits(memory_mb=256, processes=16, cpu_s=20)))
    if sandbox.budget != "cgroup":
        pytest.skip(f"no writable cgroup v2 with memory and pids controllers here: {sandbox.budget_reason}")
    result = await sandbox.run(ALLOCATE.format(sizes=[150] * 4), timeout_s=60)  # each fits RLIMIT_AS, all do not
    assert result.memory_exceeded and result.exit_code is None, result
    tool = CodeInterpreterTool({**FAST, "memory_mb": 256, "timeout_s": 20})
    [out] = await _run(tool, ALLOCATE.format(sizes=[150] * 4))
    assert out.startswith("Error: the code ran out of memory (limit 256 MB for all its processes together)")


async def test_without_a_cgroup_the_documented_fallback_limits_each_process():
    """The fallback: RLIMIT_AS per process (a sandbox may hold up to memory_mb x processes) and
    RLIMIT_NPROC for the number of processes."""
    sandbox = Sandbox(SandboxSettings(cgroup=False, limits=SandboxLimits(memory_mb=256, processes=8, cpu_s=20)))
    assert sandbox.budget == "rlimit" and sandbox.budget_reason == "cgroup budgets are turned off"
    result = await sandbox.run(ALLOCATE.format(sizes=[150, 150, 150, 400]), timeout_s=60)
    assert result.stdout == "[0, 0, 0, 7]\n", result  # three under the limit each, together over it; one over it alone
    if NAMESPACED:
        forks = "import os, time\nn = 0\ntry:\n    while n < 50:\n        if os.fork() == 0:\n            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
        result = await sandbox.run(forks, timeout_s=60)
        assert int(result.stdout) < 8


@needs_namespaces
async def test_the_sandbox_proc_shows_neither_host_paths_nor_the_trainer():
    """Found by the audit: the sandbox's /proc showed init's command line (the spec, with the host's
    venv and mount paths) and the program ran as the venv's host path."""
    host_venv = os.path.realpath(sys.prefix)
    tool = CodeInterpreterTool(FAST)
    needles = [host_venv, "streamrl-sandbox", '"layer"', "/root"]
    [out] = await _run(
        tool,
        f"import json, os, sys\nneedles = {needles!r}\ncmdlines = {{}}\n"
        "for pid in sorted(p for p in os.listdir('/proc') if p.isdigit()):\n"
        "    cmdlines[pid] = open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace')\n"
        "print(json.dumps({'pids': list(cmdlines), 'me': os.getpid(), 'found': [n for n in needles if any(n in c for c in cmdlines.values())],\n"
        "    'argv0': cmdlines[str(os.getpid())].split(chr(0))[0], 'executable': sys.executable, 'prefix': sys.prefix,\n"
        "    'env': sorted(os.environ)}))",
    )
    seen = json.loads(out)
    assert seen["pids"] == [str(seen["me"])]  # only the program itself: init (pid 1) is hidden
    assert seen["found"] == []  # no command line names the host's venv, /root or the stages' spec
    assert seen["argv0"] == seen["executable"] == "/opt/venv/bin/python" and seen["prefix"] == "/opt/venv"
    assert not [k for k in seen["env"] if "STREAMRL" in k or "VIRTUAL_ENV" in k or k == "PYTHONPATH"]
