"""A `command` program is contained (docs/security.md, agent programs): its environment is minimal (no
ground truth, none of the worker's variables), the call ends when it exits (nothing it started outlives
it, setsid daemons included), and what it writes is kept within a bound."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest

from streamrl.rollout.agent_loop.scoring import RewardError
from streamrl.rollout.gateway import command
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.loop import GatewayAgentLoop, ProgramError, close_gateway, run_program
from streamrl.rollout.types import TrajectoryStatus
from tests.rollout.gateway.conftest import new_data
from tests.rollout.gateway.test_loop import loop_ctx
from tests.rollout.test_agent_loop import ANSWER

pytestmark = pytest.mark.timeout(90)

# One model call (an agent must make one), then what a shell the program starts sees: its environment.
ENV_PROGRAM = textwrap.dedent(
    """
    import json, os, subprocess, sys, urllib.request
    sample = json.loads(os.environ["STREAMRL_SAMPLE"])
    body = json.dumps({"model": "any", "messages": sample["messages"]}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
        headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    urllib.request.urlopen(req).read()
    shell = subprocess.run(["sh", "-c", "env -0"], capture_output=True, check=True).stdout.decode()
    env = dict(line.split("=", 1) for line in shell.split("\\0") if line)
    with open(sys.argv[1], "w") as f:
        json.dump(env, f)
    """
)


async def test_a_command_and_its_shells_get_no_ground_truth_and_none_of_the_workers_env(
    tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("STREAMRL_TEST_WORKER_SECRET", "sk-worker-secret")
    monkeypatch.setenv("STREAMRL_TEST_PASSED", "wanted")
    out = tmp_path / "env.json"
    ctx, _ = loop_ctx(
        tiny_tokenizer,
        [ANSWER],
        command=[sys.executable, "-c", ENV_PROGRAM, str(out)],
        env_passthrough=["STREAMRL_TEST_PASSED"],
    )
    data = new_data()
    data.extra_info = {"answer": "84"}
    data.tools_kwargs = {"calc": {"create_kwargs": {"ground_truth": "84"}}}
    try:
        traj = await asyncio.wait_for(GatewayAgentLoop(ctx).run(data), 60)
    finally:
        await close_gateway(ctx)
    assert traj.status is TrajectoryStatus.FINISHED
    env = json.loads(out.read_text())
    sample = json.loads(env["STREAMRL_SAMPLE"])
    assert set(sample) == {"trajectory_id", "group_id", "sample_index", "attempt", "messages", "data_source"}
    assert sample["messages"] == new_data().messages and "84" not in env["STREAMRL_SAMPLE"]
    assert "STREAMRL_TEST_WORKER_SECRET" not in env and "sk-worker-secret" not in json.dumps(env)
    assert env["STREAMRL_TEST_PASSED"] == "wanted"
    own = {"STREAMRL_BASE_URL", "STREAMRL_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY"}
    own |= {
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_API_KEY",
        "STREAMRL_SAMPLE",
        "STREAMRL_REWARD_FILE",
        "STREAMRL_METRICS_FILE",
        "STREAMRL_TEST_PASSED",
    }
    base = {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ"}
    shell = {"PWD", "SHLVL", "_", "OLDPWD"}  # what `sh` itself sets
    assert set(env) - own - base - shell == set()


async def test_a_command_writing_50_mb_costs_the_worker_a_bounded_buffer():
    flood = "import sys\nfor _ in range(50):\n    sys.stdout.buffer.write(b'x' * (1 << 20) + b'\\n')\nprint(0.5)"
    cfg = GatewayConfig(command=[sys.executable, "-c", flood], timeout_s=60)
    tracemalloc.start()
    try:
        reward = await run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reward == 0.5  # the last line is kept
    assert peak < 4 << 20, f"the worker held {peak / 2**20:.0f} MiB of the command's output"


# Starts `sleep 60` twice, both holding its stdout, one in a session of its own (out of reach of a
# process-group kill); writes their pids (and its own) to argv[1]; then exits, or with argv[2] hangs.
LEAVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    kept = subprocess.Popen(["sleep", "60"])
    away = subprocess.Popen(["sleep", "60"], start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{kept.pid} {away.pid} {os.getpid()}")
    print(0.5, flush=True)
    if len(sys.argv) > 2:
        time.sleep(60)
    os._exit(0)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie is dead, only not yet reaped by its new parent


def _reap_check(pids: list[int]) -> list[int]:
    """The pids still alive (after a short wait), killed so a failing test leaves nothing behind."""
    deadline = time.monotonic() + 2.0
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


async def test_a_command_that_exits_ends_the_call_and_its_left_children_die(tmp_path):
    pids = tmp_path / "pids"
    cfg = GatewayConfig(command=[sys.executable, "-c", LEAVER, str(pids)], timeout_s=15)
    started = time.monotonic()
    try:
        reward = await run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []})
        elapsed = time.monotonic() - started
    finally:
        left = _reap_check([int(p) for p in pids.read_text().split()])
    assert reward == 0.5 and elapsed < 5.0, f"the call took {elapsed:.1f} s"
    assert left == []  # the plain child and the setsid one


async def test_a_command_past_its_timeout_dies_with_all_it_started(tmp_path):
    pids = tmp_path / "pids"
    cfg = GatewayConfig(command=[sys.executable, "-c", LEAVER, str(pids), "hang"], timeout_s=3)
    started = time.monotonic()
    try:
        with pytest.raises(ProgramError, match="did not exit within"):
            await run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []})
        elapsed = time.monotonic() - started
    finally:
        left = _reap_check([int(p) for p in pids.read_text().split()])
    assert elapsed < 8.0 and left == []  # the program, its child and its setsid child


# A rollout worker reduced to what runs a command: `run_program` on an event loop in a thread of its
# own (a Ray async actor's loop runs in one, and the parent-death signal follows the thread that forked).
WORKER = textwrap.dedent(
    """
    import asyncio, sys, threading
    import streamrl.rollout.agent_loop  # first, as in the worker: it registers the loops, the gateway's too
    from streamrl.rollout.gateway.config import GatewayConfig
    from streamrl.rollout.gateway.loop import run_program
    cfg = GatewayConfig(command=sys.argv[1:], timeout_s=120)
    call = run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []})
    loop = threading.Thread(target=asyncio.run, args=(call,))
    loop.start()
    loop.join()
    """
)


def test_a_sigkilled_worker_leaves_no_command_process_behind(tmp_path):
    """After a worker dies its trajectories resume in another worker: a surviving program (or a tool it
    started) would run twice, both against the same environment and files."""
    pids = tmp_path / "pids"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, sys.executable, "-c", LEAVER, str(pids), "hang"])
    started: list[int] = []
    try:
        deadline = time.monotonic() + 30.0
        while len(started) < 3 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.05)
            started = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        assert len(started) == 3, f"the command did not start (worker exit status {worker.poll()})"
        worker.kill()
        worker.wait(10)
        deadline = time.monotonic() + 5.0
        while any(map(_alive, started)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if worker.poll() is None:
            worker.kill()
        left = _reap_check(started)
    assert left == [], "alive after the worker was SIGKILLed: the program, its child and its setsid child"


# Writes argv[1] (unless "-") to its reward file, then prints argv[2] as its last stdout line.
REWARDER = textwrap.dedent(
    """
    import os, sys
    if sys.argv[1] != "-":
        with open(os.environ["STREAMRL_REWARD_FILE"], "w") as f:
            f.write(sys.argv[1])
    print("agent log line")
    print(sys.argv[2])
    """
)


async def _reward_of(*argv: str) -> float | None:
    cfg = GatewayConfig(command=[sys.executable, "-c", REWARDER, *argv], timeout_s=30)
    return await run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []})


async def test_a_command_reward_is_its_reward_file_not_the_number_it_prints_last():
    """A math agent that prints the model's final answer last ("84") is not rewarded 84."""
    assert await _reward_of("0.75\n", "84") == 0.75
    assert await _reward_of("", "84") is None  # an empty file: no reward, the reward function scores


