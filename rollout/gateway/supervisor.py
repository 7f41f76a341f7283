"""The supervisor of one gateway `command` program: its parent, and the subreaper of everything it starts.

    worker ──► python -I -S supervisor.py <worker pid> <command...> ──fork/exec──► command ──► its tools...

A program that exits may leave children behind, holding its stdout (the worker would wait for EOF) or
sent off with `setsid` (out of reach of a process-group kill). As the child subreaper (PR_SET_CHILD_SUBREAPER)
this process inherits every orphan below it, so once the command exits it kills every process still
below it, walking /proc, and only then exits, with the command's status (128 + the signal that killed
it). SIGTERM does the same at once: the worker sends it at the timeout or on cancellation, and the
kernel sends it when the worker dies (PR_SET_PDEATHSIG), so a killed worker leaves no program behind.

Run as a script with the standard library only (`-I -S`: nothing of the worker's environment or
packages is imported). The sandbox's isolation "none" supervises its programs the same way
(`tools/sandbox/stages.py`), for its own stage chain.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

SIGNAL_BASE = 128
NOT_STARTED = 127  # the command could not be executed (the shell's convention)
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def descendants(root: int) -> list[int]:
    """The live (not zombie) processes below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def kill_descendants() -> None:
    """SIGKILL every process below this one and reap what is re-parented here, pass after pass, until
    none is left (a process forked between two passes is found by the next one)."""
    while below := descendants(os.getpid()):
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.005)


def _stop(signum: int, frame: object) -> None:
    kill_descendants()
    os._exit(SIGNAL_BASE + signum)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}): {os.strerror(ctypes.get_errno())}")


def main(argv: list[str]) -> None:
    parent, command = int(argv[1]), argv[2:]
    signal.signal(signal.SIGTERM, _stop)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the worker died before the death signal was armed
        os._exit(SIGNAL_BASE + signal.SIGTERM)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"cannot run {command[0]!r}: {exc}\n".encode())
        os._exit(NOT_STARTED)
    # The pipes are the command's: the worker reads them to EOF, which comes when its last holder dies.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    while True:
        reaped, status = os.waitpid(-1, 0)
        if reaped == pid:
            break
    kill_descendants()
    if os.WIFSIGNALED(status):
        os._exit(SIGNAL_BASE + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv)
