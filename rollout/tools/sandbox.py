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
  wall-clock timeout that SIGKILLs the whole process group, stdout/stderr capped in bytes (the middle
  is cut) and a kill when a program writes far more than the cap.

The chain of processes (every stage is this file, run as `python -I -S -c <source> <stage> <spec>`,
which is why it imports only the standard library at module level):

    parent ──► launch ──► unshare ──► setup: pid 1 (mounts, pivot_root) = init ──fork──► trampoline ──execve──► program
    parent ──► bwrap ──► init ──fork──► trampoline ──execve──► program
    parent ──► trampoline ──execve──► program                                  (isolation = "none")

Init (pid 1 of the sandbox) drops privileges, forks the program and exits with its status, or
128 + the signal that killed it. When the trainer runs as root, `launch` first enters a user
namespace whose uid map (written from outside, which needs root) holds both root and the sandbox
uid, so the setup can still read a root-only interpreter path while the program runs unprivileged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from streamrl.rollout.aio import observe_outcome
from streamrl.rollout.tools import sandbox_stages
from streamrl.rollout.tools.sandbox_stages import _MARKER, SETUP_FAILED, SIGNAL_BASE, WORKSPACE

ISOLATION_CHOICES = ("auto", "bwrap", "unshare", "none")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_GRACE_S = 2.0  # after a kill, how long the pipes may take to close
# System paths made visible read-only (those that exist; symlinks such as /bin -> usr/bin are copied).
_SYSTEM_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
)  # fmt: skip


class IsolationUnavailable(ValueError):
    """No isolation layer works and `isolation = "none"` was not chosen: the sandbox refuses to start."""


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    memory_mb: int = 1024  # RLIMIT_AS of the program
    cpu_s: int = 10  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL one second later
    file_mb: int = 16  # RLIMIT_FSIZE: larger writes fail with EFBIG
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC; namespaced layers only (counted per user namespace)
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


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    """One run. `exit_code` is None when a signal (`signal`) or the sandbox (`timed_out`,
    `output_killed`) ended the program; `setup_error` is set when the sandbox itself failed."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    output_killed: bool
    truncated_bytes: int  # bytes cut from the middle of stdout + stderr
    wall_s: float
    layer: str
    setup_error: str | None = None


@dataclass(kw_only=True, slots=True)
class ProbeReport:
    layer: str | None  # the layer chosen, None when none works
    tried: dict[str, str]  # layer -> "ok" or why it does not work


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
    """A probed isolation layer and the settings to run programs with; `run` is safe to call concurrently."""

    def __init__(self, settings: SandboxSettings) -> None:
        if settings.sandbox_uid <= 0:
            raise ValueError(f"sandbox_uid must be a positive uid, got {settings.sandbox_uid}")
        self.settings = settings
        self.report = probe(settings)
        if self.report.layer is None:
            reasons = "; ".join(f"{k}: {v}" for k, v in self.report.tried.items())
            raise IsolationUnavailable(
                f"no sandbox isolation is available ({reasons}). Install bubblewrap or allow unprivileged user "
                'namespaces, or set isolation = "none" to run model code without isolation (not recommended).'
            )
        self.layer: str = self.report.layer

    async def run(self, program: str, stdin: bytes = b"", *, timeout_s: float) -> SandboxResult:
        """Run `program` (Python source) with `stdin`; never raises for what the program does."""
        with tempfile.TemporaryDirectory(prefix="streamrl-sandbox-", ignore_cleanup_errors=True) as tmp:
            argv = _argv_for(self.layer, self.settings, program, tmp)
            return await _execute(argv, stdin, timeout_s, self.settings, self.layer)


# -- the parent side: commands ----------------------------------------------------------------------


def _argv_for(layer: str, settings: SandboxSettings, program: str, tmp: str) -> list[str]:
    """The command line of one run; `tmp` is an empty host directory it may use (the mount point of
    the new root, or the workdir when isolation is "none")."""
    stage = [os.path.realpath(sys.executable), "-I", "-S", "-c", _child_source()]
    spec = _spec(layer, settings, program, tmp)
    if layer == "none":
        return [*stage, "trampoline", json.dumps(spec)]
    if layer == "unshare":
        spec["unshare"] = _which(settings.unshare_path)
        return [*stage, "launch", json.dumps(spec)]
    if layer == "bwrap":
        return _bwrap_argv(_which(settings.bwrap_path), spec, stage)
    raise ValueError(f"unknown isolation layer {layer!r}")


def _spec(layer: str, settings: SandboxSettings, program: str, tmp: str) -> dict:
    python = _exec_path(settings.python or sys.executable)
    workdir = tmp if layer == "none" else WORKSPACE
    root = os.geteuid() == 0
    return {
        "layer": layer,
        "python": python,
        "program": program,
        "root": tmp,  # unshare: mount point of the new root
        "workdir": workdir,
        "uid": settings.sandbox_uid if root and layer != "none" else None,
        "limits": asdict(settings.limits),
        "mounts": _mounts(python, settings.ro_paths) if layer != "none" else [],
        "env": _program_env(workdir, "/tmp" if layer != "none" else tmp),
    }


def _program_env(home: str, tmpdir: str) -> dict[str, str]:
    """The program's whole environment: nothing of the trainer's (API keys, tokens) gets in."""
    return {
        "PATH": _SAFE_PATH, "HOME": home, "TMPDIR": tmpdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
        "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1", "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }  # fmt: skip


def _exec_path(python: str) -> str:
    """`python` with its directory resolved (a venv's bin/python symlink is kept: it selects the venv)."""
    found = shutil.which(python)
    if found is None:
        raise ValueError(f"python interpreter {python!r} not found")
    return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(found))), os.path.basename(found))