async def test_a_bare_number_on_the_last_line_counts_only_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(command, "_warned_bare_number", False)
    with caplog.at_level(logging.WARNING, logger=command.__name__):
        assert await _reward_of("-", "84") == 84.0  # the old protocol, which the docs promised
        assert await _reward_of("-", "0.5") == 0.5
    warnings = [r.getMessage() for r in caplog.records if "STREAMRL_REWARD_FILE" in r.getMessage()]
    assert len(warnings) == 1 and "(84)" in warnings[0], warnings  # once per worker process
    assert await _reward_of("-", "no number") is None


@pytest.mark.parametrize(
    ("written", "says"),
    [("correct", "not one number"), ("0.5 0.5", "not one number"), ("nan", "non-finite"), ("1" * 2000, "over")],
)
async def test_a_reward_file_that_is_not_one_finite_number_fails_the_program(written, says):
    with pytest.raises((ProgramError, RewardError), match=says):
        await _reward_of(written, "0.5")


async def test_a_reward_file_replaced_by_a_fifo_or_a_link_fails_without_hanging(tmp_path):
    """A model's shell can touch the file: the worker must not block opening a FIFO nobody writes, nor
    read through a link."""
    target = tmp_path / "elsewhere"
    target.write_text("1.0")
    for make in ("os.mkfifo(p)", f"os.symlink({str(target)!r}, p)"):
        program = f"import os; p = os.environ['STREAMRL_REWARD_FILE']; {make}"
        cfg = GatewayConfig(command=[sys.executable, "-c", program], timeout_s=30)
        with pytest.raises(ProgramError, match="reward file"):
            await asyncio.wait_for(run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []}), 10)


