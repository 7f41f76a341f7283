"""Run a gateway `command` program (`rollout.agent.gateway.command`) for one sample.

The command is the config's code, but the model drives it: its tools and shells run what the model
writes, and every process it starts inherits its environment. So it gets a minimal environment
(`command_env`, docs/security.md): PATH, HOME, TMPDIR and the locale of the worker, the session's own
URL and bearer token, the sample without its ground truth or reward metadata (`COMMAND_SAMPLE_FIELDS`),
and only the worker variables the config names in `env_passthrough`. Nothing else of the worker's
(API keys, credentials, the answers the reward function compares against) gets in.

It runs under a supervisor (`supervisor.py`), the subreaper of everything it starts: the call ends
when the command exits, and whatever it left running (children holding its stdout, `setsid` daemons)
is killed then, at the timeout, on cancellation, or when the worker dies.

Its stdout and stderr are kept up to `max_output_bytes` each (the first and last halves; the bytes
between are counted and dropped), so a program that writes without end costs the worker no memory.

It may also leave named numbers of its sample in the file named by `STREAMRL_METRICS_FILE` (a JSON
object such as `{"exit_submitted": 1, "steps": 3}`), which the run logs as per-sample means
(`rollout/program/<name>/mean`): how a harness's episodes ended, what its rubric's parts scored. They
are advisory: a file that is not such an object is ignored with a warning, and the sample stands.

Its reward is what it writes to the file named by `STREAMRL_REWARD_FILE` (one number; a file of its
own in a fresh private directory, read once the command exits). No file or an empty one: None, and the
reward function scores the conversation. Stdout is not a reward channel, because programs print what
the model says (a math agent's last line is often the model's answer, a number): a bare number on its
last line still counts when no reward file was written, as the gateway docs promised, but with a
warning, once per worker, since that number may be the model's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamrl.core.aio import observe_outcome
from streamrl.rollout.agent_loop.scoring import finite
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.tools.sandbox.execute import CappedStream

logger = logging.getLogger(__name__)

# What a command sees of its sample. Not `ground_truth`, `raw_ground_truth`, `extra_info` (the reward
# function's inputs) or `tools_kwargs` (per-sample arguments of streamrl's own tools, which may hold
# the answer too): a program could hand them to the model, or the model's shell could read them.
COMMAND_SAMPLE_FIELDS = ("trajectory_id", "group_id", "sample_index", "attempt", "messages", "data_source")
# The worker variables every command gets (those that are set): where programs are, a home and a
# temporary directory, the locale. Anything more is named in `env_passthrough`.
BASE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
SUPERVISOR = str(Path(__file__).with_name("supervisor.py"))  # run as a script: standard library only
EXIT_POLL_S = 0.02  # how often a running command's supervisor is checked for its exit
GRACE_S = 1.0  # after the supervisor exits or is told to, how long its pipes may take to close
REWARD_FILE_ENV = "STREAMRL_REWARD_FILE"
MAX_REWARD_FILE_BYTES = 1024  # a number, with room for whitespace: more is not a reward
METRICS_FILE_ENV = "STREAMRL_METRICS_FILE"
MAX_METRICS_FILE_BYTES = 4096
MAX_METRICS_PER_SAMPLE = 16
METRIC_NAME = re.compile(r"[a-z0-9_]{1,48}")  # one path segment of `rollout/program/<name>/...`
_warned_bare_number = False  # the stdout fallback's warning is given once per worker process


class ProgramError(RuntimeError):
    """The user program failed (raised, exited non-zero, or ran past its timeout)."""


def _ignore() -> None:
    """A command that writes a lot is not killed for it (its output is only cut): its timeout bounds it."""


def command_env(cfg: GatewayConfig, base_url: str, token: str, sample: dict[str, Any], private: Path) -> dict[str, str]:
    """The command's whole environment (see the module docstring)."""
    env = {name: os.environ[name] for name in (*BASE_ENV, *cfg.env_passthrough) if name in os.environ}
    env.setdefault("PATH", DEFAULT_PATH)
    return env | {
        "STREAMRL_BASE_URL": base_url,
        "STREAMRL_API_KEY": token,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": token,
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": token,
        "STREAMRL_SAMPLE": json.dumps({name: sample[name] for name in COMMAND_SAMPLE_FIELDS if name in sample}),
        REWARD_FILE_ENV: str(private / "reward"),
        METRICS_FILE_ENV: str(private / "metrics"),
    }


