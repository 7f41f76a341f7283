"""The code-interpreter sandbox: fail-closed probe, limits, capped output, stateful cells, restore from
the journal, and the escape catalogue (workloads/tools/sandbox_escapes.py), each attempt blocked.

The namespace tests are skipped, with the probe's reasons, only on a machine where neither bwrap nor
unprivileged user namespaces work. A bwrap binary outside PATH can be tested with STREAMRL_TEST_BWRAP.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from streamrl.tools import load_tool_config
from streamrl.tools.code_interpreter import (
    RUNNER,
    CodeInterpreterConfig,
    CodeInterpreterTool,
)
from streamrl.tools.sandbox import (
    CappedStream,
    IsolationUnavailable,
    Sandbox,
    SandboxLimits,
    SandboxSettings,
    _execute,
    probe,
)
from streamrl.tools.types import ToolCall, ToolCallStatus, ToolJournalEntry, ToolResult
from streamrl.workloads.tools.sandbox_escapes import (
    ATTEMPTS,
    Harness,
    escape_tool_config,
    run_attempt,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tools"
PROBE = probe(SandboxSettings())
NAMESPACED = PROBE.layer in ("bwrap", "unshare")
needs_namespaces = pytest.mark.skipif(not NAMESPACED, reason=f"no sandbox isolation on this machine: {PROBE.tried}")
BWRAP = os.environ.get("STREAMRL_TEST_BWRAP") or shutil.which("bwrap")
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# the attempts that read host facts from /proc (and the hostname): blocked by the unshare layer
HOST_FACTS = (
    "proc_id_maps_show_trainer",
    "proc_cgroup_shows_host_paths",
    "proc_kernel_cmdline_and_config",
    "proc_boot_id",
    "host_hostname",
)
FAST = {"timeout_s": 3.0, "replay_timeout_s": 3.0, "cpu_s": 2, "memory_mb": 512, "max_output_bytes": 1024}


def _our_processes() -> dict[int, bytes]:
    """Live (not zombie) descendants of this test process, with their command lines.

    Scoped to this process's tree so that sandboxes of other programs on the machine (a chaos run, a
    second test session) can't make an assertion fail; `_adopt_orphans` keeps an escaped orphan in it.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo = {}, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        todo.extend(children.get(pid, []))
    return found


def _runner_pids() -> list[int]:
    """Our sandboxed programs still alive (their command line is the runner)."""
    marker = RUNNER.strip().splitlines()[0].encode()
    return sorted(pid for pid, cmdline in _our_processes().items() if marker in cmdline)


def _pids_with(tag: str) -> list[int]:
    return sorted(pid for pid, cmdline in _our_processes().items() if tag.encode() in cmdline)


