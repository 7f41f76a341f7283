"""Keep a `server_command` server from outliving the engine that started it.

`ServerProcess` runs this file by path (`python server_supervisor.py ENGINE_PID COMMAND...`, importing
nothing of streamrl) as the leader of a new process group; it starts COMMAND as its child, in that
group, and waits for whichever ends first:

- the server: the supervisor exits with the server's code (128 + N for a signal N);
- the engine's process ENGINE_PID (killed outright, the driver gone): it ends the whole group,
  SIGTERM, then SIGKILL after a grace period, so no orphan is left for a later engine to find on the
  same port.

The engine is watched through a pidfd, not `PR_SET_PDEATHSIG`: that signal fires when the *thread*
that started the child exits (engines are built in worker threads), and the engine lives on.
`ServerProcess.stop()` signals the whole group; the supervisor then waits for the server to go.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 15.0


def main(argv: list[str]) -> int:
    engine_pid, command = int(argv[0]), argv[1:]
    try:
        engine = os.pidfd_open(engine_pid)
    except ProcessLookupError:
        return 1
    if os.getppid() != engine_pid:  # the engine died before the watch was in place
        return 1
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # stop(): the server's exit ends us
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    watched = os.pidfd_open(server.pid)
    ready, _, _ = select.select([engine, watched], [], [])
    if watched not in ready:
        _end_group(server)
    code = server.wait()
    return code if code >= 0 else 128 - code


def _end_group(server: subprocess.Popen) -> None:
    """The engine is gone: end the server and everything in its group, this process last."""
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
