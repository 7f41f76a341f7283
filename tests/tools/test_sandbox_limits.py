"""The code-interpreter sandbox's memory and process limits hold for all the processes of a sandbox
together, whatever the layer and whether or not a cgroup v2 is writable, and the preflight says how
each one holds on this machine.

Process checks use the helpers of `test_sandbox.py` (this process is the child subreaper while they
run, so a process that outlives its sandbox is still found).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from streamrl.streaming import preflight
from streamrl.streaming.config import load_config
from streamrl.tools.code_interpreter import CodeInterpreterTool
from streamrl.tools.sandbox import Sandbox, SandboxLimits, SandboxSettings, describe
from tests.tools.test_sandbox import (  # noqa: F401 (_adopt_orphans: the module's subreaper fixture)
    FAST,
    NAMESPACED,
    _adopt_orphans,
    _pids_with,
    _run,
)

REPO = Path(__file__).resolve().parents[2]
LAYERS = ["auto", "none"] if NAMESPACED else ["none"]
# `num` children allocate `mb` each, touch every page (resident, not just reserved) and hold it for
# `hold_s`; the program prints their exit codes (7: MemoryError, the per-process RLIMIT_AS).
HOLD = """
import os, time
pids = []
for _ in range({num}):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray({mb} << 20)
            block[::4096] = b"x" * len(block[::4096])
        except MemoryError:
            os._exit(7)
        time.sleep({hold_s})
        os._exit(0)
    pids.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids], flush=True)
"""
# Forks up to 100 children that sleep `{tag}` seconds; prints how many forks succeeded.
FORKS = """
import os, time
num = 0
try:
    while num < 100:
        if os.fork() == 0:
            time.sleep({tag})
            os._exit(0)
        num += 1
except OSError:
    pass
print(num, flush=True)
"""


def _tag() -> str:
    return f"{20 + time.time_ns() % 10**6 / 10**7:.7f}"  # a sleep of ~20 s, unique on its command line


async def test_a_cgroup_budget_bounds_all_the_processes_of_a_sandbox_together():
    sandbox = Sandbox(SandboxSettings(limits=SandboxLimits(memory_mb=256, processes=16, cpu_s=20)))
    if sandbox.budget != "cgroup":
        pytest.skip(f"no writable cgroup v2 with memory and pids controllers here: {sandbox.budget_reason}")
    result = await sandbox.run(HOLD.format(num=4, mb=150, hold_s=20), timeout_s=60)  # each fits RLIMIT_AS
    assert result.memory_exceeded and result.exit_code is None, result


@pytest.mark.parametrize("isolation", LAYERS)
async def test_without_a_cgroup_memory_is_bounded_for_all_processes_together(isolation):
    """Four children of 150 MB each fit RLIMIT_AS (256 MB) one by one, not together: the sandbox is
    stopped as a whole and the result says it ran out of memory (the code interpreter tells the model
    so); one allocation over the limit alone is still a MemoryError of its process."""
    settings = SandboxSettings(isolation=isolation, cgroup=False, limits=SandboxLimits(memory_mb=256, cpu_s=30))
    sandbox = Sandbox(settings)
    assert sandbox.budget == "watch" and sandbox.budget_reason == "cgroup budgets are turned off"
    start = time.perf_counter()
    result = await sandbox.run(HOLD.format(num=4, mb=150, hold_s=20), timeout_s=60)
    assert result.memory_exceeded and result.exit_code is None, result
    assert time.perf_counter() - start < 15  # stopped while its children held the memory
    alone = await sandbox.run(HOLD.format(num=1, mb=400, hold_s=0), timeout_s=60)
    assert alone.stdout == "[7]\n" and not alone.memory_exceeded, alone
    tool = CodeInterpreterTool({**FAST, "isolation": isolation, "cgroup": False, "memory_mb": 256, "timeout_s": 20})
    [out] = await _run(tool, HOLD.format(num=4, mb=150, hold_s=20))
    assert out.startswith("Error: the code ran out of memory (limit 256 MB for all its processes together)"), out


@pytest.mark.parametrize("isolation", LAYERS)
async def test_no_layer_lets_a_program_run_more_processes_than_its_limit(isolation):
    """processes=32 bounds the sandbox's processes (and threads) together: the namespaced layers make
    the 32nd fork fail (RLIMIT_NPROC in the sandbox's user namespace); isolation "none" has no such
    namespace, so its supervisor stops the sandbox at the fork that passes the limit."""
    tag = _tag()
    sandbox = Sandbox(SandboxSettings(isolation=isolation, cgroup=False, limits=SandboxLimits(processes=32)))
    result = await sandbox.run(FORKS.format(tag=tag), timeout_s=60)
    if sandbox.layer == "none":
        assert result.processes_exceeded and result.exit_code is None and result.stdout == "", result
        assert "over the sandbox's limit of 32" in result.stderr
        tool = CodeInterpreterTool({**FAST, "isolation": "none", "cgroup": False, "max_processes": 32})
        [out] = await _run(tool, FORKS.format(tag=_tag()))
        assert out.startswith("Error: the code started more than 32 processes and threads together"), out
    else:
        assert 0 < int(result.stdout) < 32 and not result.processes_exceeded, result
    assert _pids_with(tag) == []  # the children went with it


def test_describe_says_how_each_limit_holds_here():
    """Without a cgroup both limits still hold for the whole sandbox: memory watched by the sandbox's
    first process, processes by the user namespace or, with "none", by the tracing supervisor."""
    for isolation in LAYERS:
        report = describe(SandboxSettings(isolation=isolation, cgroup=False))
        assert report.layer in ("none", "unshare", "bwrap") and (report.layer == "none") == (isolation == "none")
        assert report.memory.startswith("all processes together: checked every 50 ms"), report
        assert report.processes.startswith("all processes together"), report
        if report.layer == "none":
            assert "ptrace" in report.processes and "ptrace" in report.leftovers, report
        else:
            assert "pid namespace" in report.leftovers, report


def test_the_preflight_reports_the_sandbox_layer_and_its_limits():
    cfg = load_config(REPO / "configs/code_interpreter.toml", [])
    lines = preflight.sandbox_isolation(cfg)
    assert len(lines) == 1 and lines[0].startswith("code interpreter sandbox: isolation "), lines
    for part in ("memory: all processes together", "processes: all processes together", "leftovers: "):
        assert part in lines[0], lines
    assert preflight.sandbox_isolation(load_config(REPO / "configs/tiny.toml", [])) == []
