"""The parent side of one sandboxed run: spawn the first stage, feed stdin, drain capped output, kill
the whole sandbox on timeout, flood or cancellation, and read the outcome (`SandboxResult`).

Split from `sandbox.py`, which chooses the layer and builds the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamrl.core.aio import observe_outcome
from streamrl.tools.sandbox.reaper import SandboxRegistry
from streamrl.tools.sandbox.stages import _MARKER, SETUP_FAILED, SIGNAL_BASE
from streamrl.tools.sandbox.watch import LIMIT_EXCEEDED, LIMIT_MARKER

if TYPE_CHECKING:
    from streamrl.tools.sandbox import SandboxSettings

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_GRACE_S = 2.0  # after a kill, how long the pipes may take to close


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    """One run. `exit_code` is None when a signal (`signal`) or the sandbox (`timed_out`,
    `output_killed`, `memory_exceeded`, `processes_exceeded`) ended the program; `setup_error` is set
    when the sandbox itself failed."""

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
    memory_exceeded: bool = False  # the sandbox went over its memory budget and was killed (cgroup or watch)
    processes_exceeded: bool = False  # the supervisor stopped the sandbox at a fork past its process limit
    queued_s: float = 0.0  # waiting for a free sandbox slot (the per-process cap), not in wall_s


class CappedStream:
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


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
        await writer.drain()
        writer.close()
    except (BrokenPipeError, ConnectionResetError):  # the program exited without reading its input
        pass


async def _execute(
    argv: list[str], stdin: bytes, timeout_s: float, settings: SandboxSettings, layer: str,
    registry: SandboxRegistry | None = None,
) -> SandboxResult:  # fmt: skip
    """Run `argv` (a sandbox's first stage) to its end; `registry` records it while it runs."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={"PATH": SAFE_PATH}, start_new_session=True,
    )  # fmt: skip
    record = registry.add(proc.pid) if registry is not None else None
    try:
        return await _wait(proc, stdin, timeout_s, settings, layer, start)
    finally:
        if registry is not None:
            registry.discard(record)


async def _wait(proc: asyncio.subprocess.Process, stdin: bytes, timeout_s: float, settings: SandboxSettings,
                layer: str, start: float) -> SandboxResult:  # fmt: skip

    def kill() -> None:
        if layer == "none":  # the first stage kills everything below it, what left the group included
            _signal(proc.pid, signal.SIGTERM)
        else:  # the process group holds the whole sandbox: init, whose death ends the pid namespace
            _killpg(proc.pid)

    out = CappedStream(settings.max_output_bytes, settings.kill_output_bytes, kill)
    err = CappedStream(settings.max_output_bytes, settings.kill_output_bytes, kill)
    to_stdin, from_stdout, from_stderr = proc.stdin, proc.stdout, proc.stderr
    assert to_stdin is not None and from_stdout is not None and from_stderr is not None, "started with pipes"
    work = asyncio.ensure_future(
        asyncio.gather(_feed(to_stdin, stdin), out.drain(from_stdout), err.drain(from_stderr), proc.wait())
    )
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
        if not work.done():  # pipes still open after the kill (isolation "none": the first stage was
            _killpg(proc.pid)  # stopped?): kill its group outright, then stop waiting for the pipes
            await asyncio.wait({work}, timeout=_GRACE_S)
        if not work.done():
            work.cancel()
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()
        if proc.returncode is None:  # cancelled (the caller's own timeout) or the pipes never closed
            _killpg(proc.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), _GRACE_S)
    return _result(proc.returncode, out, err, timed_out, layer, time.perf_counter() - start)


def _result(
    rc: int | None, out: CappedStream, err: CappedStream, timed_out: bool, layer: str, wall_s: float
) -> SandboxResult:
    stderr = err.text()
    flooded = out.flooded or err.flooded
    setup_error = None
    if rc == SETUP_FAILED and _MARKER in stderr:
        setup_error = stderr[stderr.index(_MARKER) :].strip()[:2000]
    over = None  # "memory" or "processes": the sandbox's first process stopped it (`watch.py`)
    if rc == LIMIT_EXCEEDED and LIMIT_MARKER in stderr:
        over = stderr[stderr.rindex(LIMIT_MARKER) + len(LIMIT_MARKER) :].split(":")[0].strip()
    sig = None
    if rc is not None and rc < 0:
        sig = -rc
    elif rc is not None and SIGNAL_BASE < rc < SIGNAL_BASE + 65:
        sig = rc - SIGNAL_BASE
    elif over is not None:
        sig = signal.SIGKILL
    ended_by_sandbox = timed_out or flooded or sig is not None or setup_error is not None
    return SandboxResult(
        stdout=out.text(), stderr=stderr, exit_code=None if ended_by_sandbox else rc, signal=sig,
        timed_out=timed_out, output_killed=flooded and not timed_out, truncated_bytes=out.cut + err.cut,
        wall_s=wall_s, layer=layer, setup_error=setup_error, memory_exceeded=over == "memory",
        processes_exceeded=over == "processes",
    )  # fmt: skip
