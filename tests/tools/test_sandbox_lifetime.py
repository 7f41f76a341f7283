"""The code-interpreter sandbox's lifetime: a sandbox dies with the worker that started it and with
its supervisor, leftovers of a dead worker are swept (only from records this user wrote, for process
groups this user's workers started), the number of sandboxes running at once is capped, and the
sandbox's /proc shows neither the host's paths nor the stages' command lines. Its memory and process
limits: `test_sandbox_limits.py`.

Process checks use the helpers of `test_sandbox.py`: this process is the child subreaper while they
run, so a sandbox that outlives its worker is re-parented here and still found.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from streamrl.tools.code_interpreter import CodeInterpreterTool
from streamrl.tools.sandbox import DEFAULT_MAX_CONCURRENT, SLOTS, Sandbox, SandboxLimits, SandboxSettings
from streamrl.tools.sandbox import reaper as sandbox_reaper
from streamrl.tools.sandbox.stages import HOSTNAME, MASKED_PROC
from tests.tools.test_sandbox import (  # noqa: F401 (_adopt_orphans: the module's subreaper fixture)
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
from streamrl.tools.code_interpreter import CodeInterpreterTool

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


# A program that sends a sleep off with setsid, then kills its supervisor and waits to be killed.
KILLS_SUPERVISOR = (
    "import os, signal, subprocess\n"
    "sleep = subprocess.Popen(['sleep', '{tag}'], start_new_session=True, stdout=subprocess.DEVNULL,\n"
    "                         stderr=subprocess.DEVNULL)\n"
    "print(sleep.pid, flush=True)\nos.kill(os.getppid(), signal.SIGKILL)\nsignal.pause()"
)


def _running(pid: int, tag: str) -> bool:
    """Whether `pid` is still the (not zombie) process whose command line names `tag`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z" and tag.encode() in cmdline


async def test_a_program_that_kills_its_supervisor_leaves_no_process_behind(tmp_path):
    """With isolation "none" the program runs as the trainer's user and can kill its supervisor; what it
    sent off with setsid must not outlive that. Checked after the run, `close` and the sweep."""
    tag = _tag()
    sandbox = Sandbox(SandboxSettings(isolation="none", registry_dir=str(tmp_path / "registry")))
    result = await asyncio.wait_for(sandbox.run(KILLS_SUPERVISOR.format(tag=tag), timeout_s=5.0), 30)
    sandbox.close()
    sandbox_reaper.sweep(tmp_path / "registry")
    pid = int(result.stdout.split()[0])
    _wait_until(lambda: not _running(pid, tag), 5, "the setsid sleep died with the supervisor")


def _planted(root: Path, owner: str, key: str) -> Path:
    (root / owner).mkdir(parents=True, exist_ok=True)
    record = root / owner / key
    record.touch()
    return record


def _start_time(pid: int) -> int:
    key = sandbox_reaper.process_key(pid)
    assert key is not None
    return int(key.split("-")[1])


def test_the_default_registry_is_a_private_directory_of_this_user(tmp_path, monkeypatch, caplog):
    """The records live in `<tmp>/streamrl-sandboxes-<uid>`, mode 0700, owned by this user; a directory
    of that name open to other users is not used (the records go to a fresh private one), and one set
    in the settings is refused."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = sandbox_reaper.default_registry()
    assert root == tmp_path / f"streamrl-sandboxes-{os.geteuid()}"
    info = root.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    root.chmod(0o777)  # as if planted: anyone may write records into it
    with caplog.at_level(logging.WARNING):
        sandbox = Sandbox(SandboxSettings(isolation="none"))
    assert sandbox.registry.root != root and stat.S_IMODE(sandbox.registry.root.lstat().st_mode) == 0o700
    assert "not used" in caplog.text
    with pytest.raises(ValueError, match="open to other users"):
        Sandbox(SandboxSettings(isolation="none", registry_dir=str(root)))


def test_the_sweep_ignores_records_it_cannot_trust(tmp_path):
    """A record kills its process group only when all of it is this user's: a registry directory no
    one else may write, owner folders and records owned by this user, and a leader that is alive with
    the recorded start time, runs as this user, leads its own group and started after its worker."""
    tag = _tag()
    victims = [subprocess.Popen(["sleep", tag], start_new_session=True) for _ in range(4)]
    as_other = os.geteuid() == 0  # root can run a process, and own a folder, as another user
    if as_other:
        victims.append(subprocess.Popen(["sleep", tag], start_new_session=True, user=65534, group=65534))
    try:
        open_root = tmp_path / "open"
        open_root.mkdir(mode=0o700)
        _planted(open_root, "999999999-1", sandbox_reaper.process_key(victims[0].pid))
        open_root.chmod(0o777)
        assert sandbox_reaper.sweep(open_root) == 0  # anyone could have written this record

        root = tmp_path / "private"
        root.mkdir(mode=0o700)
        first = _start_time(victims[1].pid)
        _planted(root, "999999998-1", f"{victims[1].pid}-{first + 1}")  # another process's start time
        _planted(root, f"999999997-{_start_time(victims[2].pid) + 100}", sandbox_reaper.process_key(victims[2].pid))
        os.symlink(root / "999999998-1", root / "999999996-1")  # a folder that is not a folder
        _planted(root, "999999995-1", "x").unlink()
        os.symlink(tmp_path / "elsewhere", root / "999999995-1" / sandbox_reaper.process_key(victims[3].pid))
        if as_other:
            _planted(root, "999999994-1", sandbox_reaper.process_key(victims[4].pid))  # not this user's process
            other = _planted(root, "999999993-1", sandbox_reaper.process_key(victims[3].pid))
            os.chown(other, 65534, 65534)  # a record this user did not write
            os.chown(other.parent, 65534, 65534)
        assert sandbox_reaper.sweep(root) == 0
        assert [v.poll() for v in victims] == [None] * len(victims)  # none was killed
    finally:
        for victim in victims:
            victim.kill()
            victim.wait(5)


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
