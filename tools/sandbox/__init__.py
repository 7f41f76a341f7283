"""Run untrusted Python in a sandbox that fails closed: isolation probe, limits, capped killable runs.

The code-interpreter tool runs model-written code with this module. Isolation is layered, and the
layer is chosen once, at start-up, by actually running a trivial program through it (`probe`):
bubblewrap if it works, else Linux namespaces through `unshare` (as root, unshare first: see
`probe`), else nothing — and "nothing" is a refusal (`IsolationUnavailable`) unless the user set
`isolation = "none"` explicitly, which keeps the limits, timeout, output cap and cleared environment.

What each layer adds (see `bench/sandbox.py` for the escape attempts each one stops):
- user namespace: the program has no capabilities (bounding set dropped, root locked out of them by
  securebits, no_new_privs), and when the trainer runs as root it runs as an unprivileged uid;
- mount namespace: a new root (tmpfs) holding only the system directories and the interpreter,
  bind-mounted read-only; a private, size-limited /workspace and /tmp; a read-only /proc that shows
  only the sandbox's processes; no /home, /root, /work, host /tmp, project or secrets;
- network namespace: only a down loopback, so no connection reaches the host or the internet;
- pid (+ ipc, uts) namespace: the host's processes are invisible and unkillable, and when the
  namespace's init exits or is killed every process in it dies;
- resource limits, set in the child by the trampoline (not `preexec_fn`, which is unsafe in a
  threaded parent): address space, CPU seconds, file size, open files, processes, no core dumps;
- always, whatever the layer: a cleared environment (no API keys), a fresh working directory, a
  wall-clock timeout that kills the whole sandbox, stdout/stderr capped in bytes (the middle
  is cut) and a kill when a program writes far more than the cap.
- lifetime, whatever the layer: every stage of the chain dies with its parent (`PR_SET_PDEATHSIG`),
  so a worker killed outright takes its sandboxes along. With "none" the first stage supervises: the
  subreaper and the tracer (ptrace) of everything the program starts, setsid or orphaned, it kills all
  of it when the program ends, the worker dies or the worker kills the sandbox, and the kernel kills
  all of it when the supervisor itself is killed (`sandbox/watch.py`). A record of each running
  sandbox lets the next worker sweep what a dead one left (`sandbox/reaper.py`);
- budget, whatever the layer: `memory_mb` and `processes` bound all the processes of a sandbox
  together. A cgroup v2 does it where one is writable (`sandbox/cgroup.py`); elsewhere the sandbox's
  first process adds up its processes' memory (`sandbox/watch.py`), and their number is bounded by
  RLIMIT_NPROC in the sandbox's user namespace or, with "none", by the supervisor's count at each fork.
  `describe` says which holds on this machine. At most `max_concurrent` sandboxes of this process run
  at once (`SLOTS`), the others wait;
- what the program sees of itself: /proc is mounted with hidepid, so init (non-dumpable) and its
  command line are hidden; a virtual environment appears at `VENV_MOUNT`, not at its host path; the
  hostname is `HOSTNAME`. The unshare layer also runs the program in a user namespace of its own,
  nested in the sandbox's, whose uid map names only the program's uid (not root, not the trainer's
  uid), in a cgroup namespace (/proc/self/cgroup shows "/"), and shows `MASKED_PROC` (the kernel's
  command line and config, the boot id, ...) empty. What stays visible, and why: docs/security.md.

The chain of processes (every stage is this file, run as `python -I -S -c <source> <stage> <spec>`,
which is why it imports only the standard library at module level):

    parent ──► launch ──► unshare ──► setup: pid 1 (mounts, pivot_root) = init ──fork──► (nested user
                                                                namespace) trampoline ──execve──► program
    parent ──► launch ──execve──► bwrap ──► init ──fork──► trampoline ──execve──► program
    parent ──► launch = supervisor (tracer) ──fork──► trampoline ──execve──► program   (isolation = "none")

Init (pid 1 of the sandbox) drops privileges, forks the program and exits with its status, or
128 + the signal that killed it. When the trainer runs as root, `launch` first enters a user
namespace whose uid map (written from outside, which needs root) holds both root and the sandbox
uid, so the setup can still read a root-only interpreter path while the program runs unprivileged.
In the unshare layer init forks the program's process into a user namespace of its own, nested in
that one, and maps only the program's uid there (`sandbox/stages.py`, `_fork_nested`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.tools.sandbox import cgroup as sandbox_cgroup
from streamrl.tools.sandbox import reaper as sandbox_reaper
from streamrl.tools.sandbox import watch as sandbox_watch
from streamrl.tools.sandbox.execute import (  # noqa: F401 (re-exported)
    SAFE_PATH,
    CappedStream,
    SandboxResult,
    _execute,
    _killpg,
)
from streamrl.tools.sandbox.launch import VENV_MOUNT, _argv_for, _child_source  # noqa: F401 (VENV_MOUNT re-exported)
from streamrl.tools.slots import Slots

logger = logging.getLogger(__name__)

ISOLATION_CHOICES = ("auto", "bwrap", "unshare", "none")
_SAFE_PATH = SAFE_PATH
DEFAULT_MAX_CONCURRENT = 16
# Sandboxes running at once in this process, whatever Sandbox started them (one worker builds one
# code interpreter; the last one built sets the limit).
SLOTS = Slots(DEFAULT_MAX_CONCURRENT)


class IsolationUnavailable(ValueError):
    """No isolation layer works and `isolation = "none"` was not chosen: the sandbox refuses to start."""


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    memory_mb: int = 1024  # all the sandbox's processes together (cgroup, else watched); also RLIMIT_AS of each
    cpu_s: int = 10  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL one second later
    file_mb: int = 16  # RLIMIT_FSIZE: larger writes fail with EFBIG
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # processes and threads together: pids.max, RLIMIT_NPROC per user namespace, or traced
    disk_mb: int = 64  # size of each private tmpfs (/workspace, /tmp); namespaced layers only


@dataclass(kw_only=True, slots=True)
class SandboxSettings:
    isolation: str = "auto"  # one of ISOLATION_CHOICES
    python: str | None = None  # interpreter of the program; None: this process's interpreter
    bwrap_path: str = "bwrap"
    unshare_path: str = "unshare"
    ro_paths: tuple[str, ...] = ()  # extra host paths shown read-only (e.g. a model-tools venv)
    sandbox_uid: int = 65534  # the program's uid when the trainer runs as root (namespaced layers)
    max_output_bytes: int = 8192  # per stream; the middle of longer output is cut
    kill_output_bytes: int = 4 << 20  # a stream longer than this kills the program
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # sandboxes running at once in this process
    cgroup: bool = True  # one memory and pids budget per sandbox where a cgroup v2 is writable
    registry_dir: str | None = None  # records of running sandboxes, private to this user; None: the default


@dataclass(kw_only=True, slots=True)
class ProbeReport:
    layer: str | None  # the layer chosen, None when none works
    tried: dict[str, str]  # layer -> "ok" or why it does not work


@dataclass(kw_only=True, slots=True)
class IsolationReport:
    """How the sandboxes of some settings are bounded on this machine: the layer, and for each limit
    whether it holds for all the sandbox's processes together (every layer has a way) and by what."""

    layer: str
    memory: str  # how memory_mb holds
    processes: str  # how processes holds
    leftovers: str  # what ends the processes a program leaves behind

    def line(self) -> str:
        return (
            f"isolation {self.layer}; memory: {self.memory}; processes: {self.processes}; leftovers: {self.leftovers}"
        )


