"""The child side of the code-interpreter sandbox (`tools/sandbox.py`): the stages that
build the isolation and exec the program (launch -> setup -> init -> trampoline; with isolation
"none", launch -> supervise -> trampoline).

This file is not only imported: `sandbox.launch._child_source()` runs the whole of it, followed by
`watch.py` (what init and the supervisor do while the program runs), as the stages' program
(`python -c <source> <stage> <spec>`), so it stays standard library only, with only
json/os/resource/sys at module level. Its functions call watch.py's by their bare names, which the
program defines by the time a stage runs (the import below is for the type checker only).
"""

from __future__ import annotations

import json
import os
import resource
import sys

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: the stages import nothing more (module docstring)
if TYPE_CHECKING:
    from typing import NoReturn

    from streamrl.tools.sandbox.watch import (
        Budget,
        LimitExceeded,
        Tracer,
        kill_descendants,
        stop_over_limit,
        wait_for,
    )

# -- the child side: stages ------------------------------------------------------------------------
# Everything from here to the end is the stages' program (`_child_source`): standard library only,
# and only json/os/resource/sys at module level, so each stage starts in milliseconds; a module a
# stage needs after dropping privileges must be imported before (the interpreter may be unreadable).

WORKSPACE = "/workspace"
SETUP_FAILED = 125  # exit status of a stage that could not build the sandbox (reason on stderr)
SIGNAL_BASE = 128  # a sandbox exits 128 + N when its program was killed by signal N
_MARKER = "streamrl-sandbox:"  # prefix of the stages' own error messages on stderr
_DEVICES = ("null", "zero", "full", "random", "urandom")
HOSTNAME = "sandbox"  # the unshare and bwrap layers' hostname (their own uts namespace): not the host's
# Global /proc entries the unshare layer shows empty: host facts no program needs (the kernel's command
# line, which names the boot infrastructure, its build config, the boot id that identifies this boot of
# the host), and the entries container runtimes mask by default. Those missing on a kernel are skipped.
MASKED_PROC = (
    "cmdline", "config.gz", "sys/kernel/random/boot_id",
    "acpi", "asound", "interrupts", "kcore", "keys", "latency_stats", "sched_debug", "scsi", "timer_list",
    "timer_stats",
)  # fmt: skip

_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
(
    _PR_SET_PDEATHSIG,
    _PR_CAPBSET_DROP,
    _PR_SET_SECUREBITS,
    _PR_SET_NO_NEW_PRIVS,
    _PR_CAP_AMBIENT,
    _PR_CAP_AMBIENT_CLEAR_ALL,
) = 1, 24, 28, 38, 47, 4
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
        def enc(text: str | None) -> bytes | None:
            return None if text is None else text.encode()

        self.call(
            f"mount {dst}", self.lib.mount(enc(src), enc(dst), enc(fstype), self.ctypes.c_ulong(flags), enc(data))
        )


def _fail(stage: str, exc: BaseException) -> NoReturn:
    os.write(2, f"{_MARKER} {stage}: {exc}\n".encode())
    os._exit(SETUP_FAILED)