def _which(binary: str) -> str:
    found = shutil.which(binary)
    if found is None:
        raise ValueError(f"{binary!r} not found")
    return os.path.abspath(found)


@lru_cache(maxsize=16)
def _python_prefixes(python: str) -> tuple[str, ...]:
    code = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    return tuple(sorted({os.path.realpath(p) for p in json.loads(out.stdout)}))


def _mounts(python: str, extra: tuple[str, ...]) -> list[dict[str, str]]:
    """What the new root shows: system paths, both interpreters' prefixes, `extra`; all read-only."""
    stage_python = os.path.realpath(sys.executable)
    mounts, paths = [], set()
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            mounts.append({"kind": "symlink", "path": path, "target": os.readlink(path)})
        elif os.path.exists(path):
            paths.add(path)
    paths.update(_python_prefixes(python) + _python_prefixes(stage_python))
    paths.update(p for p in map(os.path.realpath, extra) if os.path.exists(p))
    for path in sorted(paths):  # a path under another one is already visible through it
        if not any(path.startswith(other.rstrip("/") + "/") for other in paths):
            mounts.append({"kind": "bind", "path": path})
    return mounts


def _bwrap_argv(bwrap: str, spec: dict, stage: list[str]) -> list[str]:
    """As root, bwrap gets no user namespace (it would map the program to root): init switches to the
    sandbox uid instead, whose RLIMIT_NPROC is then shared by concurrent sandboxes."""
    if spec["uid"] is None:
        argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
    else:
        argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--as-pid-1", "--die-with-parent", "--proc", "/proc", "--dev", "/dev"]  # init is pid 1
    size = str(spec["limits"]["disk_mb"] << 20)
    for path in ("/tmp", WORKSPACE):  # before the binds: an interpreter under /tmp stays visible
        argv += ["--perms", "1777", "--size", size, "--tmpfs", path]
    parents = {os.path.dirname(m["path"]) for m in spec["mounts"]}
    for parent in sorted({a for p in parents for a in _ancestors(p)}):  # else bwrap copies e.g. /root's 0700
        argv += ["--perms", "0755", "--dir", parent]
    for mount in spec["mounts"]:
        if mount["kind"] == "symlink":
            argv += ["--symlink", mount["target"], mount["path"]]
        else:
            argv += ["--ro-bind", mount["path"], mount["path"]]
    argv += ["--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv", "--setenv", "PATH", _SAFE_PATH]
    return [*argv, "--", *stage, "init", json.dumps(spec)]


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("/", ""):
        out.append(path)
        path = os.path.dirname(path)
    return out