# -- probe ------------------------------------------------------------------------------------------


def probe(settings: SandboxSettings) -> ProbeReport:
    """Try the layers `settings.isolation` allows, best first, by running a trivial program in each.

    Best is bwrap, then unshare; except as root, where unshare comes first: bwrap run by root makes
    no user namespace (one would map the program to root), so its program shares RLIMIT_NPROC with
    every process of the sandbox uid and may create user namespaces of its own."""
    if settings.isolation not in ISOLATION_CHOICES:
        raise ValueError(f"isolation must be one of {ISOLATION_CHOICES}, got {settings.isolation!r}")
    candidates = (settings.isolation,)
    if settings.isolation == "auto":  # as root, bwrap cannot give the program a user namespace of its
        candidates = ("unshare", "bwrap") if os.geteuid() == 0 else ("bwrap", "unshare")  # own
    tried: dict[str, str] = {}
    for layer in candidates:
        reason = _try_layer(layer, settings)
        tried[layer] = reason or "ok"
        if reason is None:
            return ProbeReport(layer=layer, tried=tried)
    return ProbeReport(layer=None, tried=tried)


def _try_layer(layer: str, settings: SandboxSettings) -> str | None:
    """None when `layer` runs a trivial program correctly, else why not."""
    token = "streamrl-sandbox-ok"
    with tempfile.TemporaryDirectory(prefix="streamrl-sandbox-probe-", ignore_cleanup_errors=True) as tmp:
        try:
            argv = _argv_for(layer, settings, f"print({token!r})", tmp)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={"PATH": _SAFE_PATH}, start_new_session=True)  # fmt: skip
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            return str(exc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.communicate()
            return "the probe program did not finish in 30 s"
    if proc.returncode == 0 and out.decode(errors="replace").strip() == token:
        return None
    detail = err.decode(errors="replace").strip()[-500:] or out.decode(errors="replace").strip()[-200:]
    return f"probe exited with status {proc.returncode}: {detail}"


# -- the sandbox ------------------------------------------------------------------------------------


class Sandbox:
    """A probed isolation layer, its settings and each run's budget. `run` is safe to call
    concurrently; at most `settings.max_concurrent` runs of this process go at once (`SLOTS`), the
    others wait. Building one also kills what workers that died left running (`sandbox_reaper.sweep`);
    `close` kills this process's running sandboxes (the worker's shutdown)."""

    def __init__(self, settings: SandboxSettings) -> None:
        if settings.sandbox_uid <= 0:
            raise ValueError(f"sandbox_uid must be a positive uid, got {settings.sandbox_uid}")
        if settings.max_concurrent <= 0:
            raise ValueError(f"max_concurrent must be positive, got {settings.max_concurrent}")
        self.settings = settings
        self.cgroups, self.budget_reason = (
            sandbox_cgroup.CgroupBudget.open() if settings.cgroup else (None, "cgroup budgets are turned off")
        )
        self.registry = sandbox_reaper.SandboxRegistry(sandbox_reaper.registry_root(settings.registry_dir))
        sandbox_reaper.sweep(self.registry.root, self.cgroups)
        self.report = probe(settings)
        self.layer: str = _chosen(self.report)
        trace = _check_trace() if self.layer == "none" else None
        self.isolation = _isolation(self.layer, settings, cgroup=self.cgroups is not None, trace=trace)
        logger.info("sandbox: %s", self.isolation.line())
        if trace not in (None, "ok"):
            logger.warning("sandbox isolation none without ptrace here (%s): %s", trace, self.isolation.leftovers)
        SLOTS.resize(settings.max_concurrent)

    @property
    def budget(self) -> str:
        """Who bounds the memory of all a sandbox's processes together: "cgroup" (the kernel) or "watch"
        (the sandbox's first process, `sandbox/watch.py`); `isolation` says how each limit holds."""
        return "cgroup" if self.cgroups is not None else "watch"

    async def run(
        self, program: str, stdin: bytes = b"", *, timeout_s: float, folders: Mapping[str, str] | None = None
    ) -> SandboxResult:
        """Run `program` (Python source) with `stdin`; never raises for what the program does.

        `folders` (name -> host directory) are shown read-write in the program's working directory as
        `./<name>`: what a program edits across runs (a repository). They are bound, not copied, so they
        are not counted in `disk_mb`; when the trainer runs as root the program runs as `sandbox_uid`
        and can write only what that uid may. With isolation "none" each is a symbolic link there."""
        queued = time.perf_counter()
        await SLOTS.acquire()
        try:
            queued_s = time.perf_counter() - queued
            with tempfile.TemporaryDirectory(prefix="streamrl-sandbox-", ignore_cleanup_errors=True) as tmp:
                cgroup = self._new_cgroup()
                try:
                    argv = _argv_for(self.layer, self.settings, program, tmp, cgroup, folders)
                    result = await _execute(argv, stdin, timeout_s, self.settings, self.layer, self.registry)
                finally:
                    exceeded = cgroup is not None and sandbox_cgroup.oom_killed(cgroup)
                    if cgroup is not None:
                        sandbox_cgroup.remove(cgroup, wait_s=0.5)  # the run's processes are gone already
            return dataclasses.replace(result, memory_exceeded=result.memory_exceeded or exceeded, queued_s=queued_s)
        finally:
            SLOTS.release()

    def _new_cgroup(self) -> Path | None:
        if self.cgroups is None:
            return None
        limits = self.settings.limits
        try:
            return self.cgroups.create(self.registry.owner, memory_mb=limits.memory_mb, processes=limits.processes)
        except OSError as exc:  # the kernel refused this once: the sandbox's first process watches the budget
            logger.warning("sandbox cgroup not created (%s); this run's first process watches its budget", exc)
            return None

    def close(self) -> None:
        """Kill the sandboxes this object runs (each call that ran one then returns its result)."""
        self.registry.kill_owned()


# -- what bounds a sandbox here ----------------------------------------------------------------------


def describe(settings: SandboxSettings) -> IsolationReport:
    """How a sandbox of `settings` is bounded on this machine, found as building a `Sandbox` finds it
    (probing the layers, the cgroup and, for "none", ptrace) but sweeping nothing; IsolationUnavailable
    when no layer works and "none" was not chosen."""
    layer = _chosen(probe(settings))
    cgroups, _ = sandbox_cgroup.CgroupBudget.open() if settings.cgroup else (None, "")
    trace = _check_trace() if layer == "none" else None
    return _isolation(layer, settings, cgroup=cgroups is not None, trace=trace)


def _chosen(report: ProbeReport) -> str:
    if report.layer is None:
        reasons = "; ".join(f"{k}: {v}" for k, v in report.tried.items())
        raise IsolationUnavailable(
            f"no sandbox isolation is available ({reasons}). Install bubblewrap or allow unprivileged user "
            'namespaces, or set isolation = "none" to run model code without isolation (not recommended).'
        )
    return report.layer


def _isolation(layer: str, settings: SandboxSettings, *, cgroup: bool, trace: str | None) -> IsolationReport:
    """What bounds a sandbox of `layer`: `cgroup` whether a cgroup budget is used, `trace` ("none"
    only) "ok" when the supervisor may trace its program, else why not."""
    watched = f"every {sandbox_watch.WATCH_S * 1000:.0f} ms"
    if cgroup:
        memory = "all processes together: the cgroup's memory.max"
        processes = "all processes together: the cgroup's pids.max"
    elif layer != "none":
        memory = f"all processes together: checked {watched} by the sandbox's init (a burst can pass it that long)"
        processes = "all processes together: RLIMIT_NPROC in the sandbox's user namespace"
        if layer == "bwrap" and os.geteuid() == 0:  # no user namespace: the sandbox uid's count
            processes = f"all sandboxes together: RLIMIT_NPROC of uid {settings.sandbox_uid}"
    else:
        memory = f"all processes together: checked {watched} by the supervisor (a burst can pass it that long)"
        processes = "all processes together: counted at each fork by the supervisor (ptrace)"
        if trace != "ok":
            processes = f"all processes together: counted {watched} by the supervisor (no ptrace here: {trace})"
    memory += "; RLIMIT_AS of each process"
    if layer != "none":
        leftovers = "the pid namespace: every process dies with the sandbox"
    elif trace == "ok":
        leftovers = "the supervisor traces every process (ptrace): all die with it, even when the program kills it"
    else:
        leftovers = (
            f"the supervisor's subreaper only (no ptrace here: {trace}): a program that kills its supervisor "
            "can leave processes behind"
        )
    return IsolationReport(layer=layer, memory=memory, processes=processes, leftovers=leftovers)


def _check_trace() -> str:
    """ "ok" when the "none" supervisor may trace its program on this machine, else why not."""
    argv = [os.path.realpath(sys.executable), "-I", "-S", "-c", _child_source(), "check-trace", "{}"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": _SAFE_PATH})
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return out.stdout.strip() or out.stderr.strip()[-200:] or f"exit status {out.returncode}"