def _exit_like(status: int) -> None:
    """Exit with a child's wait status: the same code, or 128 + the signal that killed it."""
    if os.WIFSIGNALED(status):
        os._exit(SIGNAL_BASE + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _stage_launch(spec: dict) -> None:
    """The first stage, the worker's child: die with the worker, join the sandbox's cgroup (its
    memory and pids budget), then build the layer: exec `unshare` into the namespaces (running
    `setup` inside), exec bwrap, or (isolation "none") supervise the program (`_stage_supervise`)."""
    try:
        if spec["layer"] == "none":  # told by SIGTERM, to kill what the program started before it goes
            _arm_supervisor()
        else:
            _die_with_parent()
        if os.getppid() != spec["parent"]:  # the worker died before the death signal was armed
            raise OSError("the worker that started this sandbox is gone")
        if spec.get("cgroup"):
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")  # this process; everything it starts stays in the cgroup
    except OSError as exc:
        _fail("launch", exc)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["layer"] == "none":
        _stage_supervise(spec)
    # --cgroup: the program's /proc/self/cgroup shows "/", not the host's cgroup paths
    flags = ["--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child"]
    tail = ["--", os.path.realpath(sys.executable), "-I", "-S", "-c", _stage_source(), "setup", json.dumps(spec)]
    try:
        if spec["layer"] == "bwrap":
            os.execv(spec["bwrap"][0], spec["bwrap"])
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
        proc_fd = _build_root(spec, _Libc())
    except OSError as exc:
        _fail("setup", exc)
    _stage_init(spec, proc_fd)


def _build_root(spec: dict, libc: _Libc) -> int:
    """Build the new root and pivot into it; return a handle on a writable view of its /proc (the
    program's is read-only), with which init writes the program's user namespace maps."""
    root, limits = spec["root"], spec["limits"]
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    libc.call("sethostname", libc.lib.sethostname(HOSTNAME.encode(), len(HOSTNAME)))
    libc.mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m")
    # The private tmpfs folders first, the read-only binds after: an interpreter that lives under
    # /tmp (a venv in a checkout there) is then bound on top of the private /tmp, not hidden by it.
    owner = f",uid={spec['uid']},gid={spec['uid']}" if spec["uid"] is not None else ""
    for path, mode in (("/tmp", "1777"), (WORKSPACE, "0755"), ("/dev/shm", "1777")):
        os.makedirs(root + path, exist_ok=True)
        libc.mount(
            "tmpfs", root + path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode},size={limits['disk_mb']}m{owner}"
        )
    for mount in spec["mounts"]:
        dst = root + mount.get("at", mount["path"])
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if mount["kind"] == "symlink":
            os.symlink(mount["target"], dst)
        elif mount["kind"] == "bind_rw":  # a folder the program edits (`Sandbox.run`'s `folders`)
            os.makedirs(dst, exist_ok=True)
            libc.mount(mount["path"], dst, None, _MS_BIND | _MS_REC)
        else:
            _bind_readonly(libc, mount["path"], dst)
    for name in _DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        libc.mount(f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    _write_passwd(root, spec["uid"] or 0)
    proc_fd = _mount_proc(libc, root)
    _pivot_root(libc, root)
    libc.mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    return proc_fd


def _mount_proc(libc: _Libc, root: str) -> int:
    """Mount the sandbox's /proc read-only, with hidepid: the program sees only its own processes, not
    init (non-dumpable, see `_stage_init`), whose command line holds the spec with the host's paths;
    and with `MASKED_PROC` empty. Return a handle on a writable, detached mount of the same proc."""
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    staging = root + "/.proc"
    os.makedirs(root + "/proc", exist_ok=True)
    os.mkdir(staging)
    libc.mount("proc", staging, "proc", flags, "hidepid=2")
    proc_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    libc.mount(staging, root + "/proc", None, _MS_BIND)
    libc.mount(None, root + "/proc", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
    libc.call(f"umount {staging}", libc.lib.umount2(staging.encode(), _MNT_DETACH))  # `proc_fd` keeps it
    os.rmdir(staging)
    empty = root + "/.masked"
    open(empty, "w").close()
    for name in MASKED_PROC:
        target = f"{root}/proc/{name}"
        if os.path.isdir(target):
            libc.mount("tmpfs", target, "tmpfs", _MS_RDONLY | flags, "mode=0555,size=4k")
        elif os.path.exists(target):
            libc.mount(empty, target, None, _MS_BIND)
            libc.mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
    os.unlink(empty)  # the binds keep the (empty) file
    return proc_fd


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
        for st, msf in (
            (os.ST_NOEXEC, _MS_NOEXEC),
            (os.ST_NOATIME, _MS_NOATIME),
            (os.ST_NODIRATIME, _MS_NODIRATIME),
            (os.ST_RELATIME, _MS_RELATIME),
        ):
            ms |= msf if flags & st else 0
        libc.mount(None, mnt, None, ms)


def _mount_points_under(path: str) -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = (
                line.split()[4]
                .replace("\\040", " ")
                .replace("\\011", "\t")
                .replace("\\012", "\n")
                .replace("\\134", "\\")
            )
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


def _stage_init(spec: dict, proc_fd: int | None = None) -> None:
    """Pid 1 of the sandbox: drop privileges, fork the program, reap, exit like it. The namespace
    dies with it, taking every process the program left behind. It stays in the parent's process
    group, so the parent's kill of the group reaches it whatever the program does with sessions.

    With `proc_fd` (the unshare layer) the program runs in a user namespace of its own, nested in the
    sandbox's (`_fork_nested`): its /proc/self/uid_map then shows its own uid only, not that the
    sandbox's maps root (the trainer's uid)."""
    nested = None
    try:
        if proc_fd is not None:
            nested = _fork_nested(spec, proc_fd)
        _drop_privileges(spec["uid"])
        _die_with_parent()  # a uid change cleared the death signal unshare/bwrap had set
        libc = _Libc()  # not dumpable: hidden from the program by /proc's hidepid
        libc.call("prctl(PR_SET_DUMPABLE)", libc.lib.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0))
        if nested is not None:  # only now, init unprivileged and hidden, may the program start
            go_w = nested[1]
            os.write(go_w, b"1")
            os.close(go_w)
    except OSError as exc:
        _fail("init", exc)
    if nested is None:
        pid = os.fork()
        if pid == 0:
            _stage_trampoline(spec)
    else:
        pid = nested[0]
    # Without a cgroup, init adds up the memory of the sandbox's processes (their number is bounded by
    # RLIMIT_NPROC, counted in the sandbox's user namespace).
    budget = None if spec["cgroup"] else Budget(os.getpid(), memory_mb=spec["limits"]["memory_mb"])
    try:
        _exit_like(wait_for(pid, None, budget))
    except LimitExceeded as exc:
        stop_over_limit(exc)


def _fork_nested(spec: dict, proc_fd: int) -> tuple[int, int]:
    """Fork the program's process, which takes the program's uid and enters a new user namespace;
    init (still privileged) maps that uid to itself there — one line, so the program's uid map names
    neither root nor the trainer's uid — then sets the sandbox's user-namespace limit to 0 (the program
    nests none of its own: kernel attack surface). Return the pid and the pipe end that lets it go on
    (dropping its capabilities in its namespace, then exec)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (ready_r, go_w, proc_fd):
                os.close(fd)
            _die_with_parent()
            if spec["uid"] is not None:  # the namespace is owned by the sandbox uid, not by root
                os.setgroups([])
                os.setresgid(spec["uid"], spec["uid"], spec["uid"])
                os.setresuid(spec["uid"], spec["uid"], spec["uid"])
                _die_with_parent()  # cleared by the uid change
            libc = _Libc()
            libc.call("unshare(CLONE_NEWUSER)", libc.lib.unshare(_CLONE_NEWUSER))
            os.write(ready_w, b"1")
            os.close(ready_w)
            if os.read(go_r, 1) != b"1":
                raise OSError("init did not set up the program's user namespace")
            os.close(go_r)
            _drop_privileges(spec["uid"], groups=False)  # all capabilities in the new namespace: drop them
        except OSError as exc:
            _fail("trampoline", exc)
        _stage_trampoline(spec)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) != b"1":
        raise OSError("the program's process did not enter its user namespace")
    os.close(ready_r)
    ids = spec["uid"] if spec["uid"] is not None else 0
    for name in ("uid_map", "gid_map"):
        _write_at(proc_fd, f"{pid}/{name}", f"{ids} {ids} 1\n")
    _write_at(proc_fd, "sys/user/max_user_namespaces", "0")  # counts the nested one: none can follow
    os.close(proc_fd)
    return pid, go_w


def _write_at(dir_fd: int, path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _die_with_parent(signum: int = 9) -> None:  # SIGKILL
    libc = _Libc()
    libc.call("prctl(PR_SET_PDEATHSIG)", libc.lib.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0))


def _arm_supervisor() -> None:
    """Isolation "none", before anything runs: become the child subreaper (every process the program
    orphans or sends off with setsid is re-parented here, not to init) and take SIGTERM, also the
    signal for the worker's death, as the order to kill all of them and exit."""
    import signal

    def stop(signum: int, frame: object) -> None:
        kill_descendants()
        os._exit(SIGNAL_BASE + signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    libc = _Libc()
    libc.call("prctl(PR_SET_CHILD_SUBREAPER)", libc.lib.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0))
    _die_with_parent(signal.SIGTERM)


def _stage_supervise(spec: dict) -> None:
    """Isolation "none": what the pid namespace's death does in the other layers, done by hand. Fork
    the program (it dies with this stage), trace it (`Tracer`: the kernel kills every process of it
    when this stage dies, however) and wait for it; once it ends, goes over its budget, or the worker
    dies or kills the sandbox (SIGTERM, `_arm_supervisor`), kill every process still below this one,
    the ones that left the process group included, then exit like the program. Where ptrace is not
    allowed the subreaper alone finds them, and a budget walk every `WATCH_S` counts them."""
    import signal

    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(go_w)
        if os.read(go_r, 1) != b"1":  # the supervisor died before the program was traced
            os._exit(SETUP_FAILED)
        os.close(go_r)
        _stage_trampoline(spec)
    os.close(go_r)
    limits, bounded = spec["limits"], spec["cgroup"] is not None  # a cgroup counts processes and memory
    try:
        tracer = Tracer(pid, None if bounded else limits["processes"])
    except OSError:
        tracer = None
    os.write(go_w, b"1")
    os.close(go_w)
    null = os.open(os.devnull, os.O_RDWR)  # the pipes are the program's: the worker reads them to EOF
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    budget = None
    if not bounded:
        budget = Budget(os.getpid(), memory_mb=limits["memory_mb"], processes=None if tracer else limits["processes"])
    try:
        status = wait_for(pid, tracer, budget)
    except LimitExceeded as exc:
        stop_over_limit(exc)
    kill_descendants()
    _exit_like(status)


def _stage_check_trace(spec: dict) -> None:
    """Print "ok" when this process may trace a child it forks, as the "none" supervisor does, else
    why not (`sandbox.describe`)."""
    import signal

    pid = os.fork()
    if pid == 0:
        signal.pause()  # until killed
        os._exit(0)
    try:
        Tracer(pid, None)
        print("ok")
    except OSError as exc:
        print(exc)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _drop_privileges(uid: int | None, *, groups: bool = True) -> None:
    """No capabilities now or after execve, no way to gain any (no_new_privs), and the sandbox uid
    when one is mapped (the trainer runs as root). Checked at the end from /proc: fail closed.
    `groups=False`: the supplementary groups were cleared already (before entering a user namespace
    where setgroups may not be allowed)."""
    libc = _Libc()
    prctl = libc.lib.prctl
    prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0)  # needs CAP_SETPCAP; under bwrap it is already gone
    for cap in range(64):
        if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and libc.ctypes.get_errno() == 22:  # EINVAL: no such cap
            break
    prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if uid is not None:
        if groups:
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
        _die_with_parent()  # cleared by fork; kept by the execve below
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


def main(stage: str, spec_json: str) -> None:
    """Run one stage: the stages' program ends with `main(sys.argv[1], sys.argv[2])`."""
    stages = {
        "launch": _stage_launch, "setup": _stage_setup, "init": _stage_init, "trampoline": _stage_trampoline,
        "check-trace": _stage_check_trace,
    }  # fmt: skip
    stages[stage](json.loads(spec_json))
