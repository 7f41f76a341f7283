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
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

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
    """The stages' program: the end of this file, after the standard imports it needs."""
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    return "from __future__ import annotations\nimport json, os, resource, sys\n" + source[source.rindex("# -- the child side: stages") :]


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
    timed_out = False
    try:
        done, _ = await asyncio.wait({work}, timeout=timeout_s)
        if not done:
            timed_out = True
            kill()
            await asyncio.wait({work}, timeout=_GRACE_S)
    finally:
        if not work.done():  # pipes still open after the kill: held by a process that left the group
            work.cancel()  # (only possible without a pid namespace)
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
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


# -- the child side: stages ------------------------------------------------------------------------
# Everything from here to the end is the stages' program (`_child_source`): standard library only,
# and only json/os/resource/sys at module level, so each stage starts in milliseconds; a module a
# stage needs after dropping privileges must be imported before (the interpreter may be unreadable).

WORKSPACE = "/workspace"
SETUP_FAILED = 125  # exit status of a stage that could not build the sandbox (reason on stderr)
SIGNAL_BASE = 128  # a namespaced sandbox exits 128 + N when its program was killed by signal N
_MARKER = "streamrl-sandbox:"  # prefix of the stages' own error messages on stderr
_DEVICES = ("null", "zero", "full", "random", "urandom")

_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 28, 38, 47, 4
# NOROOT(+LOCKED): uid 0 gets no capabilities from execve; KEEP_CAPS_LOCKED, NO_SETUID_FIXUP_LOCKED:
# a uid change keeps clearing them; NO_CAP_AMBIENT_RAISE(+LOCKED): no ambient capabilities.
_SECUREBITS = 0b1 | 0b10 | 0b1000 | 0b100000 | 0b1000000 | 0b10000000


