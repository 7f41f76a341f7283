"""`ToolRegistry`: the tools of a run, the per-trajectory tool instances, and the fault boundary that
executes parsed tool calls.

Execution is two steps so the agent loop can journal a call before it runs: `check_calls` answers
the calls that cannot reach a tool (malformed, unknown tool, wrong arguments, beyond the per-turn
parallel limit) with error results and returns the others validated; `run_calls` runs those
concurrently. `execute_calls` is both in one. This is a deliberate catch-all boundary ("survive where
it is the world"): timeouts and exceptions raised by a tool also become error results whose text
tells the model what went wrong; each is counted in the registry's metrics. A tool's own result text
starting with "Error:" (the convention of our tools) is also flagged `is_error`, unless the tool says
otherwise (`ToolExecution.is_error`). Only
`asyncio.CancelledError` propagates, so a cancelled trajectory cancels its tool calls.

Images a tool returns (`ToolExecution.images`) are admitted here, at the same boundary: with the
worker's image store (a VLM policy) they are decoded once and stored, and the result lists their refs;
a text-only policy or an unreadable image makes the result an error result instead (`run_calls`).

Instances: one per (trajectory, tool), for the whole trajectory. `open_session` returns the live
instances of a trajectory that parked in this process, and otherwise creates them from verl-style
`tools_kwargs` (`{tool_name: {"create_kwargs": {...}}}`), restoring tools that have completed calls
in the trajectory's journal (`BaseTool.restore`); `close_session` releases them when the trajectory
ends. A trajectory that parked here but resumes elsewhere leaves its instances here until this
process ends (the driver only moves trajectories whose worker died).
`create_instances` / `release_instances` are the same without the session bookkeeping.

While a tool's `execute` runs, `current_call()` returns the call it serves (its call id is unique in
the trajectory), so a tool with side effects can key them by (instance id, call id). `on_executed`,
when set, is called right after a tool returned and before its result is recorded anywhere: the
fault-injection point for "the side effect happened, the trajectory does not know yet".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any, Protocol

from streamrl.models.images import ImageRef
from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.schema import validate_call
from streamrl.tools.slots import ToolThreads
from streamrl.tools.types import ToolCall, ToolCallStatus, ToolJournalEntry, ToolResult

logger = logging.getLogger(__name__)


class ImageStore(Protocol):
    """Where the images a tool returns are admitted: the rollout worker's `rollout.images.ImageStore`
    (bytes by hash); its pixel cap is the one a returned image is read under."""

    max_pixels: int

    def put(self, data: bytes) -> ImageRef: ...


DEFAULT_MAX_RESULT_CHARS = 8192
IMAGE_ADMIT_TIMEOUT_S = 30.0  # reading + decoding one image a tool returned
# Image admission decodes in threads of its own, never the event loop's default executor, which tools
# or libraries may have exhausted; a read past IMAGE_ADMIT_TIMEOUT_S is an error result.
_IMAGE_THREADS = ToolThreads(4, name="image-admission")
_CURRENT_CALL: ContextVar[ToolCall | None] = ContextVar("streamrl_current_tool_call", default=None)


def current_call() -> ToolCall | None:
    """The call whose `execute` is running in this task (None outside one)."""
    return _CURRENT_CALL.get()


def coerce_execution(result: Any) -> ToolExecution:
    """Accept our `ToolExecution`, a bare string, or verl's `(response, reward, metrics)` tuple where
    the response is a string or an object with a `.text` attribute (and optionally verl's
    `ToolResponse.image` list, taken as the result's images)."""
    if isinstance(result, ToolExecution):
        return result
    if isinstance(result, str):
        return ToolExecution(text=result)
    if isinstance(result, tuple) and len(result) == 3:
        response, reward, metrics = result
        text = response if isinstance(response, str) else getattr(response, "text", None)
        if text is None:
            raise TypeError(f"tool response {type(response).__name__} has no text")
        numeric = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        images = [] if isinstance(response, str) else list(getattr(response, "image", None) or [])
        return ToolExecution(text=text, reward=float(reward or 0.0), metrics=numeric, images=images)
    raise TypeError(f"tool returned {type(result).__name__}; expected ToolExecution, str or (text, reward, metrics)")


class ToolRegistry:
    def __init__(self, tools: Iterable[BaseTool] = (), *, max_result_chars: int = DEFAULT_MAX_RESULT_CHARS) -> None:
        if max_result_chars <= 0:
            raise ValueError(f"max_result_chars must be positive, got {max_result_chars}")
        self.tools: dict[str, BaseTool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool
        self.max_result_chars = max_result_chars
        self._ignored_kwargs: set[str] = set()  # tools_kwargs names already warned about
        self._schemas = [tool.schema.to_openai() for tool in self.tools.values()]
        self.num_calls = 0
        self.num_errors = 0  # every error result, whatever the cause
        self.num_timeouts = 0
        self.num_parse_errors = 0  # calls the parser already marked malformed
        self.num_validation_errors = 0  # unknown tool / bad arguments
        self.num_exceptions = 0  # tools that raised
        self.num_rejected = 0  # beyond max_parallel
        self.num_interrupted = 0  # in doubt after a resume, not idempotent, not re-run
        self.num_executed = 0  # calls that ran to completion inside a tool
        self.total_latency_s = 0.0  # of those calls
        self._sessions: dict[str, dict[str, str]] = {}  # trajectory_id -> {tool_name: instance_id}
        self.on_executed: Callable[[ToolCall], None] | None = None

    # -- catalogue -----------------------------------------------------------------------------------
    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas, for `apply_chat_template(tools=...)`."""
        return [dict(s) for s in self._schemas]

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def get(self, name: str) -> BaseTool:
        if name not in self.tools:
            raise ValueError(f"unknown tool {name!r}; available: {self.names}")
        return self.tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def __len__(self) -> int:
        return len(self.tools)

    # -- instance life cycle -------------------------------------------------------------------------
    def _create_kwargs(self, tools_kwargs: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
        """Each registered tool's create kwargs from a row's `tools_kwargs`. As in verl, kwargs for a
        tool this run does not configure are ignored (verl datasets carry them for tools such as
        `calc_gsm8k_reward`); each such name is logged once, so a misspelt tool name is visible."""
        tools_kwargs = tools_kwargs or {}
        for name in sorted(set(tools_kwargs) - set(self.tools) - self._ignored_kwargs):
            self._ignored_kwargs.add(name)
            logger.warning(
                "tools_kwargs names tool %r, which is not configured (tools: %s): its kwargs are ignored",
                name,
                self.names,
            )
        return {name: dict((tools_kwargs.get(name) or {}).get("create_kwargs") or {}) for name in self.tools}

    async def create_instances(self, tools_kwargs: Mapping[str, Any] | None = None) -> dict[str, str]:
        """One instance per registered tool; returns {tool_name: instance_id}."""
        create_kwargs = self._create_kwargs(tools_kwargs)
        return {name: await tool.create(**create_kwargs[name]) for name, tool in self.tools.items()}

    async def release_instances(self, instance_ids: Mapping[str, str]) -> None:
        for name, instance_id in instance_ids.items():
            if name in self.tools:
                await self.tools[name].release(instance_id)

    async def open_session(
        self, trajectory_id: str, tools_kwargs: Mapping[str, Any] | None, journal: list[ToolJournalEntry]
    ) -> dict[str, str]:
        """The instances of one trajectory ({tool_name: instance_id}, instance id = trajectory id).

        Live ones if the trajectory parked in this process; otherwise created, or restored from the
        journal's completed calls for tools that have some (the trajectory resumed from its snapshot
        in a new process). The returned dict is the session: close it with `close_session`."""
        if trajectory_id in self._sessions:
            return self._sessions[trajectory_id]
        create_kwargs = self._create_kwargs(tools_kwargs)
        ids = self._sessions[trajectory_id] = {}  # filled as we go, so a failure still releases
        for name, tool in self.tools.items():
            done = [e for e in journal if e.name == name and e.status is ToolCallStatus.DONE]
            if done:
                ids[name] = await tool.restore(trajectory_id, done, **create_kwargs[name])
            else:
                ids[name] = await tool.create(trajectory_id, **create_kwargs[name])
        return ids

    async def close_session(self, trajectory_id: str) -> None:
        """Release a trajectory's instances (it finished or failed); a no-op for an unknown one."""
        ids = self._sessions.pop(trajectory_id, None)
        if ids:
            await self.release_instances(ids)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def is_idempotent(self, name: str) -> bool:
        tool = self.tools.get(name)
        return tool is not None and tool.idempotent

    async def tool_rewards(self, instance_ids: Mapping[str, str]) -> dict[str, float]:
        """{tool_name: calc_reward} for every instance."""
        return {
            name: float(await self.tools[name].calc_reward(iid))
            for name, iid in instance_ids.items()
            if name in self.tools
        }

    # -- execution -----------------------------------------------------------------------------------
    def check_calls(self, calls: list[ToolCall], *, max_parallel: int) -> list[ToolCall | ToolResult]:
        """One entry per call, in order: the validated call if it will reach a tool (well formed, known
        tool, valid arguments, among the first `max_parallel`), else its error result."""
        if max_parallel <= 0:
            raise ValueError(f"max_parallel must be positive, got {max_parallel}")
        out: list[ToolCall | ToolResult] = []
        for i, call in enumerate(calls):
            if i >= max_parallel:
                self.num_rejected += 1
                message = f"too many tool calls in one turn (limit {max_parallel}); this call was not executed"
                out.append(self._error(call, message))
            elif call.error is not None:
                self.num_parse_errors += 1
                out.append(self._error(call, call.error))
            else:
                checked = validate_call(call, self._schemas)
                if checked.error is not None:
                    self.num_validation_errors += 1
                    out.append(self._error(call, checked.error))
                else:
                    out.append(checked)
        self.num_calls += len(calls)
        return out

    async def run_calls(
        self, calls: list[ToolCall], instance_ids: dict[str, str], *, timeout_s: float, images: ImageStore | None = None
    ) -> list[ToolResult]:
        """Run calls that passed `check_calls` concurrently; one ToolResult per call, in order.

        `images` is the worker's image store for a VLM policy (None: the policy reads text only). The
        images a tool returns are read and fully decoded (off the event loop, in threads of their own,
        within `IMAGE_ADMIT_TIMEOUT_S` each, refused above the store's `max_pixels`), then all put into the
        store and listed in `ToolResult.images`; an unreadable image, or any image without a store,
        makes the whole result an error result whose text says why, followed by the tool's text
        (no image of that call is shown: all or nothing keeps the placeholder order simple)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        return list(await asyncio.gather(*(self._run_one(c, instance_ids, timeout_s, images) for c in calls)))

    async def execute_calls(
        self,
        calls: list[ToolCall],
        instance_ids: dict[str, str],
        *,
        timeout_s: float,
        max_parallel: int,
        images: ImageStore | None = None,
    ) -> list[ToolResult]:
        """`check_calls` then `run_calls`: one ToolResult per call, in order."""
        if timeout_s <= 0 or max_parallel <= 0:
            raise ValueError(f"timeout_s and max_parallel must be positive, got {timeout_s}, {max_parallel}")
        plan = self.check_calls(calls, max_parallel=max_parallel)
        runnable = [c for c in plan if isinstance(c, ToolCall)]
        ran = iter(await self.run_calls(runnable, instance_ids, timeout_s=timeout_s, images=images))
        return [next(ran) if isinstance(c, ToolCall) else c for c in plan]

    def interrupted(self, call: ToolCall) -> ToolResult:
        """The answer to a call whose worker stopped while it ran and that is not safe to re-run."""
        self.num_interrupted += 1
        return self._error(
            call,
            f"the call to tool '{call.name}' was interrupted and its outcome is unknown; "
            "it was not run again (the tool is not idempotent)",
        )

    def _error(self, call: ToolCall, message: str, latency_s: float = 0.0) -> ToolResult:
        self.num_errors += 1
        return ToolResult(
            call_id=call.call_id, name=call.name, text=f"Error: {message}", is_error=True, latency_s=latency_s
        )

    async def _run_one(
        self, call: ToolCall, instance_ids: dict[str, str], timeout_s: float, images: ImageStore | None
    ) -> ToolResult:
        tool = self.tools[call.name]
        start = time.perf_counter()
        token = _CURRENT_CALL.set(call)  # this task's own context (gather runs each call in a task)
        try:
            if call.name not in instance_ids:
                instance_ids[call.name] = await tool.create()
            raw = await asyncio.wait_for(tool.execute(instance_ids[call.name], call.arguments), timeout_s)
            if self.on_executed is not None:
                self.on_executed(call)
            execution = coerce_execution(raw)
        except TimeoutError:
            self.num_timeouts += 1
            return self._error(call, f"tool '{call.name}' timed out after {timeout_s:g} s", time.perf_counter() - start)
        except Exception as exc:  # fault boundary: a broken tool must not kill the trajectory
            self.num_exceptions += 1
            logger.warning("tool %s raised %s: %s", call.name, type(exc).__name__, exc)
            return self._error(
                call, f"tool '{call.name}' failed: {type(exc).__name__}: {exc}", time.perf_counter() - start
            )
        finally:
            _CURRENT_CALL.reset(token)
        admitted = await self._admit_images(call, execution, images)
        latency_s = time.perf_counter() - start
        self.num_executed += 1
        self.total_latency_s += latency_s
        text = execution.text
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f"\n[truncated: {len(execution.text)} characters]"
        if isinstance(admitted, str):
            return self._error(call, admitted + (f"\n{text}" if text else ""), latency_s)
        is_error = execution.is_error if execution.is_error is not None else text.startswith("Error:")
        if is_error:
            self.num_errors += 1
        return ToolResult(
            call_id=call.call_id,
            name=call.name,
            text=text,
            reward=execution.reward,
            is_error=is_error,
            latency_s=latency_s,
            images=admitted,
        )

    @staticmethod
    async def _admit_images(call: ToolCall, execution: ToolExecution, store: ImageStore | None) -> list[ImageRef] | str:
        """The refs of a result's images, all put into `store`, or why none of them can be shown."""
        if not execution.images:
            return []
        n = len(execution.images)
        if store is None:
            return f"tool '{call.name}' returned {n} image(s) but the policy reads text only; they were not shown"
        from streamrl.models.images import read_response_image

        blobs: list[bytes] = []
        for i, source in enumerate(execution.images):
            try:
                read = _IMAGE_THREADS.run(read_response_image, source, max_pixels=store.max_pixels)
                blobs.append(await asyncio.wait_for(read, IMAGE_ADMIT_TIMEOUT_S))
            except TimeoutError:
                return (
                    f"tool '{call.name}' returned an image (#{i + 1} of {n}) that took more than "
                    f"{IMAGE_ADMIT_TIMEOUT_S:g} s to read; no image was shown"
                )
            except (ValueError, TypeError) as exc:
                return f"tool '{call.name}' returned an unreadable image (#{i + 1} of {n}): {exc}; no image was shown"
        return [store.put(blob) for blob in blobs]

    def metrics(self) -> dict[str, float]:
        """Cumulative counters, namespaced for the run's metrics stream (with an MCP toolset, its
        connection counters too)."""
        from streamrl.tools.mcp import mcp_counters, toolsets

        out = self._call_counters()
        if toolsets(self.tools.values()):
            mcp = mcp_counters(self.tools.values())
            out.update(
                {
                    "rollout/tools/num_mcp_restarts": float(mcp.num_restarts),
                    "rollout/tools/num_mcp_connect_failures": float(mcp.num_connect_failures),
                    "rollout/tools/num_mcp_lost_calls": float(mcp.num_lost_calls),
                    "rollout/tools/num_mcp_timeouts": float(mcp.num_timeouts),
                }
            )
        return out

    def close(self) -> None:
        """Stop what the tools started (MCP servers, running sandboxes); the worker's shutdown calls it."""
        from streamrl.tools.mcp import close_toolsets

        for tool in self.tools.values():
            tool.close()
        close_toolsets(self.tools.values())

    def _call_counters(self) -> dict[str, float]:
        return {
            "rollout/tools/num_calls": float(self.num_calls),
            "rollout/tools/num_errors": float(self.num_errors),
            "rollout/tools/num_timeouts": float(self.num_timeouts),
            "rollout/tools/num_parse_errors": float(self.num_parse_errors),
            "rollout/tools/num_validation_errors": float(self.num_validation_errors),
            "rollout/tools/num_exceptions": float(self.num_exceptions),
            "rollout/tools/num_rejected": float(self.num_rejected),
            "rollout/tools/num_interrupted": float(self.num_interrupted),
            "rollout/tools/num_executed": float(self.num_executed),
            "rollout/tools/latency_sum_s": self.total_latency_s,
        }
