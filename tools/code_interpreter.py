"""`CodeInterpreterTool`: a stateful Python interpreter for the model, run in a sandbox (as in ReTool).

Each call runs in a fresh sandboxed process (`tools/sandbox.py`): isolation chosen by a
start-up probe, failing closed, with resource limits, a wall-clock timeout, capped output and a
cleared environment. The tool refuses to be built when no isolation works, unless the config says
`isolation: none`.

State without a state store: the instance keeps the cells of the trajectory that ran without error.
A call replays them in the new process with their output discarded, then runs the new cell and
shows what it printed, notebook-style (a trailing expression's repr is printed too). Whether a cell
ran to its end is read from the runner's token lines (see RUNNER), never from its exit status or its
output: a cell that calls `os._exit(0)` failed, one that prints "Error: ..." succeeded. The replay
has its own time budget (`replay_timeout_s`), and running past it is reported as the replay's. `restore`
rebuilds that list from the trajectory's tool journal (its DONE entries whose result is not
`is_error`), so the interpreter survives pause/resume and a move to another process. Replays are
deterministic as far as the sandbox can make them: a fresh workdir and /tmp every time,
`random` seeded with 0, PYTHONHASHSEED=0 (time, os.urandom or numpy's global RNG are not).

`idempotent = True`: a call has no effect outside its own throwaway process (no network, a private
filesystem that is discarded) and its outcome is a function of the journaled cells, so running an
interrupted call again has the effect of running it once.

Errors the model can act on (exception, timeout, memory or CPU limit, a killed process) come back as
observations starting with "Error:" plus `sandbox/*` metrics; nothing the model writes raises.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import signal
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxSettings,
)
from streamrl.tools.schema import OpenAIFunctionToolSchema
from streamrl.tools.types import ToolCallStatus, ToolJournalEntry

logger = logging.getLogger(__name__)

# Runs inside the sandbox as `python -c RUNNER`, reading {"replay": [str], "cell": str, "cpu_s": int,
# "wall_s": int, "replay_wall_s": int, "token": str} on stdin. It reports on stdout, around the cell's
# output, with lines starting with the run's random `token`: "<token> replayed <seconds>" once the
# earlier cells ran (first line), then "<token> done" or "<token> raised" once the new cell ended (last
# line). A missing line says the process ended or was stopped before that point (`os._exit`, a
# signal, a limit), whatever its exit status. An earlier cell that raises when replayed (it succeeded
# once, so something nondeterministic changed) is reported in a note, not fatal: failing every later
# call of the trajectory would be worse.
RUNNER = r"""
import ast, json, os, random, resource, signal, sys, time, traceback

class ReplayTimeout(BaseException):
    pass

def stop_replay(signum, frame):
    raise ReplayTimeout()

def cell_traceback(exc):
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell"):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))

def run_cell(source, name, env):
    tree = ast.parse(source, name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    try:
        exec(compile(tree, name, "exec"), env)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), env)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:  # exit() ends the cell, not the interpreter
        if exc.code not in (None, 0):
            raise

def replay(cells, env, wall_s, notes):
    signal.signal(signal.SIGALRM, stop_replay)
    signal.alarm(wall_s)  # the replay's own wall clock, apart from the new cell's
    for i, cell in enumerate(cells):
        try:
            run_cell(cell, f"<cell {i + 1}>", env)
        except Exception as exc:  # it succeeded once: nondeterminism; keep going with what it left
            notes.append(
                f"Note: replaying cell {i + 1} raised {type(exc).__name__}: {exc}; "
                "some of its state may be missing"
            )
    signal.alarm(0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)

def main():
    job = json.loads(sys.stdin.read())
    sys.stdin = open(os.devnull)
    random.seed(0)
    env = {"__name__": "__main__", "__builtins__": __builtins__}
    report = os.dup(1)
    silent = os.open(os.devnull, os.O_WRONLY)
    os.dup2(silent, 1)
    os.dup2(silent, 2)
    notes, start = [], time.monotonic()
    if job["replay"]:
        try:
            replay(job["replay"], env, job["replay_wall_s"], notes)
        except ReplayTimeout:
            os._exit(3)  # no "replayed" line: the parent blames the replay, not the new cell
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(report, 1)
    os.dup2(report, 2)  # the cell's stderr joins stdout, in order
    os.write(report, f"{job['token']} replayed {time.monotonic() - start:.3f}\n".encode())
    sys.stderr = sys.stdout
    sys.stdout.reconfigure(line_buffering=True)
    for note in notes:
        print(note)
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    limit = min(int(used.ru_utime + used.ru_stime) + 1 + job["cpu_s"], soft)  # the new cell's own budget
    resource.setrlimit(resource.RLIMIT_CPU, (limit, min(limit + 1, hard)))
    token, ended = job.pop("token"), "done"
    signal.alarm(job["wall_s"])  # the new cell's own wall clock; the parent's kill is the backstop
    try:
        run_cell(job["cell"], f"<cell {len(job['replay']) + 1}>", env)
    except BaseException as exc:
        print(cell_traceback(exc), end="")
        ended = "raised"
    signal.alarm(0)
    sys.stdout.flush()
    os.write(report, f"\n{token} {ended}\n".encode())
    os._exit(0 if ended == "done" else 1)

