"""Run a gateway `command` program (`rollout.agent.gateway.command`) for one sample.

The command is the config's code, but the model drives it: its tools and shells run what the model
writes, and every process it starts inherits its environment. So it gets a minimal environment
(`command_env`, docs/security.md): PATH, HOME, TMPDIR and the locale of the worker, the session's own
URL and bearer token, the sample without its ground truth or reward metadata (`COMMAND_SAMPLE_FIELDS`),
and only the worker variables the config names in `env_passthrough`. Nothing else of the worker's
(API keys, credentials, the answers the reward function compares against) gets in.

Its stdout and stderr are kept up to `max_output_bytes` each (the first and last halves; the bytes
between are counted and dropped), so a program that writes without end costs the worker no memory.
The reward is the last non-blank line of its stdout when that parses as a number, else None (the
reward function scores the conversation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any

from streamrl.rollout.agent_loop.scoring import finite
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.tools.sandbox.execute import _CappedStream

logger = logging.getLogger(__name__)

# What a command sees of its sample. Not `ground_truth`, `raw_ground_truth`, `extra_info` (the reward
# function's inputs) or `tools_kwargs` (per-sample arguments of streamrl's own tools, which may hold
# the answer too): a program could hand them to the model, or the model's shell could read them.
COMMAND_SAMPLE_FIELDS = ("trajectory_id", "group_id", "sample_index", "attempt", "messages", "data_source")
# The worker variables every command gets (those that are set): where programs are, a home and a
# temporary directory, the locale. Anything more is named in `env_passthrough`.
BASE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class ProgramError(RuntimeError):
    """The user program failed (raised, exited non-zero, or ran past its timeout)."""


def _ignore() -> None:
    """A command that writes a lot is not killed for it (its output is only cut): its timeout bounds it."""


def command_env(cfg: GatewayConfig, base_url: str, token: str, sample: dict[str, Any]) -> dict[str, str]:
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
    }


async def run_command(cfg: GatewayConfig, base_url: str, token: str, sample: dict[str, Any]) -> float | None:
    """Run the command once for a sample; returns its reward (None: none given)."""
    assert cfg.command is not None
    proc = await asyncio.create_subprocess_exec(
        *cfg.command,
        env=command_env(cfg, base_url, token, sample),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None, "started with pipes"
    # Only the first and last halves of `max_output_bytes` of each stream are kept, the rest counted:
    # a program's output is read into the worker's memory, and it may write without end.
    out, err = (_CappedStream(cfg.max_output_bytes, sys.maxsize, _ignore) for _ in range(2))
    try:
        await asyncio.wait_for(
            asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr), proc.wait()), cfg.timeout_s
        )
    except TimeoutError:
        raise ProgramError(f"command {cfg.command[0]} did not exit within {cfg.timeout_s:g} s") from None
    finally:
        if proc.returncode is None:  # timed out or cancelled: the program's whole process group goes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    if out.cut or err.cut:
        logger.info("command %s: %d bytes of its output not kept", cfg.command[0], out.cut + err.cut)
    if proc.returncode != 0:
        tail = err.text()[-500:]
        raise ProgramError(f"command {cfg.command[0]} exited with {proc.returncode}: {tail}")
    lines = [line for line in out.text().splitlines() if line.strip()]
    try:
        value = float(lines[-1]) if lines else None
    except ValueError:
        return None
    return None if value is None else finite(f"the reward of command {cfg.command[0]}", value)