async def run_command(
    cfg: GatewayConfig,
    base_url: str,
    token: str,
    sample: dict[str, Any],
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> float | None:
    """Run the command once for a sample, under its supervisor; returns its reward (None: none given).
    `on_metrics` gets the named numbers it left, once it exited 0 (`read_metrics`)."""
    with tempfile.TemporaryDirectory(prefix="streamrl-reward-", ignore_cleanup_errors=True) as private:  # 0700
        reward = await _run(cfg, base_url, token, sample, Path(private))
        if on_metrics is not None:
            on_metrics(read_metrics(cfg.command[0] if cfg.command else "?", Path(private) / "metrics"))
        return reward


async def _run(cfg: GatewayConfig, base_url: str, token: str, sample: dict[str, Any], private: Path) -> float | None:
    assert cfg.command is not None
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-I", "-S", SUPERVISOR, str(os.getpid()), *cfg.command],
        env=command_env(cfg, base_url, token, sample, private),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None, "started with pipes"
    # Only the first and last halves of `max_output_bytes` of each stream are kept, the rest counted:
    # a program's output is read into the worker's memory, and it may write without end.
    out, err = (CappedStream(cfg.max_output_bytes, sys.maxsize, _ignore) for _ in range(2))
    drains = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr))
    observe_outcome(drains)  # the output is read from `out` and `err`, whatever ended the drains
    try:
        await asyncio.wait_for(_exited(proc), cfg.timeout_s)
    except TimeoutError:
        raise ProgramError(f"command {cfg.command[0]} did not exit within {cfg.timeout_s:g} s") from None
    finally:
        await _end(proc, drains)
    if out.cut or err.cut:
        logger.info("command %s: %d bytes of its output not kept", cfg.command[0], out.cut + err.cut)
    if proc.returncode != 0:
        tail = err.text()[-500:]
        raise ProgramError(f"command {cfg.command[0]} exited with {proc.returncode}: {tail}")
    return read_reward(cfg.command[0], private / "reward", out.text())


def read_metrics(name: str, metrics_file: Path) -> dict[str, float]:
    """The named numbers command `name` left at `metrics_file` ({} when it wrote none): a JSON object
    of at most `MAX_METRICS_PER_SAMPLE` names (`METRIC_NAME`) to finite numbers, in a small regular
    file (opened as the reward file is). Anything else is ignored with a warning: they are advisory."""
    name = f"{name} (${METRICS_FILE_ENV})"
    try:
        raw = _read_left_file(metrics_file, MAX_METRICS_FILE_BYTES)
    except OSError as exc:
        return _ignored(name, f"cannot read it: {exc}")
    if raw is None:
        return {}
    if len(raw) > MAX_METRICS_FILE_BYTES:
        return _ignored(name, f"over {MAX_METRICS_FILE_BYTES} bytes")
    try:
        metrics = json.loads(raw)
    except (ValueError, RecursionError):
        return _ignored(name, "not JSON")
    return checked_metrics(name, metrics)


