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
import socket
import subprocess
import sys
import time

import pytest

from streamrl.rollout.tools.code_interpreter import CodeInterpreterTool
from streamrl.rollout.tools.sandbox import DEFAULT_MAX_CONCURRENT, SLOTS, Sandbox, SandboxLimits, SandboxSettings
from streamrl.rollout.tools.sandbox import reaper as sandbox_reaper
from streamrl.rollout.tools.sandbox.stages import HOSTNAME, MASKED_PROC
from tests.rollout.test_sandbox import (  # noqa: F401 (_adopt_orphans: the module's subreaper fixture)
    FAST,
    NAMESPACED,
    PROBE,
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


def _sleeps(tag: str) -> list[int]:
    """`sleep <tag>` processes below this one (the worker's own command line names the tag too)."""
    return _pids_with("sleep\0" + tag)


# A cell that cancels its alarm and starts three sleeps: one in its process group, one in a session of
# its own (setsid) and one under a parent that exits at once (double fork: re-parented, orphaned).
ESCAPES = (
    "import os, signal, subprocess, time\nsignal.alarm(0)\n"
    "subprocess.Popen(['sleep', '{tag}'])\n"
    "subprocess.Popen(['sleep', '{tag}'], start_new_session=True)\n"
    "if os.fork() == 0:\n    os.setsid()\n    subprocess.Popen(['sleep', '{tag}'])\n    os._exit(0)\n"
    "print('started', flush=True)\ntime.sleep(600)"
)


@pytest.mark.parametrize("isolation", LAYERS)
def test_a_sandbox_dies_with_the_worker_that_started_it(isolation):
    """Nothing a cell runs outlives a SIGKILLed worker, in every layer: not a cell that cancels its alarm
    and sleeps (as root, the unshare layer's first stage needs its own parent-death signal), and not
    the processes the cell starts (with isolation "none" the cell has the death signal, its children
    do not). The test waits until all three sleeps run, the group's, setsid's and an orphan, before
    it kills the worker; waiting for the runner only would mostly kill the cell before it starts them."""
    tag = _tag()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, isolation, ESCAPES.format(tag=tag)])
    try:
        _wait_until(lambda: len(_sleeps(tag)) == 3 and _runner_pids(), 60, "the cell started its three sleeps")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    _wait_until(lambda: not _sleeps(tag) and not _runner_pids(), 10, "the cell's processes died with the worker")


@pytest.mark.parametrize("isolation", LAYERS)
async def test_a_timed_out_sandbox_takes_every_process_it_started(isolation):
    """The wall timeout kills the whole sandbox, the setsid and orphaned sleeps included: in the
    namespaced layers the pid namespace ends with init; with "none" the first stage, their subreaper,
    kills them (before, they outlived the run there)."""
    tag = _tag()
    tool = CodeInterpreterTool({**FAST, "isolation": isolation, "timeout_s": 3.0})
    start = time.perf_counter()
    [out] = await _run(tool, ESCAPES.format(tag=tag))
    assert out == "Error: the code ran longer than the 3 s time limit and was stopped\nstarted\n", out
    assert time.perf_counter() - start < 8
    _wait_until(lambda: not _sleeps(tag) and not _runner_pids(), 5, "the sandbox's processes died with it")


@pytest.mark.parametrize("isolation", LAYERS)
async def test_a_finished_program_leaves_no_process_behind(isolation):
    """A program that ends while its children run takes them along, as a pid namespace does, and the
    call returns at once (before, with "none" the call waited for its timeout on the children's pipes)."""
    tag = _tag()
    tool = CodeInterpreterTool({**FAST, "isolation": isolation, "timeout_s": 20.0})
    start = time.perf_counter()
    [out] = await _run(tool, ESCAPES.format(tag=tag).replace("time.sleep(600)", "print('bye')"))
    assert out == "started\nbye\n", out
    assert time.perf_counter() - start < 10
    _wait_until(lambda: not _sleeps(tag) and not _runner_pids(), 5, "the program's children died with it")


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
        forks = (
            "import os, time\nn = 0\ntry:\n    while n < 50:\n        if os.fork() == 0:\n"
            "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
        )
        result = await sandbox.run(forks, timeout_s=60)
        assert int(result.stdout) < 8


