"""A `server_command` engine drives only the server it started (engines/server_process.py): a port
that already answers is refused, a health answer from another process's socket is not adopted, and the
server dies with the engine's process (no orphan for the next engine on the URL). The "servers" are
small Python programs: an HTTP server answering /health, and a sleeper that never binds."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamrl.engines import make_engine, server_process
from streamrl.engines.config import EngineConfig
from streamrl.engines.http_server import ServerRequestError
from streamrl.engines.server_process import PortTakenError, ServerProcess

pytestmark = pytest.mark.timeout(60)

# Answers GET /health with 200 on 127.0.0.1:argv[1].
HEALTH_SERVER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers()\n"
    "        self.wfile.write(b'{}')\n"
    "    def log_message(self, *args): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)
# Writes its pid to argv[1] and sleeps: a server that never binds its port.
SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def server_cfg(port: int, command: list[str]) -> EngineConfig:
    return EngineConfig(
        backend="sglang_server",
        server_urls=[f"http://127.0.0.1:{port}"],
        server_command=command,
        startup_timeout_s=30,
    )


@pytest.fixture
def foreign_server():
    """Start a health server that this engine did not start on a port; stopped at teardown."""
    started: list[subprocess.Popen] = []

    def start(port: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(port)])
        started.append(proc)
        wait_for(lambda: server_process._accepts("127.0.0.1", port))
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_engine_drives_the_server_it_started():
    port = free_port()
    engine = make_engine(server_cfg(port, [sys.executable, "-c", HEALTH_SERVER, "{port}"]), "own")
    try:
        assert engine._process is not None and engine._process.process.poll() is None
    finally:
        engine._process.stop()
    assert not engine._process.group_alive()


def test_engine_whose_server_exited_does_not_ping_a_successor(foreign_server):
    """Once the server it started is gone, the engine is unhealthy even if another process answers on
    its port now."""
    port = free_port()
    engine = make_engine(server_cfg(port, [sys.executable, "-c", HEALTH_SERVER, "{port}"]), "own")
    assert asyncio.run(engine.ping()) == 0
    os.killpg(engine._process.process.pid, signal.SIGKILL)
    engine._process.process.wait()
    foreign_server(port)
    with pytest.raises(ServerRequestError, match="the server this engine started exited"):
        asyncio.run(engine.ping())
    engine._process.stop()


def test_port_that_already_answers_is_refused(foreign_server, monkeypatch, tmp_path):
    """An orphan (or another run's server) answering on the URL is never adopted: the command does
    not even start, and the error says why."""
    monkeypatch.setattr(server_process, "PORT_FREE_WAIT_S", 1.0)
    port = free_port()
    foreign_server(port)
    marker = tmp_path / "started"
    with pytest.raises(PortTakenError, match="already answers before its server_command started"):
        make_engine(server_cfg(port, [sys.executable, "-c", SLEEPER, str(marker)]), "adopter")
    time.sleep(0.5)
    assert not marker.exists()


def test_health_answered_by_another_process_is_not_adopted(foreign_server, tmp_path):
    """The port is free at the start, but another process binds it while our server is still starting
    (ours never binds): its health answer is refused, and our server is stopped."""
    port = free_port()
    pid_file = tmp_path / "server.pid"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            make_engine(server_cfg(port, [sys.executable, "-c", SLEEPER, str(pid_file)]), "racer")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
    foreign_server(port)
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PortTakenError), errors
    assert "is not the server this engine started" in str(errors[0])
    assert not alive(int(pid_file.read_text()))


# An engine process: starts a server (from a thread that then exits, as engines are built in worker
# threads) and waits to be killed.
ENGINE = (
    "import sys, threading, time\n"
    "from streamrl.engines.server_process import ServerProcess\n"
    "command = [sys.executable, '-c', sys.argv[1], sys.argv[2]]\n"
    "thread = threading.Thread(target=ServerProcess, args=(command, sys.argv[3]))\n"
    "thread.start(); thread.join()\n"
    "time.sleep(600)\n"
)


def test_server_dies_with_the_engine_process(tmp_path):
    pid_file = tmp_path / "server.pid"
    url = f"http://127.0.0.1:{free_port()}"
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, SLEEPER, str(pid_file), url])
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
        server_pid = int(pid_file.read_text())
        time.sleep(1.0)  # the starting thread is gone: the server must live on with its engine
        assert alive(server_pid)
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait()
        wait_for(lambda: not alive(server_pid), timeout_s=10.0)
    finally:
        engine.kill()
        engine.wait()
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_stop_ends_the_supervised_server(tmp_path):
    pid_file = tmp_path / "server.pid"
    server = ServerProcess([sys.executable, "-c", SLEEPER, str(pid_file)], f"http://127.0.0.1:{free_port()}")
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
    server.stop()
    assert server.process.poll() is not None and not server.group_alive()
    assert not alive(int(pid_file.read_text()))