@pytest.fixture(scope="module", autouse=True)
def _adopt_orphans():
    """Make this process the child subreaper while these tests run: a sandboxed program that outlives
    its sandbox is re-parented here, not to init, so the scoped pid checks above still see it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.fail(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def tool() -> CodeInterpreterTool:
    return CodeInterpreterTool(FAST)


async def _run(tool: CodeInterpreterTool, *cells: str) -> list[str]:
    instance = await tool.create()
    try:
        return [(await tool.execute(instance, {"code": c})).text for c in cells]
    finally:
        await tool.release(instance)


# -- output cap -------------------------------------------------------------------------------------


async def test_capped_stream_keeps_head_and_tail_and_cuts_the_middle():
    floods = []
    stream = CappedStream(10, 1000, lambda: floods.append(1))
    reader = asyncio.StreamReader()
    reader.feed_data(b"HEAD!" + b"x" * 100 + b"TAIL!")
    reader.feed_eof()
    await stream.drain(reader)
    assert stream.text() == "HEAD!\n...[truncated 100 bytes]...\nTAIL!" and stream.cut == 100 and not floods

    flood = CappedStream(10, 50, lambda: floods.append(1))
    reader = asyncio.StreamReader()
    reader.feed_data(b"y" * 200)
    reader.feed_eof()
    await flood.drain(reader)
    assert floods == [1] and flood.total == 200  # called once, and the stream was still drained


# -- fail closed ------------------------------------------------------------------------------------


def test_refuses_to_start_without_isolation():
    missing = {"unshare_path": "/nonexistent/unshare", "bwrap_path": "/nonexistent/bwrap"}
    with pytest.raises(IsolationUnavailable, match='isolation = "none"') as info:
        Sandbox(SandboxSettings(**missing))
    assert "/nonexistent/unshare" in str(info.value) and "/nonexistent/bwrap" in str(info.value)
    with pytest.raises(IsolationUnavailable):  # an explicit layer never falls back to another one
        CodeInterpreterTool({"isolation": "unshare", **missing})
    with pytest.raises(ValueError, match="no sandbox isolation is available"):  # a config error at load time
        load_tool_config({"tools": [{"class_name": "streamrl.tools.code_interpreter:CodeInterpreterTool",
                                     "config": {"isolation": "auto", **missing}}]})  # fmt: skip


def test_config_is_validated():
    with pytest.raises(ValueError):
        CodeInterpreterConfig.model_validate({"isolation": "docker"})
    with pytest.raises(ValueError):
        CodeInterpreterConfig.model_validate({"timeout_s": 0})
    with pytest.raises(ValueError):
        CodeInterpreterConfig.model_validate({"sandbox_uid": 0})


async def test_explicit_opt_out_still_applies_limits_env_and_workdir(monkeypatch):
    monkeypatch.setenv("STREAMRL_FAKE_API_KEY", "sk-should-not-leak")
    none = CodeInterpreterTool({**FAST, "isolation": "none", "memory_mb": 300})
    assert none.layer == "none"
    [out] = await _run(
        none,
        "import os, resource\n"
        "print(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20, resource.getrlimit(resource.RLIMIT_CORE))\n"
        "print(os.environ.get('STREAMRL_FAKE_API_KEY'), os.getcwd() == os.environ['HOME'], os.listdir('.'))",
    )
    assert out.splitlines() == ["300 (0, 0)", "None True []"]


# -- the interpreter --------------------------------------------------------------------------------


async def test_cells_keep_state_like_a_notebook(tool):
    out = await _run(
        tool,
        "x = 21\nprint('set')",
        "x * 2",  # a trailing expression shows its repr
        "import sys\nprint('to stderr', file=sys.stderr)\n1 / 0",
        "y = x + 1\nopen('notes.txt', 'w').write(str(y))",  # the failed cell did not break the state
        "print(open('notes.txt').read(), y)",  # files come back too: the earlier cells are replayed
        "exit()",
        "None",
        "def f(:",
    )
    assert out[0] == "set\n" and out[1] == "42\n"
    assert out[2].startswith("Error: the code raised an exception\nto stderr\nTraceback")
    assert 'File "<cell 3>", line 3' in out[2] and "ZeroDivisionError: division by zero" in out[2]
    assert "code_interpreter" not in out[2] and "run_cell" not in out[2]  # the runner's frames are hidden
    assert out[3] == "2\n" and out[4] == "22 22\n"
    assert out[5] == "(no output)" and out[6] == "(no output)"
    assert out[7].startswith("Error:") and "SyntaxError" in out[7]


async def test_a_cell_that_ends_the_process_is_an_error_and_is_not_replayed(tool):
    """`os._exit(0)` exits 0 with no output; counted as a success it would be kept, and every later call
    would replay it and die before running its own cell ("(no output)" each time)."""
    out = await _run(tool, "x = 20", "import os\nprint('bye', flush=True)\nos._exit(0)", "print(x + 1)")
    assert out[0] == "(no output)"
    assert out[1].startswith("Error: the process ended before the code finished (exit status 0, e.g. os._exit)")
    assert "bye" in out[1]
    assert out[2] == "21\n"  # the later cell ran: the exiting cell was not kept


async def test_output_starting_with_error_is_still_a_successful_cell(tool):
    """Output that merely starts with "Error:" is a successful cell: its state is kept live and again
    by `restore`."""
    registry = load_tool_config({"tools": [{"class_name": "streamrl.tools.code_interpreter:CodeInterpreterTool",
                                            "config": FAST}]})  # fmt: skip
    ids = await registry.create_instances()
    calls = [ToolCall(call_id="a", name="code_interpreter",
                      arguments={"code": "print('Error: none, all fine')\ny = 5"}),
             ToolCall(call_id="b", name="code_interpreter", arguments={"code": "print(y)"})]  # fmt: skip
    first, second = [(await registry.run_calls([c], ids, timeout_s=30))[0] for c in calls]
    await registry.release_instances(ids)
    assert first.text == "Error: none, all fine\n" and not first.is_error
    assert second.text == "5\n" and not second.is_error

    journal = [ToolJournalEntry(call_id="a", name="code_interpreter", arguments=calls[0].arguments,
                                status=ToolCallStatus.DONE, result=first)]  # fmt: skip
    await tool.restore("traj-error-text", journal)
    assert (await tool.execute("traj-error-text", {"code": "print(y * 2)"})).text == "10\n"
    await tool.release("traj-error-text")


async def test_a_slow_replay_is_blamed_on_the_replay_not_on_the_new_cell():
    """The replay runs under its own budget, not the new cell's deadline, so a replay past its budget
    is reported as such, never as the new cell running longer than its time limit."""
    # wide margins (a loaded machine starts the sandbox slowly): one replay of a 2 s cell fits the 3.5 s
    # replay budget, two (4 s) do not; the cells' own limit (10 s) is never the one that trips
    slow = CodeInterpreterTool({**FAST, "timeout_s": 10.0, "replay_timeout_s": 3.5, "cpu_s": 2})
    cell = "import time\ntime.sleep(2.0)"
    instance = await slow.create()
    try:
        first = await slow.execute(instance, {"code": cell})
        second = await slow.execute(instance, {"code": cell})  # replays 2 s: within its budget
        third = await slow.execute(instance, {"code": "print('never')"})  # replays 4 s: past it
    finally:
        await slow.release(instance)
    assert not first.is_error and not second.is_error, (first.text, second.text)
    assert 1.9 < second.metrics["sandbox/replay_s"] < 3.5
    assert third.is_error and third.text.startswith(
        "Error: re-running the 2 earlier cell(s) to restore the state took "
        "longer than the 3.5 s replay limit; your code did not run"
    )
    assert "time limit" not in third.text and "never" not in third.text


async def test_an_interpreter_living_under_tmp_is_visible_in_the_sandbox():
    """Found by the first clean-clone CI run: a checkout (and its .venv) under /tmp was hidden by the
    sandbox's private /tmp, so the tool refused to start. The private folders are now mounted first and
    the interpreter bound on top of them."""
    import shutil
    import subprocess
    import sys
    import tempfile

    home = tempfile.mkdtemp(prefix="streamrl-venv-", dir="/tmp")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", f"{home}/venv"], check=True, timeout=60)
        tool = CodeInterpreterTool({**FAST, "python": f"{home}/venv/bin/python"})
        assert tool.layer != "none"
        (out,) = await _run(tool, "import sys\nprint(sys.prefix)")
        assert out == "/opt/venv\n"  # the venv is shown at a neutral path, not at its host path
        (listing,) = await _run(tool, "import os\nprint(sorted(os.listdir('/tmp')))")
        assert listing == "[]\n"  # nothing of host /tmp
    finally:
        shutil.rmtree(home, ignore_errors=True)


async def test_bad_arguments_and_cell_limit_are_error_observations():
    small = CodeInterpreterTool({**FAST, "max_cells": 2, "max_code_chars": 50})
    out = await _run(small, "a = 1", "", "b = 2", "print(a + b)", "x = '" + "y" * 60 + "'")
    assert out[0] == "(no output)" and out[1].startswith("Error: `code` must be")
    assert out[2] == "(no output)"
    assert out[3].startswith("Error: this interpreter already ran 2 cells")
    assert out[4].startswith("Error: code is longer than 50 characters")


async def test_replays_are_deterministic(tool):
    first, second = await _run(
        tool, "import random\nv = random.random()\nprint(v, hash('abc'))", "print(v, hash('abc'))"
    )
    assert first == second


async def test_restore_rebuilds_state_from_the_journal_in_a_fresh_tool(tool):
    instance = await tool.create("traj-1")
    journal = []
    for i, code in enumerate(["import math\nr = 3", "r = r / 0", "area = math.pi * r ** 2\nround(area, 2)"]):
        text = (await tool.execute(instance, {"code": code})).text
        result = ToolResult(call_id=f"c{i}", name="code_interpreter", text=text, is_error=text.startswith("Error:"))
        journal.append(ToolJournalEntry(call_id=f"c{i}", name="code_interpreter", arguments={"code": code},
                                        status=ToolCallStatus.DONE, result=result))  # fmt: skip
    journal.append(ToolJournalEntry(call_id="c3", name="code_interpreter", arguments={"code": "r = 100"}))  # INTENT
    await tool.release(instance)

    fresh = CodeInterpreterTool(FAST)  # another process would build its own tool
    await fresh.restore("traj-1", journal)
    assert fresh.instance_state("traj-1")["cells"] == [journal[0].arguments["code"], journal[2].arguments["code"]]
    out = await fresh.execute("traj-1", {"code": "print(r, round(area, 2))"})
    assert out.text == "3 28.27\n"
    assert CodeInterpreterTool.idempotent  # an interrupted call is re-run on resume


async def test_runs_through_the_yaml_config_and_the_registry():
    registry = load_tool_config(CONFIGS / "code_interpreter.yaml")
    assert registry.names == ["code_interpreter"] and registry.is_idempotent("code_interpreter")
    assert registry.schemas()[0]["function"]["parameters"]["required"] == ["code"]
    calls = [ToolCall(call_id="a", name="code_interpreter", arguments={"code": "print(6 * 7)"}),
             ToolCall(call_id="b", name="code_interpreter",
                      arguments={"code": "import os; os.environ['HOME_X']"})]  # fmt: skip
    ids = await registry.create_instances()
    results = await registry.run_calls(calls, ids, timeout_s=30)
    await registry.release_instances(ids)
    assert results[0].text == "42\n" and not results[0].is_error
    assert results[1].is_error and "KeyError" in results[1].text


async def test_output_is_capped_in_the_middle(tool):
    [out] = await _run(tool, "print('BEGIN' + 'x' * 100_000 + 'END')")
    assert out.startswith("BEGIN") and out.rstrip().endswith("END") and "...[truncated " in out
    assert len(out.encode()) < 1024 + 100


async def test_metrics_are_namespaced(tool):
    instance = await tool.create()
    failed = await tool.execute(instance, {"code": "raise ValueError('bad input')"})
    ok = await tool.execute(instance, {"code": "print('fine')"})
    await tool.release(instance)
    assert failed.text.startswith("Error: the code raised an exception") and "ValueError: bad input" in failed.text
    assert failed.metrics["sandbox/error"] == 1.0 and failed.metrics["sandbox/exit_code"] == 1.0
    assert (
        ok.metrics["sandbox/error"] == 0.0 and ok.metrics["sandbox/timeout"] == 0.0 and ok.metrics["sandbox/wall_s"] > 0
    )
    assert all(key.startswith("sandbox/") for key in failed.metrics)


# -- isolation --------------------------------------------------------------------------------------


@needs_namespaces
async def test_the_sandbox_sees_a_minimal_read_only_world(tool):
    project = Path(__file__).resolve().parents[2]
    [out] = await _run(
        tool,
        "import json, os, socket\nwritable = {}\n"
        "for path in ('/usr/x', '/etc/x', '/x', '/tmp/x', '/workspace/x'):\n"
        "    try:\n        open(path, 'w').close()\n        writable[path] = True\n"
        "    except OSError:\n        writable[path] = False\n"
        "print(json.dumps({'root': os.listdir('/'), 'project': os.path.exists("
        + repr(str(project / "pyproject.toml"))
        + "),\n"
        "    'home': os.path.exists('/home'), 'nics': [n for _, n in socket.if_nameindex()],\n"
        "    'pids': [p for p in os.listdir('/proc') if p.isdigit()], 'writable': writable,\n"
        "    'caps': [l.split()[1] for l in open('/proc/self/status')\n"
        "             if l.startswith(('CapEff', 'CapBnd', 'NoNewPrivs'))]}))",
    )
    seen = json.loads(out)
    assert {"usr", "workspace", "tmp", "proc", "dev"} <= set(seen["root"]) and "var" not in seen["root"]
    assert not seen["project"] and not seen["home"]  # the repository and home directories are hidden
    assert seen["nics"] == ["lo"]  # no network but a (down) loopback of its own
    assert len(seen["pids"]) <= 3  # init, the program: the host's processes are invisible
    assert seen["caps"] == ["0000000000000000", "0000000000000000", "1"]
    assert seen["writable"] == {"/usr/x": False, "/etc/x": False, "/x": False, "/tmp/x": True, "/workspace/x": True}


@needs_namespaces
@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
async def test_escape_attempt_is_blocked(attempt, escape_harness, escape_tool):
    outcome = await run_attempt(escape_tool, attempt, escape_harness)
    assert outcome.blocked, f"{attempt.name} escaped: {outcome.how}"
    assert outcome.error_observation and outcome.metrics["sandbox/error"] == 1.0, outcome.how
    assert escape_harness.sentinel_alive()
    assert _runner_pids() == []  # nothing the attempt started outlives the call


@pytest.fixture(scope="module")
def escape_harness():
    with Harness() as harness:
        yield harness


@pytest.fixture(scope="module")
def escape_tool(escape_harness):
    return CodeInterpreterTool(escape_tool_config(escape_harness))


async def test_the_checks_can_fail_without_isolation(escape_harness):
    """Control: with isolation "none" the file, network, write and /proc attempts do get out (so the
    checks above are real); the cleared environment and the rlimits still hold."""
    tool = CodeInterpreterTool(escape_tool_config(escape_harness, isolation="none"))
    by_name = {a.name: a for a in ATTEMPTS}
    names = ("network_connect_host", "read_outside_workdir", "write_outside_workdir", "read_env_secret",
             "memory_bomb", *HOST_FACTS)  # fmt: skip
    outcomes = {n: await run_attempt(tool, by_name[n], escape_harness) for n in names}
    assert not outcomes["network_connect_host"].blocked and "connection" in outcomes["network_connect_host"].how
    assert (
        not outcomes["read_outside_workdir"].blocked and escape_harness.secret in outcomes["read_outside_workdir"].how
    )
    assert not outcomes["write_outside_workdir"].blocked
    assert outcomes["read_env_secret"].blocked and outcomes["memory_bomb"].blocked
    # the trainer's own id maps, hostname and boot id are always there; the kernel's command line
    # almost always (the attempt also reads /proc/config.gz); cgroup paths where it is not in "/"
    assert [n for n in HOST_FACTS if outcomes[n].blocked] in ([], ["proc_cgroup_shows_host_paths"])


@needs_namespaces
async def test_wall_timeout_kills_the_whole_sandbox():
    tag = f"{time.time_ns() % 10**6}.{os.getpid()}"
    sandbox = Sandbox(SandboxSettings(limits=SandboxLimits(cpu_s=30)))
    program = (
        "import os, signal, subprocess, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        f"for _ in range(3):\n    subprocess.Popen(['sleep', '{tag}'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
        "print('started', flush=True)\nwhile True:\n    time.sleep(0.05)"
    )
    start = time.perf_counter()
    result = await sandbox.run(program, timeout_s=3.0)
    assert result.timed_out and result.stdout == "started\n" and result.exit_code is None
    assert time.perf_counter() - start < 6
    assert _pids_with(tag) == [] and _runner_pids() == []  # setsid children died with the pid namespace


@needs_namespaces
async def test_a_cancelled_call_kills_its_sandbox(tool):
    instance = await tool.create()
    call = asyncio.create_task(tool.execute(instance, {"code": "import time\ntime.sleep(60)"}))
    deadline = time.monotonic() + 30
    while not (running := _runner_pids()) and time.monotonic() < deadline and not call.done():
        await asyncio.sleep(0.05)
    assert running and not call.done()  # the program is running when the call is cancelled
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await tool.release(instance)
    assert _runner_pids() == []


def test_a_call_cut_off_by_its_event_loop_closing_is_killed_and_logs_nothing(caplog):
    """A sandboxed program still running when its event loop shuts down (the loop cancels every task)
    is killed, and the cut-off leaves no "exception was never retrieved" error in the log."""
    tag = f"{time.time_ns() % 10**6}.{os.getpid()}"

    async def main():
        asyncio.ensure_future(_execute(["sleep", tag], b"", 30.0, SandboxSettings(), "none"))
        deadline = time.monotonic() + 10
        while not _pids_with(tag):
            assert time.monotonic() < deadline, "the program never started"
            await asyncio.sleep(0.02)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        # a loop of its own, in a thread: this one's loop (pytest-asyncio's) is left as it is
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, main()).result(60)  # main returns with the call running: it is cancelled
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert _pids_with(tag) == []


@pytest.mark.skipif(BWRAP is None, reason="no bwrap binary (set STREAMRL_TEST_BWRAP to test one outside PATH)")
async def test_bwrap_layer_blocks_the_core_attempts(escape_harness):
    tool = CodeInterpreterTool(escape_tool_config(escape_harness, isolation="bwrap", bwrap_path=BWRAP))
    assert tool.layer == "bwrap"
    for attempt in ATTEMPTS:
        if attempt.name in (
            "network_connect_host",
            "read_outside_workdir",
            "read_env_secret",
            "kill_parent",
            "fork_bomb",
        ):
            outcome = await run_attempt(tool, attempt, escape_harness)
            assert outcome.blocked, f"{attempt.name} escaped under bwrap: {outcome.how}"
    assert (await _run(tool, "x = 2", "x ** 10"))[1] == "1024\n"