@lru_cache(maxsize=1)
def _child_source() -> str:
    """The stages' program: the whole of `sandbox_stages.py`."""
    with open(sandbox_stages.__file__, encoding="utf-8") as f:
        return f.read()


# -- the parent side: one run -----------------------------------------------------------------------


class _CappedStream:
    """Keeps the first and last `cap / 2` bytes of a stream, counts the rest, and calls `on_flood` once
    the stream passes `kill_bytes` (it keeps draining, so the writer never blocks on a full pipe)."""

    def __init__(self, cap: int, kill_bytes: int, on_flood) -> None:
        self.head_cap, self.tail_cap = cap - cap // 2, cap // 2
        self.head, self.tail = bytearray(), bytearray()
        self.total, self.kill_bytes, self.on_flood, self.flooded = 0, kill_bytes, on_flood, False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.total += len(chunk)
            take = max(0, self.head_cap - len(self.head))
            self.head += chunk[:take]
            self.tail += chunk[take:]
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]
            if self.total > self.kill_bytes and not self.flooded:
                self.flooded = True
                self.on_flood()

    @property
    def cut(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self) -> str:
        if self.cut == 0:
            return (self.head + self.tail).decode(errors="replace")
        marker = f"\n...[truncated {self.cut} bytes]...\n"
        return self.head.decode(errors="replace") + marker + self.tail.decode(errors="replace")


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
        await writer.drain()
        writer.close()
    except (BrokenPipeError, ConnectionResetError):  # the program exited without reading its input
        pass


async def _execute(argv: list[str], stdin: bytes, timeout_s: float, settings: SandboxSettings, layer: str) -> SandboxResult:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={"PATH": _SAFE_PATH}, start_new_session=True,
    )  # fmt: skip

    def kill() -> None:  # the process group is the whole sandbox (start_new_session)
        _killpg(proc.pid)

    out = _CappedStream(settings.max_output_bytes, settings.kill_output_bytes, kill)
    err = _CappedStream(settings.max_output_bytes, settings.kill_output_bytes, kill)
    work = asyncio.ensure_future(asyncio.gather(_feed(proc.stdin, stdin), out.drain(proc.stdout), err.drain(proc.stderr), proc.wait()))
    # The outcome is read from the streams and the exit code, never from `work`: mark its exception as
    # seen, or a call cut off by its event loop closing logs "exception was never retrieved".
    observe_outcome(work)
    timed_out = False
    try:
        done, _ = await asyncio.wait({work}, timeout=timeout_s)
        timed_out = not done
    finally:
        if not work.done():  # timed out, or cancelled (the caller's own timeout): kill the whole sandbox and
            kill()  # wait until its pipes close, i.e. its last process is gone, so no call outlives its sandbox
            await asyncio.wait({work}, timeout=_GRACE_S)
        if not work.done():  # pipes still open after the kill: held by a process that left the group
            work.cancel()  # (only possible without a pid namespace)
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()
        if proc.returncode is None:  # cancelled (the caller's own timeout) or the pipes never closed
            kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), _GRACE_S)
    return _result(proc.returncode, out, err, timed_out, layer, time.perf_counter() - start)


def _result(rc: int | None, out: _CappedStream, err: _CappedStream, timed_out: bool, layer: str, wall_s: float) -> SandboxResult:
    stderr = err.text()
    flooded = out.flooded or err.flooded
    setup_error = None
    if rc == SETUP_FAILED and _MARKER in stderr:
        setup_error = stderr[stderr.index(_MARKER) :].strip()[:2000]
    sig = None
    if rc is not None and rc < 0:
        sig = -rc
    elif rc is not None and layer != "none" and SIGNAL_BASE < rc < SIGNAL_BASE + 65:
        sig = rc - SIGNAL_BASE
    ended_by_sandbox = timed_out or flooded or sig is not None or setup_error is not None
    return SandboxResult(
        stdout=out.text(), stderr=stderr, exit_code=None if ended_by_sandbox else rc, signal=sig,
        timed_out=timed_out, output_killed=flooded and not timed_out, truncated_bytes=out.cut + err.cut,
        wall_s=wall_s, layer=layer, setup_error=setup_error,
    )  # fmt: skip
