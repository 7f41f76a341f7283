"""How one sandbox run is started: the command line of its first stage and the spec it carries (the
layer, the interpreter, the limits, what the new root shows, the program's whole environment).

Built in the trainer's process for every run (`Sandbox.run`) and for the isolation probe; the stages
that read the spec are `sandbox/stages.py`, run as `python -I -S -c <source> <stage> <spec>` with
`_child_source` as the source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.tools.sandbox import stages as sandbox_stages
from streamrl.tools.sandbox import watch as sandbox_watch
from streamrl.tools.sandbox.execute import SAFE_PATH
from streamrl.tools.sandbox.stages import HOSTNAME, WORKSPACE

if TYPE_CHECKING:
    from streamrl.tools.sandbox import SandboxSettings

VENV_MOUNT = "/opt/venv"  # where the program's virtual environment appears (its host path stays hidden)
# System paths made visible read-only (those that exist; symlinks such as /bin -> usr/bin are copied).
_SYSTEM_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
)  # fmt: skip


def _argv_for(
    layer: str,
    settings: SandboxSettings,
    program: str,
    tmp: str,
    cgroup: Path | None = None,
    folders: Mapping[str, str] | None = None,
) -> list[str]:
    """The command line of one run: the first stage (`launch`), whatever the layer. `tmp` is an empty
    host directory it may use (the mount point of the new root, or the workdir when isolation is
    "none"); `cgroup` the run's budget, which the first stage joins; `folders` see `Sandbox.run`."""
    stage = [os.path.realpath(sys.executable), "-I", "-S", "-c", _child_source()]
    spec = _spec(layer, settings, program, tmp)
    for name, host in (folders or {}).items():
        if not name or name in (".", "..") or "/" in name or not os.path.isdir(host):
            raise ValueError(f"sandbox folder {name!r}: a plain name and an existing host directory, got {host!r}")
        if layer == "none":  # nothing is mounted: the workdir links to it
            os.symlink(os.path.realpath(host), os.path.join(tmp, name))
        else:
            spec["mounts"].append({"kind": "bind_rw", "path": os.path.realpath(host), "at": f"{WORKSPACE}/{name}"})
    spec["cgroup"] = None if cgroup is None else str(cgroup)
    if layer == "unshare":
        spec["unshare"] = _which(settings.unshare_path)
    elif layer == "bwrap":
        spec["bwrap"] = _bwrap_argv(_which(settings.bwrap_path), spec, stage)
    elif layer != "none":
        raise ValueError(f"unknown isolation layer {layer!r}")
    return [*stage, "launch", json.dumps(spec)]


def _spec(layer: str, settings: SandboxSettings, program: str, tmp: str) -> dict:
    python = _exec_path(settings.python or sys.executable)
    venv = _venv_of(python) if layer != "none" else None
    workdir = tmp if layer == "none" else WORKSPACE
    root = os.geteuid() == 0
    return {
        "layer": layer,
        "parent": os.getpid(),  # the first stage checks it is still its parent once it will die with it
        "python": python if venv is None else VENV_MOUNT + python[len(venv) :],
        "program": program,
        "root": tmp,  # unshare: mount point of the new root
        "workdir": workdir,
        "uid": settings.sandbox_uid if root and layer != "none" else None,
        "limits": asdict(settings.limits),
        "mounts": _mounts(python, settings.ro_paths, venv) if layer != "none" else [],
        "env": _program_env(workdir, "/tmp" if layer != "none" else tmp),
    }


def _venv_of(python: str) -> str | None:
    """The virtual environment `python` (an `_exec_path`) belongs to, if any: the sandbox shows it at
    `VENV_MOUNT`, so neither the program's argv nor its `sys.prefix` names the host's path."""
    prefix, base = _python_prefix_pair(python)
    if prefix == base or not python.startswith(prefix.rstrip("/") + "/"):
        return None
    return prefix


