"""Where a run's output goes: a console a person can read, and everything else in `RUN_DIR/logs/`.

On the console `streamrl train` shows a progress bar (metrics.py), our own packages' INFO lines and
other libraries' errors. The whole story is in files:

    RUN_DIR/logs/driver.log            this process, every logger (INFO; DEBUG with --verbose)
    RUN_DIR/logs/<Actor>-<pid>.log     each Ray actor's stdout/stderr: vLLM, torch, our loggers
                                       (`worker-<pid>.log` until the run ends and they are named)
    RUN_DIR/logs/prepare_model.log     model conversion + SFT warm-up (a child process, sft.py)
    RUN_DIR/logs/ray                   link to Ray's own session logs (raylet, gcs) on this machine

Actors: `ray.init(**ray_init_options(run_dir, env_vars))` turns off Ray's forwarding of actor output
to the driver and has Ray run `setup_worker_logging` in every worker process before any actor starts
in it; that points the process's stdout/stderr file descriptors (so C++ and vLLM output too) at
`worker-<pid>.log`. `name_worker_logs` renames each after the actor it hosted (Ray writes an
`:actor_name:<Class>` line into it). `--verbose` keeps everything on the console instead, as before.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import RunDir
from streamrl.core.trace import RUN_DIR_ENV
from streamrl.observability.safe_text import SafeFormatter

if TYPE_CHECKING:
    from rich.console import Console

LOG_DIR_ENV = "STREAMRL_LOG_DIR"  # set in actors' environment: where setup_worker_logging writes
WORKER_SETUP_HOOK = "streamrl.observability.logs.setup_worker_logging"
DRIVER_LOG = "driver.log"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers whose INFO lines belong on the console; everyone else's only from ERROR up (unless --verbose).
OWN_PACKAGES = frozenset({"streamrl", "bench", "__main__"})
# `logger.info(..., extra=PROGRESS_EXTRA)`: a per-step progress line. The console drops it while a
# progress bar shows the same numbers (a terminal); in CI logs and pipes it is the progress.
PROGRESS_EXTRA = {"streamrl_progress": True}
# `logger.error(..., exc_info=exc, extra=FILE_ONLY)`: a traceback for driver.log whose console
# message is said once, elsewhere (e.g. `explain_failure`'s sentence).
FILE_ONLY = {"streamrl_file_only": True}

_console: Console | None = None
_verbose = False


def console() -> Console:
    """The one rich console (stderr) that the progress bar and console log lines share."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(stderr=True)
    return _console


def is_verbose() -> bool:
    """Whether the CLI was asked for `--verbose` (everything on the console)."""
    return _verbose


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "streamrl_file_only", False):
            return False
        if getattr(record, "streamrl_progress", False):
            return not console().is_terminal
        if _verbose:
            return True
        return record.levelno >= logging.ERROR or record.name.split(".", 1)[0] in OWN_PACKAGES


def setup_console(*, verbose: bool) -> None:
    """Root logging of a CLI command: the console handler (rich on a terminal), level INFO or DEBUG."""
    global _verbose
    _verbose = verbose
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for handler in [h for h in root.handlers if getattr(h, "streamrl_console", False)]:
        root.removeHandler(handler)
    if console().is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console(), show_path=False, rich_tracebacks=False)
        handler.setFormatter(SafeFormatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(SafeFormatter(FILE_FORMAT))  # model and tool text in a message: escapes shown
    handler.streamrl_console = True  # type: ignore[attr-defined]
    handler.addFilter(_ConsoleFilter())
    root.addHandler(handler)


def log_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).logs


def attach_run_log(run_dir: str | Path) -> Path:
    """Log every record of this process to `RUN_DIR/logs/driver.log` too; returns that path.

    Ray's own `ray` logger (its own stderr handler, not propagated) is routed through the root
    logger, so its INFO lines land in the file and only its errors on the console."""
    path = log_dir(run_dir) / DRIVER_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve() for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(handler)
    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    return path


def connect_options(address: str) -> dict[str, Any]:
    """`ray.init` options to join the cluster at `address`: a cluster on 127.0.0.1 (several nodes
    on one machine) is joined from 127.0.0.1 too, not from the machine's outward address."""
    host = address.rsplit(":", 1)[0]
    return {"_node_ip_address": "127.0.0.1"} if host in ("127.0.0.1", "localhost") else {}