@needs_namespaces
async def test_the_sandbox_proc_shows_neither_host_paths_nor_the_trainer():
    """The sandbox's /proc shows neither init's command line (the spec, with the host's venv and mount
    paths) nor the program as the venv's host path."""
    host_venv = os.path.realpath(sys.prefix)
    tool = CodeInterpreterTool(FAST)
    needles = [host_venv, "streamrl-sandbox", '"layer"', "/root"]
    [out] = await _run(
        tool,
        f"import json, os, sys\nneedles = {needles!r}\ncmdlines = {{}}\n"
        "for pid in sorted(p for p in os.listdir('/proc') if p.isdigit()):\n"
        "    cmdlines[pid] = open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace')\n"
        "found = [n for n in needles if any(n in c for c in cmdlines.values())]\n"
        "print(json.dumps({'pids': list(cmdlines), 'me': os.getpid(), 'found': found,\n"
        "    'argv0': cmdlines[str(os.getpid())].split(chr(0))[0], 'executable': sys.executable,\n"
        "    'prefix': sys.prefix, 'env': sorted(os.environ)}))",
    )
    seen = json.loads(out)
    assert seen["pids"] == [str(seen["me"])]  # only the program itself: init (pid 1) is hidden
    assert seen["found"] == []  # no command line names the host's venv, /root or the stages' spec
    assert seen["argv0"] == seen["executable"] == "/opt/venv/bin/python" and seen["prefix"] == "/opt/venv"
    assert not [k for k in seen["env"] if "STREAMRL" in k or "VIRTUAL_ENV" in k or k == "PYTHONPATH"]


PROC_VIEW = """
import json, os, socket
def read(path):
    try:
        return sorted(os.listdir(path)) if os.path.isdir(path) else open(path, errors="replace").read()
    except OSError as exc:
        return type(exc).__name__
mountinfo = [line.split() for line in open("/proc/self/mountinfo")]
print(json.dumps({
    "files": {p: read(p) for p in ["/proc/self/" + n for n in ("uid_map", "gid_map", "cgroup", "mounts",
              "mountstats", "maps", "environ", "cmdline")] + ["/proc/" + n for n in MASKED]},
    "mountinfo": [(f[3], f[4]) for f in mountinfo], "exe": os.readlink("/proc/self/exe"),
    "hostname": socket.gethostname(), "fds": len(os.listdir("/proc/self/fd")), "cpus": os.cpu_count(),
    "meminfo": read("/proc/meminfo")[:9],
}))
"""


@pytest.mark.skipif(PROBE.layer != "unshare", reason=f"the unshare layer is not this machine's: {PROBE.tried}")
async def test_the_unshare_layer_proc_shows_no_host_facts_but_those_docs_security_lists():
    """A cell must not read host facts through /proc: its uid map (root: the trainer runs as root), its
    cgroup paths, the kernel's command line, the boot id and the hostname. docs/security.md lists what
    stays visible; of the host's venv path, only mountinfo's root column of the /opt/venv mount."""
    host_venv = os.path.realpath(sys.prefix)
    masked = [n for n in MASKED_PROC if os.path.exists(f"/proc/{n}")]
    tool = CodeInterpreterTool({**FAST, "max_output_bytes": 256 << 10})
    [out] = await _run(tool, f"MASKED = {masked!r}\n" + PROC_VIEW)
    seen = json.loads(out)
    files = seen.pop("files")
    for name, mine in (("uid_map", os.getuid()), ("gid_map", os.getgid())):
        lines = [list(map(int, line.split())) for line in files[f"/proc/self/{name}"].splitlines()]
        assert len(lines) == 1, lines  # one line: the program's own id, mapped to itself
        [[inside, outside, count]] = lines
        assert count == 1 and inside == outside and outside != mine, lines
    assert {line.split(":", 2)[2] for line in files["/proc/self/cgroup"].splitlines()} == {"/"}
    assert {n: files[f"/proc/{n}"] for n in masked} == {n: [] if os.path.isdir(f"/proc/{n}") else "" for n in masked}
    assert seen["hostname"] == HOSTNAME != socket.gethostname()
    assert [p for p, text in files.items() if host_venv in text] == []
    assert host_venv not in seen["exe"] and all(host_venv not in point for _, point in seen["mountinfo"])
    assert {point for root, point in seen["mountinfo"] if host_venv in root} == {"/opt/venv"}  # documented
    # what programs and libraries need still works: their maps, fds, cpu count, memory
    assert "/proc/self/maps" in files and "[stack]" in files["/proc/self/maps"]
    assert seen["fds"] >= 3 and seen["cpus"] >= 1 and seen["meminfo"] == "MemTotal:"