def _program_env(home: str, tmpdir: str) -> dict[str, str]:
    """The program's whole environment: nothing of the trainer's (API keys, tokens) gets in."""
    return {
        "PATH": SAFE_PATH, "HOME": home, "TMPDIR": tmpdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
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
def _python_prefix_pair(python: str) -> tuple[str, str]:
    """`sys.prefix` and `sys.base_prefix` of `python`, resolved."""
    code = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix]))"
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    prefix, base = json.loads(out.stdout)
    return os.path.realpath(prefix), os.path.realpath(base)


@lru_cache(maxsize=16)
def _python_prefixes(python: str) -> tuple[str, ...]:
    code = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    return tuple(sorted({os.path.realpath(p) for p in json.loads(out.stdout)}))


def _mounts(python: str, extra: tuple[str, ...], venv: str | None = None) -> list[dict[str, str]]:
    """What the new root shows: system paths, both interpreters' prefixes, `extra`; all read-only.
    The program's `venv` is shown at `VENV_MOUNT` only."""
    stage_python = os.path.realpath(sys.executable)
    mounts, paths = [], set()
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            mounts.append({"kind": "symlink", "path": path, "target": os.readlink(path)})
        elif os.path.exists(path):
            paths.add(path)
    paths.update(p for p in _python_prefixes(python) + _python_prefixes(stage_python) if p != venv)
    paths.update(p for p in map(os.path.realpath, extra) if os.path.exists(p))
    for path in sorted(paths):  # a path under another one is already visible through it
        if not any(path.startswith(other.rstrip("/") + "/") for other in paths):
            mounts.append({"kind": "bind", "path": path})
    if venv is not None:
        mounts.append({"kind": "bind", "path": venv, "at": VENV_MOUNT})
    return mounts


def _bwrap_argv(bwrap: str, spec: dict, stage: list[str]) -> list[str]:
    """As root, bwrap gets no user namespace (it would map the program to root): init switches to the
    sandbox uid instead, whose RLIMIT_NPROC is then shared by concurrent sandboxes."""
    if spec["uid"] is None:
        argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
    else:
        argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--as-pid-1", "--die-with-parent", "--proc", "/proc", "--dev", "/dev"]  # init is pid 1
    argv += ["--hostname", HOSTNAME]  # both variants unshare the uts namespace
    size = str(spec["limits"]["disk_mb"] << 20)
    for path in ("/tmp", WORKSPACE):  # before the binds: an interpreter under /tmp stays visible
        argv += ["--perms", "1777", "--size", size, "--tmpfs", path]
    parents = {os.path.dirname(m.get("at", m["path"])) for m in spec["mounts"] if m["kind"] != "bind_rw"}
    for parent in sorted({a for p in parents for a in _ancestors(p)}):  # else bwrap copies e.g. /root's 0700
        argv += ["--perms", "0755", "--dir", parent]
    for mount in spec["mounts"]:
        if mount["kind"] == "symlink":
            argv += ["--symlink", mount["target"], mount["path"]]
        elif mount["kind"] == "bind_rw":  # under the private /workspace, made above
            argv += ["--bind", mount["path"], mount["at"]]
        else:
            argv += ["--ro-bind", mount["path"], mount.get("at", mount["path"])]
    argv += ["--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv", "--setenv", "PATH", SAFE_PATH]
    return [*argv, "--", *stage, "init", json.dumps(spec)]


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("/", ""):
        out.append(path)
        path = os.path.dirname(path)
    return out


@lru_cache(maxsize=1)
def _child_source() -> str:
    """The stages' program: the whole of `sandbox/stages.py`, then of `sandbox/watch.py`, then the call
    that runs the stage its command line names."""
    parts = [Path(str(module.__file__)).read_text(encoding="utf-8") for module in (sandbox_stages, sandbox_watch)]
    return "\n".join([*parts, "main(sys.argv[1], sys.argv[2])\n"])
