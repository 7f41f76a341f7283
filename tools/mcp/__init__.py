"""`MCPToolset`: the tools of one MCP server (stdio or streamable HTTP), listed and called through the
official `mcp` SDK, as ordinary `BaseTool`s of the run's `ToolRegistry`.

A YAML entry `mcp: {command: ...}` / `mcp: {module: ...}` / `mcp: {url: ...}` (see `tools/config.py`)
becomes one toolset per rollout-worker process: the server is started (stdio) or connected to (HTTP)
when the registry is built, because the tool schemas the model sees come from its `tools/list`. Each
MCP tool becomes an `MCPTool` whose schema is the tool's `inputSchema` (see `openai_parameters`), named
`prefix + name`, optionally filtered by `include` / `exclude` (the entry: `MCPServerConfig`, config.py).

Connection lifetime: the SDK's `Client` is an async context manager holding anyio task groups, so it
must be entered and exited by one task. Each toolset therefore runs its own event loop in a daemon
thread; one "owner" task there holds the `async with Client(...)` for the whole life of a connection,
and calls are submitted to that loop from any thread or event loop (`run_coroutine_threadsafe`;
cancelling the caller cancels the call there). This also lets the registry list tools synchronously
while the worker's own loop runs, and keeps the SDK's cancel scopes away from the agent loop.

A result's image parts reach the model as images of the `ToolExecution` (`result_execution`; the
executor admits them for a VLM policy and turns them into an error observation for a text-only one).

Failures are observations, never exceptions into the agent loop: an `isError` result comes back as
"Error: <text>" (without its images), a timeout, an unreachable server or a connection lost mid-call
as an "Error: ..." text saying what happened. When the server process dies or the connection breaks, the next call
reconnects (restarts a stdio server) with bounded attempts and exponential backoff, counted in the
toolset's `MCPCounters` (`mcp_counters` sums them over a registry's toolsets). A call that was in
flight when the connection broke is not re-sent: it may have had its effect. Tools are not
idempotent unless the entry says so (`idempotent: true`, or a list of names).

`close()` (or garbage collection of the toolset, or interpreter exit) ends the connection: the SDK
closes a stdio server's stdin, then terminates its process group, so no child outlives the worker.
A worker killed outright takes its stdio servers along: each is started through a launcher that sets
a parent-death signal (SIGKILL) before it becomes the server, so one that ignores its closed stdin
dies too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import weakref
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.mcp.config import MCPServerConfig
from streamrl.tools.mcp.convert import (  # noqa: F401 (re-exported)
    openai_parameters,
    result_execution,
    result_text,
    tool_schema,
)
from streamrl.tools.schema import OpenAIFunctionToolSchema

if TYPE_CHECKING:  # importing the SDK takes ~1 s; it is imported when a toolset first connects
    import mcp_types
    from mcp import Client

logger = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_LIST_PAGES = 100
# Runs a stdio server: ask for SIGKILL when the parent (this toolset's event-loop thread, which started
# it) dies, check the parent did not die before that, then become the server. The SDK starts servers in
# a session of their own, so without this a worker killed outright leaves behind any server that does
# not exit when its stdin closes.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "if os.getppid() != int(sys.argv[1]):\n    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
_CLOSE_TIMEOUT_S = 15.0  # the SDK's stdio shutdown is bounded by ~6 s (stdin close, SIGTERM, SIGKILL)


# ---------------------------------------------------------------------------------------------------
# The connection (runs on the toolset's own event loop)
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class MCPCounters:
    """Cumulative connection counters of one toolset (or summed over several)."""

    num_connects: int = 0
    num_restarts: int = 0  # connections made after an earlier one was lost (a restarted stdio server)
    num_connect_failures: int = 0  # connection attempts that failed (each call makes a bounded number)
    num_lost_calls: int = 0  # calls in flight when the connection broke (answered with an error)
    num_timeouts: int = 0  # calls past `timeout_s`

    def __add__(self, other: MCPCounters) -> MCPCounters:
        return MCPCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class MCPUnavailable(Exception):
    """The server could not be reached within the configured attempts."""


def _first_cause(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio task groups wrap transport errors)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _explain(exc: BaseException) -> str:
    leaf = _first_cause(exc)
    return f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__


def _is_closed(client: Client) -> bool:
    """Whether the session already saw its transport end (server died while idle). The SDK keeps
    this on its dispatcher without a public accessor; if that changes this answers False and the next
    call fails with "connection lost" instead of reconnecting first (still correct, one error more)."""
    dispatcher = getattr(client.session, "_dispatcher", None)
    return bool(getattr(dispatcher, "_closed", False))


class _Link:
    """The live connection to one server and the counters of its failures; single event loop."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.config = config
        self.client: Client | None = None
        self._generation = 0  # of `client`: a lost call drops only the connection it used
        self._owner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._reconnecting: asyncio.Task[tuple[Client, int]] | None = None
        self.closing = False  # set by `shutdown`: calls failing now fail because of it
        self.counters = MCPCounters()

    def _target(self) -> Any:
        from mcp import StdioServerParameters

        cfg = self.config
        if cfg.url is not None:
            return cfg.url
        command, args = (sys.executable, ["-m", cfg.module, *cfg.args]) if cfg.module else (cfg.command, cfg.args)
        if sys.platform.startswith("linux"):  # the server dies with this process, even killed outright
            command, args = sys.executable, ["-I", "-c", _DIE_WITH_PARENT, str(os.getpid()), str(command), *args]
        return StdioServerParameters(command=command, args=args, env=cfg.env, cwd=cfg.cwd)

    async def connected(self) -> tuple[Client, int]:
        """The live client and its generation. Without one, a single reconnect task shared by every
        waiting call makes the attempts; it is shielded, so a call that times out does not abort a
        server start that the next call can use, and its failure reaches every waiting call."""
        if self.client is not None and not _is_closed(self.client):
            return self.client, self._generation
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())
            self._reconnecting.add_done_callback(lambda task: task.cancelled() or task.exception())  # seen by waiters
        return await asyncio.shield(self._reconnecting)

    async def _reconnect(self) -> tuple[Client, int]:
        """Bounded attempts with exponential backoff; raises MCPUnavailable when all fail."""
        await self.disconnect()
        errors = []
        for attempt in range(self.config.max_connect_attempts):
            if attempt:
                await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            try:
                self.client = await self._connect()
            except Exception as exc:  # world: a server that will not start or answer
                self.counters.num_connect_failures += 1
                errors.append(_explain(exc))
                logger.warning(
                    "MCP server %s: connection attempt %d failed: %s", self.config.label, attempt + 1, errors[-1]
                )
                continue
            self.counters.num_restarts += self.counters.num_connects > 0
            self.counters.num_connects += 1
            self._generation += 1
            return self.client, self._generation
        raise MCPUnavailable(f"{len(errors)} connection attempt(s) failed; last: {errors[-1]}")

    async def _connect(self) -> Client:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Client] = loop.create_future()
        stop = asyncio.Event()
        owner = loop.create_task(self._own(ready, stop), name=f"mcp-owner {self.config.label}")
        try:
            client = await asyncio.wait_for(asyncio.shield(ready), self.config.connect_timeout_s)
        except BaseException as exc:
            stop.set()
            owner.cancel()
            await asyncio.wait({owner}, timeout=_CLOSE_TIMEOUT_S)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"no handshake within {self.config.connect_timeout_s:g} s") from None
            raise
        self._owner, self._stop = owner, stop
        return client

    async def _own(self, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        """Hold the SDK client's `async with` (its task groups, the stdio process) until `stop`.

        Consumes: nothing; waits for `stop`, which `disconnect` sets. A connection that fails before
        it is ready fails `ready`; one that ends later is noticed by the next call (`_is_closed`)."""
        from mcp import Client

        try:
            async with Client(self._target(), read_timeout_seconds=self.config.timeout_s) as client:
                ready.set_result(client)
                await stop.wait()
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:
                logger.warning("MCP server %s: connection ended with %s", self.config.label, _explain(exc))

    async def disconnect(self) -> None:
        """End the current connection, if any; a stdio server is stopped and reaped."""
        owner, stop = self._owner, self._stop
        self.client, self._owner, self._stop = None, None, None
        if owner is None or stop is None:
            return
        stop.set()
        _, pending = await asyncio.wait({owner}, timeout=_CLOSE_TIMEOUT_S)
        if pending:
            logger.warning("MCP server %s did not shut down in %.0f s; cancelling", self.config.label, _CLOSE_TIMEOUT_S)
            owner.cancel()
            await asyncio.wait({owner}, timeout=_CLOSE_TIMEOUT_S)

    async def shutdown(self) -> None:
        """Disconnect, then cancel whatever else still runs on this loop (calls being abandoned)."""
        self.closing = True
        await self.disconnect()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=_CLOSE_TIMEOUT_S)

    async def _drop(self, generation: int) -> None:
        """Disconnect after a lost call, unless a newer connection has replaced the one it used."""
        if generation == self._generation and (self._reconnecting is None or self._reconnecting.done()):
            await self.disconnect()

    async def list_tools(self) -> list[mcp_types.Tool]:
        client, _ = await self.connected()
        tools, cursor = [], None
        for _ in range(_MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                return tools
        raise ValueError(f"MCP server {self.config.label} lists more than {_MAX_LIST_PAGES} pages of tools")

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolExecution:
        """One `tools/call`; every failure is an error observation (see the module docstring)."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        label = self.config.label
        try:
            client, generation = await self.connected()
        except MCPUnavailable as exc:
            return ToolExecution(text=f"Error: the MCP server of tool '{name}' ({label}) is unavailable: {exc}")
        try:
            result = await client.call_tool(name, arguments, read_timeout_seconds=self.config.timeout_s)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                self.counters.num_timeouts += 1
                return ToolExecution(text=f"Error: MCP tool '{name}' timed out after {self.config.timeout_s:g} s")
            if exc.code != CONNECTION_CLOSED:  # the server answered with a protocol error
                return ToolExecution(text=f"Error: the MCP server rejected the call to '{name}': {exc.message}")
            return await self._lost(name, generation, exc)
        except Exception as exc:  # world: transport failures (HTTP errors, broken pipes)
            return await self._lost(name, generation, exc)
        return result_execution(result)

    async def _lost(self, name: str, generation: int, exc: BaseException) -> ToolExecution:
        if self.closing:
            return ToolExecution(text=f"Error: the MCP toolset of tool '{name}' was closed during the call")
        self.counters.num_lost_calls += 1
        logger.warning("MCP server %s: connection lost during a call to %s: %s", self.config.label, name, _explain(exc))
        await self._drop(generation)
        return ToolExecution(
            text=f"Error: the connection to the MCP server of tool '{name}' was lost during the call "
            f"({_explain(exc)}); it may or may not have taken effect. The server is restarted for the next call."
        )


# ---------------------------------------------------------------------------------------------------
# The toolset and its tools (any thread / event loop)
# ---------------------------------------------------------------------------------------------------


class _Runtime:
    """The toolset's event loop thread and its `_Link`. Holds no reference to the toolset, so the
    toolset can be garbage collected (its finalizer calls `close`)."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.link = _Link(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()
        self.closed = False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._guard:
            if self.closed:
                coro.close()
                raise RuntimeError(f"the MCP toolset for {self.link.config.label} is closed")
            if self._loop is None:  # lazily: the first listing or call starts the thread
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-toolset", daemon=True)
                self._thread.start()
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        with self._guard:
            if self.closed:
                return
            self.closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if threading.current_thread() is thread:  # only if someone closes from inside a call
            loop.call_soon(loop.create_task, self.link.shutdown())
            return
        try:
            asyncio.run_coroutine_threadsafe(self.link.shutdown(), loop).result(_CLOSE_TIMEOUT_S * 3)
        except Exception as exc:  # best effort: the process group is killed by the SDK's own shutdown
            logger.warning("MCP server %s: close failed: %s", self.link.config.label, _explain(exc))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()


class MCPToolset:
    """One MCP server per process and its tools as `BaseTool`s. See the module docstring."""

    def __init__(self, config: MCPServerConfig | Mapping[str, Any]) -> None:
        self.config = config if isinstance(config, MCPServerConfig) else MCPServerConfig.model_validate(dict(config))
        self._runtime = _Runtime(self.config)
        self._finalizer = weakref.finalize(self, _Runtime.close, self._runtime)  # also runs at exit

    def tools(self, timeout_s: float | None = None) -> list[MCPTool]:
        """List the server's tools (connecting first) as `MCPTool`s, filtered and renamed per config.
        Blocks the calling thread; ValueError if the server cannot be reached or a name is wrong."""
        cfg = self.config
        budget = timeout_s or (cfg.connect_timeout_s + cfg.backoff_s) * cfg.max_connect_attempts + cfg.timeout_s
        try:
            listed = self._runtime.submit(self._runtime.link.list_tools()).result(budget)
        except Exception as exc:  # unreachable, timed out, or a protocol error: the entry cannot be built
            raise ValueError(f"cannot list the tools of MCP server {cfg.label}: {_explain(exc)}") from None
        return self._select(listed)

    def _select(self, listed: Iterable[mcp_types.Tool]) -> list[MCPTool]:
        cfg = self.config
        by_name = {tool.name: tool for tool in listed}
        named = set(cfg.include or ()) | set(cfg.exclude)
        if not isinstance(cfg.idempotent, bool):
            named |= set(cfg.idempotent)
        unknown = sorted(named - set(by_name))
        if unknown:
            raise ValueError(f"MCP server {cfg.label} has no tool(s) {unknown}; it has {sorted(by_name)}")
        keep = [n for n in by_name if (cfg.include is None or n in cfg.include) and n not in cfg.exclude]
        return [
            MCPTool(self, n, tool_schema(by_name[n], cfg.prefix + n), idempotent=cfg.is_idempotent(n)) for n in keep
        ]

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolExecution:
        """Call MCP tool `name` (its server-side name) from any event loop."""
        try:
            return await asyncio.wrap_future(self._runtime.submit(self._runtime.link.call(name, arguments)))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # our caller was cancelled: propagate
                raise
            # `close` cancelled the call on the toolset's loop: an answer, not the trajectory's cancellation
            return ToolExecution(text=f"Error: the MCP toolset of tool '{name}' was closed during the call")

    @property
    def counters(self) -> MCPCounters:
        """A snapshot of the connection counters (updated on the toolset's own thread)."""
        counters = self._runtime.link.counters
        return MCPCounters(**{f.name: getattr(counters, f.name) for f in fields(counters)})

    @property
    def closed(self) -> bool:
        return self._runtime.closed

    def close(self) -> None:
        """Disconnect (stopping a stdio server) and end the toolset's thread; idempotent, blocking."""
        self._finalizer()

    async def aclose(self) -> None:
        """`close` without blocking the caller's event loop."""
        await asyncio.to_thread(self.close)


class MCPTool(BaseTool):
    """One tool of an `MCPToolset`. The server holds whatever state a tool has, so instances are the
    default per-trajectory bookkeeping and `restore` replays nothing."""

    def __init__(
        self, toolset: MCPToolset, mcp_name: str, schema: OpenAIFunctionToolSchema, *, idempotent: bool
    ) -> None:
        super().__init__(config=None, tool_schema=schema)
        self.toolset = toolset
        self.mcp_name = mcp_name
        self.idempotent = idempotent  # per tool, shadows BaseTool's class default

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        return await self.toolset.call(self.mcp_name, parameters)


def toolsets(tools: Iterable[BaseTool]) -> list[MCPToolset]:
    """The distinct MCP toolsets behind `tools` (e.g. `registry.tools.values()`)."""
    found: dict[int, MCPToolset] = {}
    for tool in tools:
        if isinstance(tool, MCPTool):
            found.setdefault(id(tool.toolset), tool.toolset)
    return list(found.values())


def close_toolsets(tools: Iterable[BaseTool]) -> None:
    """Close every MCP toolset behind `tools` (a worker's shutdown path)."""
    for toolset in toolsets(tools):
        toolset.close()


def mcp_counters(tools: Iterable[BaseTool]) -> MCPCounters:
    """The connection counters of the toolsets behind `tools`, summed."""
    return sum((toolset.counters for toolset in toolsets(tools)), MCPCounters())