main()
"""


class CodeInterpreterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    isolation: Literal["auto", "bwrap", "unshare", "none"] = "auto"  # "none" is an explicit opt-out
    python: str | None = None  # interpreter of the cells (with its packages); None: the trainer's
    bwrap_path: str = "bwrap"
    unshare_path: str = "unshare"
    ro_paths: list[str] = Field(default_factory=list)  # extra host paths the cells may read
    sandbox_uid: int = Field(65534, gt=0)  # the cells' uid when the trainer runs as root
    timeout_s: float = Field(10.0, gt=0)  # wall clock of the new cell
    replay_timeout_s: float = Field(15.0, ge=0)  # extra wall clock for replaying the earlier cells
    cpu_s: int = Field(10, gt=0)  # CPU seconds of the new cell (replay has replay_timeout_s more)
    memory_mb: int = Field(1024, ge=64)
    max_file_mb: int = Field(16, gt=0)
    disk_mb: int = Field(64, gt=0)  # size of the private /workspace and /tmp
    max_open_files: int = Field(64, ge=16)
    max_processes: int = Field(32, ge=4)
    max_output_bytes: int = Field(4096, ge=256)  # the middle of longer output is cut
    max_cells: int = Field(64, gt=0)  # successful cells kept (and replayed) per trajectory
    max_code_chars: int = Field(20_000, gt=0)
    max_concurrent: int = Field(16, gt=0)  # sandboxes running at once in the worker process (others wait)
    cgroup: bool = True  # one memory and pids budget per sandbox where a cgroup v2 is writable

    def sandbox_settings(self) -> SandboxSettings:
        limits = SandboxLimits(
            memory_mb=self.memory_mb, cpu_s=self.cpu_s + int(self.replay_timeout_s), file_mb=self.max_file_mb,
            open_files=self.max_open_files, processes=self.max_processes, disk_mb=self.disk_mb,
        )  # fmt: skip
        return SandboxSettings(
            isolation=self.isolation, python=self.python, bwrap_path=self.bwrap_path, unshare_path=self.unshare_path,
            ro_paths=tuple(self.ro_paths), sandbox_uid=self.sandbox_uid, max_output_bytes=self.max_output_bytes,
            limits=limits, max_concurrent=self.max_concurrent, cgroup=self.cgroup,
        )  # fmt: skip


@dataclass(kw_only=True, slots=True)
class CellReport:
    """What the runner's token lines say about one run (see RUNNER), and the output without them."""

    output: str
    replayed: bool  # the earlier cells ran and the new cell started
    replay_s: float
    ended: str | None  # "done", "raised", or None: the process stopped before the cell ended


def read_report(stdout: str, token: str) -> CellReport:
    """Split the runner's token lines from the cell's output (the head and tail of a long output
    survive the cap, and so do both lines)."""
    replayed, replay_s, ended = False, 0.0, None
    first, sep, rest = stdout.partition("\n")
    if sep and first.startswith(f"{token} replayed "):
        replayed, replay_s, stdout = True, float(first.split()[-1]), rest
    for outcome in ("done", "raised"):
        line = f"\n{token} {outcome}\n"
        if stdout.endswith(line):
            ended, stdout = outcome, stdout[: -len(line)]
    return CellReport(output=stdout, replayed=replayed, replay_s=replay_s, ended=ended)