def ray_init_options(run_dir: str | Path, env_vars: Mapping[str, str]) -> dict[str, Any]:
    """`log_to_driver` and `runtime_env` for `ray.init`: `env_vars` for every actor and, unless
    verbose, actor output into `RUN_DIR/logs/` instead of the driver's console."""
    env_vars = {**env_vars, RUN_DIR_ENV: str(Path(run_dir).resolve())}  # the actors' lifecycle trace (core.trace)
    if _verbose:
        return {"log_to_driver": True, "runtime_env": {"env_vars": env_vars}}
    env = {**env_vars, LOG_DIR_ENV: str(log_dir(run_dir).resolve())}
    return {"log_to_driver": False, "runtime_env": {"env_vars": env, "worker_process_setup_hook": WORKER_SETUP_HOOK}}


def setup_worker_logging() -> None:
    """Ray's worker_process_setup_hook: send this worker process's output to `worker-<pid>.log`.

    File descriptors 1 and 2 are redirected, so vLLM's handlers, C++ extensions and prints follow;
    the root logger gets an INFO handler so our modules' logs in actors are kept too, its lines escaped
    by `SafeFormatter` (tool or model text in a record must not drive the terminal that tails the file)."""
    target = os.environ.get(LOG_DIR_ENV)
    if not target:
        return
    try:
        Path(target).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(target) / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:  # e.g. another node of a cluster cannot write the driver's path: Ray's own logs keep it
        logging.getLogger(__name__).warning("actor output stays in Ray's session logs: %s", exc)
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter(FILE_FORMAT))  # tool and model text in a record: escapes shown, not run
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def link_ray_logs(run_dir: str | Path) -> Path | None:
    """`RUN_DIR/logs/ray` -> this machine's Ray session logs (raylet, gcs, workers); call after ray.init."""
    try:
        import ray

        node = ray._private.worker._global_node
        source = Path(node.get_logs_dir_path()) if node is not None else None
    except (ImportError, AttributeError):
        return None
    if source is None or not source.is_dir():
        return None
    link = log_dir(run_dir) / "ray"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()  # a resumed run: point at the new session
    if not link.exists():
        link.symlink_to(source, target_is_directory=True)
    return link


_ACTOR_NAME = re.compile(r"^:actor_name:(\S+)", re.MULTILINE)


def name_worker_logs(run_dir: str | Path) -> list[Path]:
    """After `ray.shutdown`: rename `worker-<pid>.log` to `<Actor>-<pid>.log`, drop empty ones
    (idle worker processes); returns the actor logs."""
    out = []
    for path in sorted(log_dir(run_dir).glob("worker-*.log")):
        if path.stat().st_size == 0:
            path.unlink()
            continue
        with open(path, "rb") as f:
            head = f.read(1 << 16).decode("utf-8", errors="replace")
        match = _ACTOR_NAME.search(head)
        name = re.sub(r"[^\w.-]", "_", match.group(1)) if match else None
        target = path.with_name(f"{name}-{path.name.removeprefix('worker-')}") if name else path
        if target != path and not target.exists():
            path.rename(target)
            path = target
        out.append(path)
    return out


def format_duration(seconds: float) -> str:
    """`1:02:03` / `2:05`."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def run_summary(
    run_dir: str | Path, *, learner_step: int, total_steps: int, elapsed_s: float, report: str | Path | None
) -> str:
    """The lines `streamrl train` ends with: how far it got and where everything is."""
    run = RunDir(run_dir)
    checkpoints = run.checkpoint_folders()
    lines = [
        f"run {'finished' if learner_step >= total_steps else 'stopped'} at learner step {learner_step}/{total_steps} "
        f"after {format_duration(elapsed_s)}",
        f"  report       {report if report is not None else '(not written)'}",
        f"  checkpoints  {run.checkpoints}" + (f" (latest {checkpoints[-1].name})" if checkpoints else " (none)"),
        f"  logs         {run.logs}",
        f"  metrics      {run.metrics}",
    ]
    if learner_step < total_steps:
        lines.append(f"  continue     streamrl train --resume {run.root}")
    return "\n".join(lines)