class _Libc:
    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def call(self, what: str, rc: int) -> int:
        if rc != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")
        return rc

    def mount(self, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        enc = lambda s: None if s is None else s.encode()
        self.call(f"mount {dst}", self.lib.mount(enc(src), enc(dst), enc(fstype), self.ctypes.c_ulong(flags), enc(data)))


def _fail(stage: str, exc: BaseException) -> None:
    os.write(2, f"{_MARKER} {stage}: {exc}\n".encode())
    os._exit(SETUP_FAILED)


def _exit_like(status: int) -> None:
    """Exit with a child's wait status: the same code, or 128 + the signal that killed it."""
    if os.WIFSIGNALED(status):
        os._exit(SIGNAL_BASE + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _stage_launch(spec: dict) -> None:
    """Host side of the unshare layer: exec `unshare` into the namespaces, running `setup` inside."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    flags = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    tail = ["--", os.path.realpath(sys.executable), "-I", "-S", "-c", _stage_source(), "setup", json.dumps(spec)]
    try:
        if spec["uid"] is not None:  # root: a user namespace mapping root and the sandbox uid
            _enter_user_namespace(spec["uid"])
            os.execv(spec["unshare"], [spec["unshare"], *flags, *tail])
        os.execv(spec["unshare"], [spec["unshare"], "--user", "--map-root-user", *flags, *tail])
    except OSError as exc:
        _fail("launch", exc)


def _stage_source() -> str:
    argv = sys.orig_argv
    return argv[argv.index("-c") + 1]


def _enter_user_namespace(uid: int) -> None:
    """Fork; the child enters a new user namespace whose maps (root and `uid`) the parent writes — a
    map of more than one's own uid needs CAP_SETUID outside — and returns; the parent waits and exits
    like the child."""
    libc = _Libc()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        _die_with_parent()
        libc.call("unshare(CLONE_NEWUSER)", libc.lib.unshare(_CLONE_NEWUSER))
        os.write(ready_w, b"1")
        if os.read(go_r, 1) != b"1":
            raise OSError("the parent did not write the user namespace maps")
        os.close(ready_w)
        os.close(go_r)
        return
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) == b"1":
        maps = f"0 0 1\n{uid} {uid} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(maps)
        os.write(go_w, b"1")
    os.close(go_w)
    _exit_like(os.waitpid(pid, 0)[1])


def _stage_setup(spec: dict) -> None:
    """Pid 1 of the new namespaces: build the new root, pivot into it, then act as init."""
    try:
        _build_root(spec, _Libc())
    except OSError as exc:
        _fail("setup", exc)
    _stage_init(spec)


def _build_root(spec: dict, libc: _Libc) -> None:
    root, limits = spec["root"], spec["limits"]
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    libc.mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m")
    # The private tmpfs folders first, the read-only binds after: an interpreter that lives under
    # /tmp (a venv in a checkout there) is then bound on top of the private /tmp, not hidden by it.
    owner = f",uid={spec['uid']},gid={spec['uid']}" if spec["uid"] is not None else ""
    for path, mode in (("/tmp", "1777"), (WORKSPACE, "0755"), ("/dev/shm", "1777")):
        os.makedirs(root + path, exist_ok=True)
        libc.mount("tmpfs", root + path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode},size={limits['disk_mb']}m{owner}")
    for mount in spec["mounts"]:
        dst = root + mount["path"]
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if mount["kind"] == "symlink":
            os.symlink(mount["target"], dst)
        else:
            _bind_readonly(libc, mount["path"], dst)
    for name in _DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        libc.mount(f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    _write_passwd(root, spec["uid"] or 0)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:  # this namespace's own limit: the
        f.write("0")  # program cannot nest a user namespace (kernel attack surface) to regain capabilities
    os.makedirs(root + "/proc", exist_ok=True)
    libc.mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY)
    _pivot_root(libc, root)
    libc.mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _bind_readonly(libc: _Libc, src: str, dst: str) -> None:
    """Bind `src` (with its submounts) at `dst`, then make every mount there read-only, keeping the
    flags the kernel locks (a user namespace may not clear nosuid/nodev/noexec or change atime)."""
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        open(dst, "a").close()
    libc.mount(src, dst, None, _MS_BIND | _MS_REC)
    for mnt in _mount_points_under(dst):
        flags = os.statvfs(mnt).f_flag
        ms = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        for st, msf in ((os.ST_NOEXEC, _MS_NOEXEC), (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME)):
            ms |= msf if flags & st else 0
        libc.mount(None, mnt, None, ms)


def _mount_points_under(path: str) -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            if point == path or point.startswith(path + "/"):
                points.append(point)
    return sorted(set(points))


def _write_passwd(root: str, uid: int) -> None:
    os.makedirs(root + "/etc", exist_ok=True)
    with open(root + "/etc/passwd", "w") as f:
        f.write(f"sandbox:x:{uid}:{uid}:sandbox:{WORKSPACE}:/bin/sh\n")
    with open(root + "/etc/group", "w") as f:
        f.write(f"sandbox:x:{uid}:\n")


def _pivot_root(libc: _Libc, root: str) -> None:
    import platform

    os.chdir(root)
    os.mkdir(".oldroot")
    number = _PIVOT_ROOT_NR.get(platform.machine())
    if number is not None:
        libc.call("pivot_root", libc.lib.syscall(number, b".", b".oldroot"))
    else:
        import subprocess

        subprocess.run(["pivot_root", ".", ".oldroot"], check=True)
    os.chdir("/")
    libc.call("umount /.oldroot", libc.lib.umount2(b"/.oldroot", _MNT_DETACH))
    os.rmdir("/.oldroot")


def _stage_init(spec: dict) -> None:
    """Pid 1 of the sandbox: drop privileges, fork the program, reap, exit like it. The namespace
    dies with it, taking every process the program left behind. It stays in the parent's process
    group, so the parent's kill of the group reaches it whatever the program does with sessions."""
    try:
        _drop_privileges(spec["uid"])
        _die_with_parent()  # a uid change cleared the death signal unshare/bwrap had set
    except OSError as exc:
        _fail("init", exc)
    pid = os.fork()
    if pid == 0:
        _stage_trampoline(spec)
    while True:
        reaped, status = os.waitpid(-1, 0)
        if reaped == pid:
            _exit_like(status)


def _die_with_parent() -> None:
    libc = _Libc()
    libc.call("prctl(PR_SET_PDEATHSIG)", libc.lib.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0))  # SIGKILL


def _drop_privileges(uid: int | None) -> None:
    """No capabilities now or after execve, no way to gain any (no_new_privs), and the sandbox uid
    when one is mapped (the trainer runs as root). Checked at the end from /proc: fail closed."""
    libc = _Libc()
    prctl = libc.lib.prctl
    prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0)  # needs CAP_SETPCAP; under bwrap it is already gone
    for cap in range(64):
        if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and libc.ctypes.get_errno() == 22:  # EINVAL: no such cap
            break
    prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _capset_zero(libc)
    libc.call("prctl(PR_SET_NO_NEW_PRIVS)", prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    held = [k for k in ("CapInh", "CapPrm", "CapEff", "CapAmb") if int(status.get(k, "1"), 16)]
    if os.getuid() == 0 and int(status.get("CapBnd", "1"), 16):
        held.append("CapBnd")
    if held or status.get("NoNewPrivs") != "1":
        raise OSError(f"could not drop privileges: {held or 'no_new_privs'} still set")


def _capset_zero(libc: _Libc) -> None:
    ct = libc.ctypes

    class Header(ct.Structure):
        _fields_ = [("version", ct.c_uint32), ("pid", ct.c_int)]

    class Data(ct.Structure):
        _fields_ = [("effective", ct.c_uint32), ("permitted", ct.c_uint32), ("inheritable", ct.c_uint32)]

    libc.call("capset", libc.lib.capset(ct.byref(Header(0x20080522, 0)), (Data * 2)()))


def _stage_trampoline(spec: dict) -> None:
    """Set the resource limits, enter the workdir, close inherited fds and exec the program with its
    own environment. Runs in the child, after fork, so nothing here touches the trainer."""
    try:
        _set_limits(spec["limits"], nproc=spec["layer"] != "none")
        os.chdir(spec["workdir"])
        os.closerange(3, 1 << 16)
        os.execve(spec["python"], [spec["python"], "-c", spec["program"]], spec["env"])
    except OSError as exc:
        _fail("trampoline", exc)


def _set_limits(limits: dict, *, nproc: bool) -> None:
    mb = 1 << 20
    wanted = {
        resource.RLIMIT_AS: (limits["memory_mb"] * mb,) * 2,
        resource.RLIMIT_CPU: (limits["cpu_s"], limits["cpu_s"] + 1),
        resource.RLIMIT_FSIZE: (limits["file_mb"] * mb,) * 2,
        resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    if nproc:  # without a user namespace NPROC counts all the trainer user's processes: not used
        wanted[resource.RLIMIT_NPROC] = (limits["processes"],) * 2
    for res, (soft, hard) in wanted.items():
        _, current_hard = resource.getrlimit(res)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(res, (soft, hard))


if __name__ == "__main__":
    _stage, _spec_json = sys.argv[1], sys.argv[2]
    {"launch": _stage_launch, "setup": _stage_setup, "init": _stage_init, "trampoline": _stage_trampoline}[_stage](json.loads(_spec_json))
