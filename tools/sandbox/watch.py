"""The sandbox's watch: what its first process does while the program runs, for what the kernel does
not do in that layer (part of the stages' program, see the end of this docstring).

- Isolation "none" has no pid namespace, whose end would take every process of the program along,
  and the program runs as the trainer's user, so it can kill its supervisor. The supervisor therefore
  traces the program (`Tracer`, ptrace): the kernel attaches every process and thread the program
  starts to the same tracer (PTRACE_O_TRACEFORK/VFORK/CLONE), a tracee cannot detach itself, and when
  the tracer dies, killed by the program or not, the kernel kills every tracee (PTRACE_O_EXITKILL), the
  ones sent off with setsid included. The tracer sees each new process at its fork, before it runs, so
  it also stops the sandbox at the first one past `processes`: RLIMIT_NPROC would count every process
  of the trainer's user there (the namespaced layers count the sandbox's own user namespace).
- Without a cgroup (`cgroup.py`) nothing in the kernel adds up the memory of a sandbox's processes:
  RLIMIT_AS bounds each one alone. The first process (init, or the supervisor) sums their memory every
  `WATCH_S` (`Budget`), and stops the whole sandbox once it passes `memory_mb`.

A sandbox stopped for its budget exits with `LIMIT_EXCEEDED` and a last stderr line
`LIMIT_MARKER <memory|processes>: <why>`, read by `execute.py`.

This file is appended to `stages.py` to make the stages' program (`sandbox.launch._child_source`), so it keeps
to the same rules: standard library only, os/signal at module level and the rest imported where used,
and no `from __future__` import (here it would not be the program's first statement).
"""

import os
import signal

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: the stages import nothing more
if TYPE_CHECKING:
    from typing import NoReturn

WATCH_S = 0.05  # how often the budget is checked: how long a burst of allocations can run past it
LIMIT_EXCEEDED = 124  # exit status of a sandbox stopped for going over its budget (reason on stderr)
LIMIT_MARKER = "streamrl-sandbox: limit:"
_WALL = 0x40000000  # waitpid's __WALL: threads' events too
_PTRACE_CONT, _PTRACE_GETEVENTMSG, _PTRACE_SEIZE, _PTRACE_LISTEN = 7, 0x4201, 0x4206, 0x4208
# TRACEFORK | TRACEVFORK | TRACECLONE | TRACEEXEC | EXITKILL
_TRACE_OPTIONS = 0x2 | 0x4 | 0x8 | 0x10 | 0x100000
_EVENT_FORK, _EVENT_VFORK, _EVENT_CLONE, _EVENT_EXEC, _EVENT_STOP = 1, 2, 3, 4, 128
_JOB_STOPS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


class LimitExceeded(Exception):
    """The sandbox went over its budget; the message says which limit first ("memory: ...")."""


class Tracer:
    """Every process and thread of the program, traced by this process (see the module docstring).
    Building one seizes `pid` (OSError where ptrace is not allowed: Yama, seccomp); `handle` books
    and resumes each stop. `processes`: the most tasks (processes and threads) alive at once."""

    def __init__(self, pid: int, processes: int | None) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.ptrace.restype = ctypes.c_long
        self.lib.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.processes = processes
        self.live = {pid}  # traced tasks alive
        self.started = {pid}  # tasks past their first stop (a seized task has none)
        self._ptrace(_PTRACE_SEIZE, pid, _TRACE_OPTIONS)

    def _ptrace(self, request: int, tid: int, data: int = 0, addr: int = 0) -> None:
        if self.lib.ptrace(request, tid, addr, data) == -1:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"ptrace: {os.strerror(errno)}")  # ESRCH: ProcessLookupError

    def _event_message(self, tid: int) -> int:
        message = self.ctypes.c_ulong()
        self._ptrace(_PTRACE_GETEVENTMSG, tid, self.ctypes.addressof(message))
        return message.value

    def handle(self, tid: int, status: int) -> None:
        """Book one traced task's stop or end (an `os.waitpid` status) and resume it as the program
        would run untraced. LimitExceeded when a new task passes `processes`."""
        if not os.WIFSTOPPED(status):
            self.live.discard(tid)
            self.started.discard(tid)
            return
        signum, event = os.WSTOPSIG(status), status >> 16
        try:
            if event in (_EVENT_FORK, _EVENT_VFORK, _EVENT_CLONE):  # counted before the parent goes on
                self._add(self._event_message(tid))
                self._ptrace(_PTRACE_CONT, tid)
            elif event == _EVENT_EXEC:  # a thread that ran execve takes its leader's id: its own is gone
                self.live.discard(self._event_message(tid))
                self.live.add(tid)
                self._ptrace(_PTRACE_CONT, tid)
            elif event == _EVENT_STOP and tid not in self.started:  # a new task's first stop (maybe
                self.started.add(tid)  # reported before its parent's fork event)
                self._add(tid)
                self._ptrace(_PTRACE_CONT, tid)
            elif event == _EVENT_STOP:  # a job-control stop: stay stopped until SIGCONT
                self._ptrace(_PTRACE_LISTEN if signum in _JOB_STOPS else _PTRACE_CONT, tid)
            else:  # a signal on its way to the task: deliver it
                self._ptrace(_PTRACE_CONT, tid, signum)
        except ProcessLookupError:  # killed meanwhile: a SIGKILL needs no resuming
            self.live.discard(tid)

    def _add(self, tid: int) -> None:
        self.live.add(tid)
        if self.processes is not None and len(self.live) > self.processes:
            raise LimitExceeded(
                f"processes: {len(self.live)} processes and threads, over the sandbox's limit of {self.processes}"
            )