async def _metrics_of(program: str) -> tuple[float | None, list[dict[str, float]]]:
    """A command that runs `program` (with `p` = the metrics file's name) and writes the reward 0.5."""
    setup = "import json, os; p = os.environ['STREAMRL_METRICS_FILE']; "
    write_reward = "open(os.environ['STREAMRL_REWARD_FILE'], 'w').write('0.5')"
    cfg = GatewayConfig(command=[sys.executable, "-c", f"{setup}{program}\n{write_reward}"], timeout_s=30)
    reported: list[dict[str, float]] = []
    reward = await asyncio.wait_for(
        run_program(cfg, "http://127.0.0.1:1/v1", "token", {"messages": []}, on_metrics=reported.append), 10
    )
    return reward, reported


async def test_a_commands_metrics_file_reports_named_numbers_beside_its_reward():
    program = "json.dump({'exit_submitted': 1, 'model_calls': 3.5}, open(p, 'w'))"
    assert await _metrics_of(program) == (0.5, [{"exit_submitted": 1.0, "model_calls": 3.5}])
    assert await _metrics_of("pass") == (0.5, [{}])  # none written: nothing reported, nothing wrong


@pytest.mark.parametrize(
    ("program", "says"),
    [
        ("open(p, 'w').write('not json')", "not JSON"),
        ("json.dump([1, 2], open(p, 'w'))", "not a JSON object"),
        ("json.dump({f'k{i}': 1 for i in range(17)}, open(p, 'w'))", "at most 16 names"),
        ("json.dump({'Exit/Status': 1}, open(p, 'w'))", "is not"),
        ("json.dump({'steps': 'three'}, open(p, 'w'))", "not a finite number"),
        ("json.dump({'steps': True}, open(p, 'w'))", "not a finite number"),
        ("open(p, 'w').write('{\"steps\": NaN}')", "not a finite number"),
        ("open(p, 'w').write('[' * 100000)", "over 4096 bytes"),
        ("os.mkfifo(p)", "not a regular file"),
        ("os.symlink('/etc/hostname', p)", "cannot read it"),
    ],
)
async def test_a_metrics_file_that_is_not_named_numbers_is_ignored_and_the_sample_stands(program, says, caplog):
    with caplog.at_level(logging.WARNING, logger=command.__name__):
        assert await _metrics_of(program) == (0.5, [{}])
    (warning,) = [r.getMessage() for r in caplog.records if "STREAMRL_METRICS_FILE" in r.getMessage()]
    assert says in warning, warning


def test_a_worker_keeps_a_bounded_set_of_program_metric_names():
    from streamrl.rollout.gateway.server import MAX_PROGRAM_NAMES, GatewayServer
    from streamrl.streaming.step_metrics import rollout_interval_metrics

    server = GatewayServer(GatewayConfig(command=["true"]))
    server.account_program({})  # a sample that left none: not counted
    assert "rollout/program/num_samples" not in server.metrics()
    server.account_program({"exit_submitted": 1.0, "model_calls": 3.0})
    server.account_program({"exit_limitsexceeded": 1.0, "model_calls": 5.0})
    server.account_program({"exit_limitsexceeded": 1.0, "model_calls": 1.0})
    metrics = server.metrics()
    assert (metrics["rollout/program/model_calls/sum"], metrics["rollout/program/num_samples"]) == (9.0, 3.0)
    derived = rollout_interval_metrics(metrics, 1.0)
    assert derived["rollout/program/model_calls/mean"] == 3.0
    assert derived["rollout/program/exit_submitted/mean"] == pytest.approx(1 / 3)  # a flag: its share
    assert derived["rollout/program/exit_limitsexceeded/mean"] == pytest.approx(2 / 3)
    for i in range(2 * MAX_PROGRAM_NAMES):  # a program inventing a name per sample
        server.account_program({f"n{i}": 1.0})
    assert len(server.program_sums) == MAX_PROGRAM_NAMES
    assert server.program_sums["model_calls"] == 9.0