def checked_metrics(name: str, metrics: object) -> dict[str, float]:
    """`metrics` if it is a mapping of at most `MAX_METRICS_PER_SAMPLE` names (`METRIC_NAME`) to finite
    numbers, as floats; anything else is ignored with a warning ({}): program metrics are advisory."""
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS_PER_SAMPLE:
        return _ignored(name, f"not a JSON object of at most {MAX_METRICS_PER_SAMPLE} names")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not METRIC_NAME.fullmatch(key):
            return _ignored(name, f"name {str(key)[:60]!r} is not {METRIC_NAME.pattern}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return _ignored(name, f"{key} = {str(value)[:60]!r} is not a finite number")
        out[key] = float(value)
    return out


def _read_left_file(path: Path, limit: int) -> bytes | None:
    """What a command left at `path` (None: nothing), at most `limit` + 1 bytes. The command's tools
    and shells could have put anything there: it is opened without following a link or waiting on a
    FIFO, and anything but a regular file raises OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # ELOOP: a symbolic link
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        return f.read(limit + 1)


def _ignored(name: str, why: str) -> dict[str, float]:
    logger.warning("program %s: its metrics are ignored: %s", name, why)
    return {}


def read_reward(name: str, reward_file: Path, stdout: str) -> float | None:
    """The reward of command `name` once it exited 0 (see the module docstring). What the command left
    at `reward_file` is opened without following a link or waiting on a FIFO and read up to a bound:
    anything but a small regular file holding one finite number fails the program."""
    try:
        raw = _read_left_file(reward_file, MAX_REWARD_FILE_BYTES)
    except OSError as exc:
        raise ProgramError(f"command {name}: cannot read its reward file ${REWARD_FILE_ENV}: {exc}") from None
    if raw is None:
        return _bare_number(name, stdout)
    if len(raw) > MAX_REWARD_FILE_BYTES:
        raise ProgramError(f"command {name} wrote over {MAX_REWARD_FILE_BYTES} bytes to ${REWARD_FILE_ENV}")
    text = raw.decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ProgramError(f"command {name} wrote {text[:80]!r} to ${REWARD_FILE_ENV}: not one number") from None
    return finite(f"the reward of command {name}", value)


def _bare_number(name: str, stdout: str) -> float | None:
    """The old protocol: a number alone on the last non-blank stdout line is the reward (a warning)."""
    global _warned_bare_number
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        value = float(lines[-1]) if lines else None
    except ValueError:
        return None
    if value is None:
        return None
    if not _warned_bare_number:
        _warned_bare_number = True
        logger.warning(
            "command %s wrote no reward file; the bare number on its last stdout line (%s) is taken as its "
            "reward. Write the reward to $%s instead: a number the program prints last (the model's answer, "
            "a tool's output) would otherwise be trained on as a reward. (warned once per worker)",
            name,
            lines[-1].strip()[:40],
            REWARD_FILE_ENV,
        )
    return finite(f"the reward of command {name}", value)


async def _exited(proc: asyncio.subprocess.Process) -> int:
    """The supervisor's exit status, as soon as it exits. Not `proc.wait()`: on Python 3.11 that also
    waits for the pipes to close, which a process out of the supervisor's reach may hold open."""
    while proc.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)
    return proc.returncode


async def _end(proc: asyncio.subprocess.Process, drains: asyncio.Future) -> None:
    """Leave nothing of the command running and stop reading its pipes. After a normal exit the
    supervisor has killed the whole tree already; at the timeout or on cancellation SIGTERM makes it
    do so now. What still holds the pipes a grace period later escaped it (the command killed its own
    supervisor): its process group is killed (a `setsid` process there is out of reach, see
    docs/security.md) and the pipes are closed on this side, so the call never waits on it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_exited(proc), GRACE_S)
    if proc.returncode is None:
        _killpg(proc.pid)
        await _exited(proc)
    done, _ = await asyncio.wait({drains}, timeout=GRACE_S)
    if not done:
        _killpg(proc.pid)  # the group outlives its leader while it has members: this pid is not reused
        done, _ = await asyncio.wait({drains}, timeout=GRACE_S)
    if not done:
        drains.cancel()
        transport = getattr(proc, "_transport", None)  # our ends of the pipes: nobody reads them now
        if transport is not None:
            transport.close()


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