class Budget:
    """The memory (and, untraced, the process) budget of the processes below `root`, checked by
    walking /proc. Memory is their resident size, and only past the limit their proportional size
    (shared pages split among the processes sharing them, as a cgroup charges them once)."""

    def __init__(self, root: int, *, memory_mb: int, processes: int | None = None) -> None:
        self.root, self.memory_mb, self.processes = root, memory_mb, processes
        self.page = os.sysconf("SC_PAGE_SIZE")

    def check(self) -> None:
        """LimitExceeded when the processes below `root` hold more than the budget."""
        pids = [pid for pid in _below(self.root) if _alive(pid)]
        if self.processes is not None:
            tasks = sum(_num_tasks(pid) for pid in pids)
            if tasks > self.processes:
                raise LimitExceeded(
                    f"processes: {tasks} processes and threads, over the sandbox's limit of {self.processes}"
                )
        limit = self.memory_mb << 20
        if sum(_resident_pages(pid) for pid in pids) * self.page <= limit:
            return
        used = sum(_proportional_bytes(pid, self.page) for pid in pids)
        if used > limit:
            raise LimitExceeded(
                f"memory: {used >> 20} MB in {len(pids)} processes, over the sandbox's limit of {self.memory_mb} MB"
            )


def wait_for(pid: int, tracer: Tracer | None, budget: Budget | None) -> int:
    """Reap every child (and book and resume every traced task) as soon as it stops or ends, until
    `pid` ends: its wait status. The budget is checked every `WATCH_S`; LimitExceeded when the
    sandbox went over it."""
    import time

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # collected by sigtimedwait below
    next_check = time.monotonic()
    while True:
        while True:
            reaped, status = os.waitpid(-1, os.WNOHANG | _WALL)  # `pid` is a child until reaped here
            if reaped == 0:
                break
            if tracer is not None:
                tracer.handle(reaped, status)
            if reaped == pid and not os.WIFSTOPPED(status):
                return status
        if budget is not None and time.monotonic() >= next_check:
            budget.check()
            next_check = time.monotonic() + WATCH_S
        signal.sigtimedwait({signal.SIGCHLD}, max(next_check - time.monotonic(), 0.001))


def stop_over_limit(exc: LimitExceeded) -> "NoReturn":  # quoted: no `from __future__` here (module docstring)
    """Kill every process below this one, say why on stderr (the program's) and exit."""
    kill_descendants()
    os.write(2, f"\n{LIMIT_MARKER} {exc}\n".encode())
    os._exit(LIMIT_EXCEEDED)


def kill_descendants() -> None:
    """SIGKILL every live process below this one and reap what is re-parented here, pass after pass,
    until none is left (a process forked between two passes is found by the next one)."""
    import time

    while True:
        below = [pid for pid in _below(os.getpid()) if _alive(pid)]
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG | _WALL)[0]:
                pass
        except ChildProcessError:
            pass
        if not below:
            return
        time.sleep(0.005)


def _below(root: int) -> list[int]:
    """The processes below `root`, zombies included: a walk of the tree through each task's
    /proc children list, or of the whole /proc where the kernel has no such lists."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _descendants(root)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def _descendants(root: int) -> list[int]:
    """The processes below `root`, from the parent of every process in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs still (a zombie has exited: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _resident_pages(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):  # gone meanwhile
        return 0


def _proportional_bytes(pid: int, page: int) -> int:
    """The process's proportional set size (its own pages, plus its share of each shared one)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError):
        pass
    return _resident_pages(pid) * page


def _num_tasks(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0