class CodeInterpreterTool(BaseTool):
    config_model = CodeInterpreterConfig
    config: CodeInterpreterConfig
    idempotent = True  # no effect outside a throwaway sandbox; re-derivable from the journal

    def __init__(self, config: Any = None, tool_schema: Any = None) -> None:
        super().__init__(config=config, tool_schema=tool_schema)
        self.sandbox = Sandbox(self.config.sandbox_settings())  # probes; raises IsolationUnavailable
        logger.info("code interpreter: isolation %s (probe: %s)", self.sandbox.layer, self.sandbox.report.tried)

    @property
    def layer(self) -> str:
        return self.sandbox.layer

    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.one_string_argument(
            "code_interpreter",
            (
                "Run Python code in a stateful sandbox (variables persist between calls; no network). "
                "Printed output is returned, and the value of a final expression is shown."
            ),
            "code",
            "Python code to run",
        )

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return self._instances.start(instance_id, {"cells": []})

    async def restore(self, instance_id: str, journal: list[ToolJournalEntry], **kwargs: Any) -> str:
        """The cells are the journal's completed calls whose result was not an error (never re-run here:
        the next call replays them). A journal holds at most `max_cells` of them unless the limit was
        lowered since; then the latest are kept."""
        cells = [
            e.arguments["code"]
            for e in journal
            if e.status is ToolCallStatus.DONE and e.result is not None and not e.result.is_error
            and isinstance(e.arguments.get("code"), str)
        ]  # fmt: skip
        return self._instances.start(instance_id, {"cells": cells[-self.config.max_cells :]})

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        cells: list[str] = self.instance_state(instance_id)["cells"]
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolExecution(
                text="Error: `code` must be a non-empty string of Python code", metrics={"sandbox/error": 1.0}
            )
        if len(code) > self.config.max_code_chars:
            return ToolExecution(
                text=f"Error: code is longer than {self.config.max_code_chars} characters",
                metrics={"sandbox/error": 1.0},
            )
        if len(cells) >= self.config.max_cells:
            text = (
                f"Error: this interpreter already ran {self.config.max_cells} cells (the limit); no more code can run"
            )
            return ToolExecution(text=text, metrics={"sandbox/error": 1.0})
        token = secrets.token_hex(16)  # unguessable by the cell: only the runner prints it
        job = {
            "replay": cells, "cell": code, "cpu_s": self.config.cpu_s, "wall_s": math.ceil(self.config.timeout_s),
            "replay_wall_s": max(1, math.ceil(self.config.replay_timeout_s)), "token": token,
        }  # fmt: skip
        # The runner's alarms stop the replay after replay_timeout_s and the cell after timeout_s; this
        # outer limit also covers a program that blocks SIGALRM.
        timeout_s = self.config.timeout_s + 1.0 + (self.config.replay_timeout_s if cells else 0.0)
        result = await self.sandbox.run(RUNNER, json.dumps(job).encode(), timeout_s=timeout_s)
        execution = render(result, read_report(result.stdout, token), self.config, num_replayed=len(cells))
        if not execution.is_error:
            cells.append(code)
        return execution

    def close(self) -> None:
        """Kill the sandboxes still running in this process (the worker's shutdown)."""
        self.sandbox.close()


def render(
    result: SandboxResult, report: CellReport, config: CodeInterpreterConfig, *, num_replayed: int = 0
) -> ToolExecution:
    """The observation of one run and its `sandbox/*` metrics."""
    output = report.output
    metrics = {
        "sandbox/wall_s": result.wall_s,
        "sandbox/replay_s": report.replay_s,
        "sandbox/queued_s": result.queued_s,
        "sandbox/timeout": float(result.timed_out),
        "sandbox/output_truncated": float(result.truncated_bytes > 0),
        "sandbox/exit_code": float(result.exit_code if result.exit_code is not None else -1),
        "sandbox/memory_error": float("MemoryError" in output or result.memory_exceeded),
        "sandbox/signal": float(result.signal or 0),
    }
    error = _error_line(result, report, config, num_replayed)
    metrics["sandbox/error"] = float(error is not None)
    if result.setup_error is not None:
        logger.warning("code interpreter sandbox failed: %s", result.setup_error)
        metrics["sandbox/setup_error"] = 1.0
    if error is None:
        return ToolExecution(text=output if output.strip() else "(no output)", metrics=metrics, is_error=False)
    if result.setup_error is None and result.stderr.strip():  # the interpreter's own failure (the cell's
        output += result.stderr  # stderr is merged into stdout)
    text = f"Error: {error}" + (f"\n{output}" if output.strip() else "")
    return ToolExecution(text=text, metrics=metrics, is_error=True)


def _error_line(
    result: SandboxResult, report: CellReport, config: CodeInterpreterConfig, num_replayed: int
) -> str | None:
    if result.setup_error is not None:
        return "the sandbox failed to start (not caused by your code); try again"
    if result.memory_exceeded:
        return (
            f"the code ran out of memory (limit {config.memory_mb} MB for all its processes together) and was stopped"
        )
    if result.processes_exceeded:
        return f"the code started more than {config.max_processes} processes and threads together and was stopped"
    if not report.replayed and num_replayed:  # stopped before the new cell began: the replay's fault
        if result.timed_out or result.exit_code == 3 or result.signal in (signal.SIGALRM, signal.SIGXCPU):
            return (f"re-running the {num_replayed} earlier cell(s) to restore the state took longer than the "
                    f"{config.replay_timeout_s:g} s replay limit; your code did not run")  # fmt: skip
        return (
            f"the interpreter stopped while restoring the state of the earlier cells ({_ended(result)}); "
            "your code did not run"
        )
    if report.ended == "done" and result.exit_code == 0:
        return None
    if result.timed_out or result.signal == signal.SIGALRM:
        return f"the code ran longer than the {config.timeout_s:g} s time limit and was stopped"
    if result.output_killed:
        return "the code printed far too much output and was stopped (the start and end of it follow)"
    if result.signal == signal.SIGXCPU:
        return f"the code used more than {config.cpu_s} s of CPU time and was stopped"
    if result.signal is not None:
        return f"the process was killed by signal {result.signal} ({_signal_name(result.signal)})"
    if report.ended is None:
        return f"the process ended before the code finished ({_ended(result)}, e.g. os._exit); its state is not kept"
    if "MemoryError" in report.output:
        return f"the code ran out of memory (limit {config.memory_mb} MB)"
    return "the code raised an exception"


def _ended(result: SandboxResult) -> str:
    if result.signal is not None:
        return f"signal {result.signal}, {_signal_name(result.signal)}"
    return f"exit status {result.exit_code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"
