"""MCP toolsets against the real SDK and the example server (workloads/tools/mcp_example_server.py):
listing and exact schemas, calls through the registry's fault boundary, error results, timeouts,
restart after a crash, streamable HTTP, config errors, that no server process outlives close, and
image results: the server's PNG bytes reach the `ToolExecution`, the worker's image store and, through
`ToolAgentLoop` with the tiny VLM's processor (FakeEngine), the observation and `AgentData.images`."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mcp_types
import pytest

from streamrl.tools import ToolRegistry, load_tool_config
from streamrl.tools.base import ToolExecution
from streamrl.tools.mcp import (
    MCPCounters,
    MCPTool,
    MCPToolset,
    _is_closed,
    close_toolsets,
    mcp_counters,
    openai_parameters,
    result_execution,
    result_text,
    toolsets,
)
from streamrl.tools.types import ToolCall

SERVER = "streamrl.workloads.tools.mcp_example_server"
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tools"
pytestmark = pytest.mark.timeout(60)


def _call(i: int, name: str, **arguments) -> ToolCall:
    return ToolCall(call_id=f"call_{i}", name=name, arguments=arguments)


def _registry(**server) -> ToolRegistry:
    return load_tool_config({"tools": [{"mcp": {"module": SERVER, "backoff_s": 0.1, **server}}]})


async def _run(registry: ToolRegistry, *calls: ToolCall, timeout_s: float = 40.0):
    """Execute `calls`; the default deadline leaves a restarting server time on a loaded machine."""
    return await registry.execute_calls(list(calls), {}, timeout_s=timeout_s, max_parallel=8)


async def _server_pid(registry: ToolRegistry, name: str = "pid") -> int:
    (result,) = await _run(registry, _call(0, name))
    assert not result.is_error, result.text
    return int(result.text)


def _kill_while_idle(registry: ToolRegistry, pid: int) -> None:
    """SIGKILL the server and wait until the client has read the end of its stdout."""
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    (toolset,) = toolsets(registry.tools.values())
    deadline = time.monotonic() + 10
    while not _is_closed(toolset._runtime.link.client):
        assert time.monotonic() < deadline, "the client did not notice the server's death"
        time.sleep(0.02)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process `pid` no longer exists (reaped, not a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def registry():
    registry = _registry(timeout_s=2.0)
    yield registry
    close_toolsets(registry.tools.values())


# -- listing -----------------------------------------------------------------------------------------


def test_stdio_listing_gives_the_servers_tools_with_exact_schemas(registry):
    assert registry.names == ["add", "echo", "solid_color", "fail", "crash", "slow", "pid"]
    schemas = {s["function"]["name"]: s for s in registry.schemas()}
    assert schemas["add"] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    assert schemas["fail"]["function"]["parameters"] == {
        "type": "object",
        "properties": {"message": {"type": "string", "default": "this tool always fails"}},
        "required": [],
    }
    assert schemas["slow"]["function"]["parameters"]["properties"] == {"seconds": {"type": "number"}}
    assert schemas["pid"]["function"] == {
        "name": "pid",
        "description": "The id of the server process.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    }
    assert all(isinstance(t, MCPTool) and not t.idempotent for t in registry.tools.values())
    assert len(toolsets(registry.tools.values())) == 1  # one server for all its tools


# -- calls -------------------------------------------------------------------------------------------


async def test_calls_through_the_registry_validate_arguments_and_report_errors(registry):
    results = await _run(
        registry,
        _call(0, "add", a=2, b=40),
        _call(1, "add", a=2.0, b=3),  # the executor coerces integral floats
        _call(2, "add", a="2", b=3),
        _call(3, "add", a=1),
        _call(4, "echo", text="héllo\nworld"),
        _call(5, "fail", message="no such file"),
        _call(6, "nope"),
    )
    texts = [r.text for r in results]
    assert texts[:2] == ["42", "5"]
    assert texts[2] == "Error: invalid arguments for tool 'add': argument 'a' must be of type integer, got string '2'"
    assert texts[3] == "Error: invalid arguments for tool 'add': missing required argument(s) 'b'"
    assert texts[4] == "héllo\nworld"
    assert texts[5].startswith("Error: ") and texts[5].endswith("no such file")  # isError result
    assert texts[6].startswith("Error: unknown tool 'nope'")
    assert [r.is_error for r in results] == [False, False, True, True, False, True, True]
    assert registry.num_validation_errors >= 3 and registry.num_exceptions == 0


async def test_timeouts_cancel_the_call_and_keep_the_connection(registry):
    before = mcp_counters(registry.tools.values())
    own, executor, quick = await _run(
        registry, _call(0, "slow", seconds=5), _call(1, "slow", seconds=0.1), _call(2, "slow", seconds=0.1)
    )
    assert own.text == "Error: MCP tool 'slow' timed out after 2 s" and own.is_error  # the toolset's timeout_s
    assert (executor.text, quick.text) == ("slept 0.1 s", "slept 0.1 s")
    (cut,) = await _run(registry, _call(3, "slow", seconds=5), timeout_s=0.3)  # the executor's timeout
    assert cut.text == "Error: tool 'slow' timed out after 0.3 s"
    (after,) = await _run(registry, _call(4, "add", a=1, b=1))
    assert after.text == "2"
    counters = mcp_counters(registry.tools.values())
    assert counters.num_timeouts == before.num_timeouts + 1
    assert counters.num_restarts == before.num_restarts  # a slow call is not a broken server


async def test_a_crash_fails_that_call_and_the_next_call_restarts_the_server(registry):
    before = mcp_counters(registry.tools.values())
    old_pid = await _server_pid(registry)
    (crashed,) = await _run(registry, _call(0, "crash"))
    assert crashed.is_error and "connection to the MCP server of tool 'crash' was lost during the call" in crashed.text
    (after,) = await _run(registry, _call(1, "add", a=20, b=22))
    assert after.text == "42" and not after.is_error
    new_pid = await _server_pid(registry)
    assert new_pid != old_pid and _wait_gone(old_pid)
    counters = mcp_counters(registry.tools.values())
    assert (counters.num_restarts, counters.num_lost_calls) == (before.num_restarts + 1, before.num_lost_calls + 1)
    metrics = registry.metrics()  # what the run logs (keys declared in core/catalogue.py)
    assert metrics["rollout/tools/num_mcp_restarts"] == counters.num_restarts
    assert metrics["rollout/tools/num_mcp_lost_calls"] == counters.num_lost_calls


async def test_a_server_killed_while_idle_is_restarted_before_the_next_call(registry):
    before = mcp_counters(registry.tools.values())
    _kill_while_idle(registry, await _server_pid(registry))
    (result,) = await _run(registry, _call(0, "add", a=1, b=2))
    assert result.text == "3" and not result.is_error  # nothing was in flight: no call is lost
    counters = mcp_counters(registry.tools.values())
    assert counters.num_restarts == before.num_restarts + 1 and counters.num_lost_calls == before.num_lost_calls


async def test_calls_waiting_for_a_restart_share_it_and_giving_up_does_not_abort_it(registry):
    before = mcp_counters(registry.tools.values())
    _kill_while_idle(registry, await _server_pid(registry))
    (gave_up,) = await _run(registry, _call(0, "add", a=1, b=1), timeout_s=0.2)  # the server takes ~1 s to start
    assert gave_up.text == "Error: tool 'add' timed out after 0.2 s"
    results = await _run(registry, *[_call(i, "add", a=i, b=1) for i in range(4)])
    assert [r.text for r in results] == ["1", "2", "3", "4"]
    counters = mcp_counters(registry.tools.values())
    assert (counters.num_restarts, counters.num_connect_failures) == (
        before.num_restarts + 1,
        before.num_connect_failures,
    )


async def test_an_unreachable_server_is_an_error_observation_and_counted():
    toolset = MCPToolset({"command": "/nonexistent/mcp-server", "max_connect_attempts": 2, "backoff_s": 0.01})
    try:
        result = await toolset.call("add", {"a": 1, "b": 2})
        assert result.text.startswith("Error: the MCP server of tool 'add' (/nonexistent/mcp-server) is unavailable: ")
        assert "2 connection attempt(s) failed" in result.text
        assert toolset.counters == MCPCounters(num_connect_failures=2)
    finally:
        toolset.close()
    with pytest.raises(RuntimeError, match="is closed"):
        await toolset.call("add", {})


# -- config ------------------------------------------------------------------------------------------


async def test_example_yaml_filters_renames_and_declares_idempotent_tools():
    registry = load_tool_config(CONFIGS / "mcp_example.yaml")
    try:
        assert registry.names == ["calc_add", "calc_echo", "calculator"]
        assert registry.is_idempotent("calc_add") and registry.is_idempotent("calc_echo")
        assert registry.tools["calc_add"].mcp_name == "add"
        add, echo = await _run(registry, _call(0, "calc_add", a=3, b=4), _call(1, "calc_echo", text="hi"))
        assert (add.text, echo.text) == ("7", "hi")
    finally:
        close_toolsets(registry.tools.values())


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        (
            {"mcp": {"url": "http://example.com:8000/mcp"}},
            "is not on this machine (127.0.0.1 / localhost); set `allow_remote: true`",
        ),
        ({"mcp": {"url": "http://10.0.0.5/mcp"}}, "allow_remote"),
        ({"mcp": {"url": "ftp://127.0.0.1/mcp"}}, "is not an http(s) URL"),
        ({"mcp": {"command": "x", "url": "http://127.0.0.1:1/mcp"}}, "exactly one of `command`, `module`"),
        ({"mcp": {}}, "exactly one of `command`, `module`"),
        ({"mcp": {"url": "http://127.0.0.1:1/mcp", "args": ["-v"]}}, "apply to stdio servers"),
        ({"mcp": {"command": "x", "allow_remote": True}}, "`allow_remote` applies to `url` servers only"),
        ({"mcp": {"command": "x", "include": ["a"], "exclude": ["a"]}}, "both included and excluded"),
        ({"mcp": {"command": "x", "timeout_s": 0}}, "timeout_s"),
        ({"mcp": {"command": "x", "prefix": "a b"}}, "prefix"),
        ({"mcp": {"command": "x", "bogus": 1}}, "bogus"),
        ({"mcp": {"command": "x"}, "idempotent": True}, "an `mcp` entry takes no ['idempotent']"),
        ({"mcp": {"command": "x"}, "name": "y"}, "put include / exclude / prefix"),
    ],
)
def test_bad_mcp_entries_are_clear_errors_naming_the_entry(entry, needle):
    with pytest.raises(ValueError) as info:
        load_tool_config({"tools": [{"name": "calculator"}, entry]})
    message = str(info.value)  # the entry is named by its index: "tool #1 (mcp ...)" or pydantic's "tools.1"
    assert needle in message and ("tool #1 (mcp " in message or "tools.1" in message), message


def test_a_server_that_does_not_start_fails_the_build_naming_the_entry():
    with pytest.raises(ValueError, match=r"tool #0 \(mcp /nonexistent/server\): cannot list the tools of MCP server"):
        load_tool_config({"tools": [{"mcp": {"command": "/nonexistent/server", "max_connect_attempts": 1}}]})


def test_include_exclude_and_idempotent_names_are_checked_against_the_listing():
    listed = [mcp_types.Tool(name=n, input_schema={"type": "object"}) for n in ("a", "b", "c")]

    def select(**cfg):
        return [(t.name, t.mcp_name, t.idempotent) for t in MCPToolset({"command": "x", **cfg})._select(listed)]

    assert select(include=["c", "a"], prefix="s_", idempotent=["a"]) == [("s_a", "a", True), ("s_c", "c", False)]
    assert select(exclude=["b"], idempotent=True) == [("a", "a", True), ("c", "c", True)]
    for bad in ({"include": ["d"]}, {"exclude": ["d"]}, {"idempotent": ["d"]}):
        with pytest.raises(ValueError, match=r"has no tool\(s\) \['d'\]; it has \['a', 'b', 'c'\]"):
            select(**bad)


def test_a_name_clash_closes_the_servers_already_started():
    before = _toolset_threads()
    entries = [
        {"mcp": {"module": SERVER, "include": ["echo"]}},
        {"function": "streamrl.workloads.tools.examples:word_count", "name": "echo"},
    ]
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        load_tool_config({"tools": entries})
    assert _toolset_threads() - before == set()  # close() joined them


# -- schema and result conversion ---------------------------------------------------------------------


def test_input_schemas_become_openai_parameters():
    schema = {
        "type": "object",
        "title": "searchArguments",
        "$defs": {
            "Filter": {
                "title": "Filter",
                "type": "object",
                "properties": {"title": {"title": "Title", "type": "string"}},
            }
        },
        "properties": {
            "query": {"title": "Query", "type": "string", "description": "what to look for", "minLength": 1},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Limit"},
            "filter": {"$ref": "#/$defs/Filter"},
            "anything": {"title": "Anything"},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    assert openai_parameters(schema, "t") == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for", "minLength": 1},
            "limit": {"type": ["integer", "null"], "anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            "filter": {"type": "object", "properties": {"title": {"type": "string"}}},  # a property named "title" stays
            "anything": {"type": ["string", "number", "integer", "boolean", "array", "object", "null"]},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    with pytest.raises(ValueError, match="tool arguments must be an object"):
        openai_parameters({"type": "string"}, "t")


def test_results_become_one_observation():
    text = mcp_types.TextContent(type="text", text="line one")
    image = mcp_types.ImageContent(type="image", data="aGVsbG8=", mime_type="image/png")
    resource = mcp_types.EmbeddedResource(
        type="resource", resource=mcp_types.TextResourceContents(uri="file:///a.txt", text="file text")
    )
    link = mcp_types.ResourceLink(type="resource_link", uri="file:///b.bin", name="b.bin")
    assert result_text(mcp_types.CallToolResult(content=[text, image, resource, link])) == (
        "line one\n[image image/png, 5 bytes]\nfile text\n[resource link file:///b.bin (b.bin)]"
    )
    assert result_text(mcp_types.CallToolResult(content=[], structured_content={"n": 1})) == '{"n": 1}'
    assert result_text(mcp_types.CallToolResult(content=[text], is_error=True)) == "Error: line one"
    assert result_text(mcp_types.CallToolResult(content=[], is_error=True)).startswith(
        "Error: the tool reported an error"
    )


def test_image_parts_become_images_of_the_execution_and_errors_keep_only_text():
    text = mcp_types.TextContent(type="text", text="line one")
    red = mcp_types.ImageContent(
        type="image", data=base64.b64encode(_solid_png(2, 2, "red")).decode(), mime_type="image/png"
    )
    blue = mcp_types.ImageContent(
        type="image", data=base64.b64encode(_solid_png(1, 3, "blue")).decode(), mime_type="image/png"
    )
    audio = mcp_types.AudioContent(type="audio", data="aGVsbG8=", mime_type="audio/wav")
    after = mcp_types.TextContent(type="text", text="line two")
    execution = result_execution(mcp_types.CallToolResult(content=[text, red, audio, after, blue]))
    assert execution.text == "line one\n[audio audio/wav, 5 bytes]\nline two"  # audio keeps its description
    assert execution.images == [f"data:image/png;base64,{red.data}", f"data:image/png;base64,{blue.data}"]  # part order
    only = result_execution(mcp_types.CallToolResult(content=[red], structured_content={"n": 1}))
    assert (only.text, len(only.images)) == ("", 1)
    failed = mcp_types.CallToolResult(content=[text, red], is_error=True)
    assert result_execution(failed) == ToolExecution(
        text=f"Error: line one\n[image image/png, {len(_solid_png(2, 2, 'red'))} bytes]"
    )
    # Without an image part: exactly the text observation of before, nothing else.
    for result in (
        mcp_types.CallToolResult(content=[text, audio, after]),
        mcp_types.CallToolResult(content=[], structured_content={"n": 1}),
        mcp_types.CallToolResult(content=[text], is_error=True),
    ):
        assert result_execution(result) == ToolExecution(text=result_text(result))


# -- image results from the real server -------------------------------------------------------------


def _solid_png(width: int, height: int, color: str) -> bytes:
    """What the example server's `solid_color` draws (same PIL, same deterministic PNG encoder)."""
    from PIL import Image, ImageColor

    buf = io.BytesIO()
    Image.new("RGB", (width, height), ImageColor.getrgb(color)).save(buf, format="PNG")
    return buf.getvalue()


async def test_a_server_image_reaches_the_execution_and_the_image_store(registry):
    from streamrl.models.images import decode_image, image_sha256, load_image_source
    from streamrl.rollout.images import ImageStore

    expected = _solid_png(5, 3, "#10a0f0")
    execution = await registry.tools["solid_color"].execute("t", {"width": 5, "height": 3, "color": "#10a0f0"})
    assert execution.text == "a 5x3 PNG filled with #10a0f0" and len(execution.images) == 1
    assert load_image_source(execution.images[0]) == expected  # the server's bytes, unchanged
    assert decode_image(expected).getpixel((4, 2)) == (0x10, 0xA0, 0xF0)

    store = ImageStore()
    shown, refused, bad = await registry.execute_calls(
        [
            _call(0, "solid_color", width=5, height=3, color="#10a0f0"),
            _call(1, "solid_color", width=5, height=3, color="red"),
            _call(2, "solid_color", width=0, height=3, color="red"),
        ],
        {},
        timeout_s=10,
        max_parallel=8,
        images=store,
    )
    assert not shown.is_error and [r.sha256 for r in shown.images] == [image_sha256(expected)]
    assert store.get(shown.images[0].sha256) == expected and (shown.images[0].width, shown.images[0].height) == (5, 3)
    assert refused.images[0].sha256 == image_sha256(_solid_png(5, 3, "red"))
    assert bad.is_error and bad.images == [] and bad.text.endswith("width and height must be 1..1024 pixels, got 0 x 3")
    # A text-only policy (no store): the executor's refusal, the server's text kept after it.
    (text_only,) = await _run(registry, _call(3, "solid_color", width=2, height=2, color="red"))
    assert text_only.is_error and text_only.images == []
    assert text_only.text == (
        "Error: tool 'solid_color' returned 1 image(s) but the policy reads text only; they were not shown\n"
        "a 2x2 PNG filled with red"
    )


@pytest.mark.parametrize("policy", ["vlm", "text_only"])
async def test_an_mcp_image_joins_the_trajectory_through_the_agent_loop(registry, processor, policy):
    """`ToolAgentLoop` with the tiny VLM's processor on FakeEngine: the model calls `solid_color`, the
    tool message shows the image as an `image_ref` part before the text, `AgentData.images` grows by
    one and the next generate sends the server's bytes. A text-only policy gets the error observation."""
    from streamrl.engines.fake import FakeEngine
    from streamrl.models.images import image_sha256
    from streamrl.rollout.agent_loop import ToolAgentLoop
    from streamrl.rollout.images import ImageStore
    from streamrl.rollout.types import AgentData, TrajectoryStatus
    from tests.rollout.test_agent_loop import turn_script
    from tests.rollout.vlm_context import vlm_context

    call = (
        '<tool_call>\n{"name": "solid_color", "arguments": {"width": 56, "height": 56, "color": "red"}}\n</tool_call>'
    )
    script, _ = turn_script(processor.tokenizer, [call, "It is red."])
    engine = FakeEngine(script=script, image_token_id=processor.image_token_id)
    vlm = policy == "vlm"
    ctx = vlm_context(processor, engine, ImageStore(), text_only=not vlm, tools=registry, prompt_length=4096)
    data = AgentData(trajectory_id=f"m/{policy}", group_id="m", messages=[{"role": "user", "content": "Draw red."}])
    assert data.images == []
    traj = await ToolAgentLoop(ctx).run(data)

    traj.validate()
    assert traj.status is TrajectoryStatus.FINISHED
    tool_msg = next(m for m in data.messages if m["role"] == "tool")
    png = _solid_png(56, 56, "red")
    if vlm:
        assert [r.sha256 for r in data.images] == traj.image_refs == [image_sha256(png)]
        assert tool_msg["content"] == [
            {"type": "image", "image_ref": image_sha256(png)},
            {"type": "text", "text": "a 56x56 PNG filled with red"},
        ]
        assert traj.num_image_tokens == [processor.image_seq_len] and traj.num_tool_errors == 0
        assert [[i.data for i in images] for _, images in engine.images_seen] == [[], [png]]
    else:
        assert data.images == [] and traj.image_refs == [] and traj.num_tool_errors == 1
        assert tool_msg["content"].startswith(
            "Error: tool 'solid_color' returned 1 image(s) but the policy reads text only"
        )


# -- streamable HTTP ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the HTTP MCP server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


async def test_streamable_http_server_is_listed_and_called():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", SERVER, "--http", str(port)], stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc)
        registry = load_tool_config(
            {"tools": [{"mcp": {"url": f"http://localhost:{port}/mcp", "exclude": ["crash"], "prefix": "h_"}}]}
        )
        try:
            assert registry.names == ["h_add", "h_echo", "h_solid_color", "h_fail", "h_slow", "h_pid"]
            add, fail = await _run(registry, _call(0, "h_add", a=5, b=6), _call(1, "h_fail", message="nope"))
            assert (add.text, add.is_error) == ("11", False)
            assert fail.is_error and fail.text.endswith("nope")
            assert await _server_pid(registry, "h_pid") == proc.pid
        finally:
            close_toolsets(registry.tools.values())
        assert proc.poll() is None  # closing a client leaves a server it did not start alone
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- shutdown ----------------------------------------------------------------------------------------


def _toolset_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "mcp-toolset" and t.is_alive()}


async def test_close_stops_the_server_process_and_the_thread():
    before = _toolset_threads()
    registry = _registry(include=["pid", "slow"])
    (toolset,) = toolsets(registry.tools.values())
    pid = await _server_pid(registry)
    assert os.getpgid(pid) == pid  # its own process group: the SDK's shutdown kills the whole tree
    assert len(_toolset_threads() - before) == 1
    in_flight = asyncio.create_task(_run(registry, _call(1, "slow", seconds=30), timeout_s=40))
    await asyncio.sleep(0.3)
    await asyncio.to_thread(registry.close)  # the worker's shutdown path
    (result,) = await asyncio.wait_for(in_flight, 5)  # answered, not cancelled: the trajectory goes on
    assert result.text == "Error: the MCP toolset of tool 'slow' was closed during the call"
    assert toolset.closed and _wait_gone(pid)
    toolset.close()  # idempotent
    assert _toolset_threads() - before == set()


async def test_a_garbage_collected_toolset_stops_its_server():
    registry = _registry(include=["pid"])
    pid = await _server_pid(registry)
    del registry
    gc.collect()
    assert _wait_gone(pid)


MCP_PARENT = """
import sys, time
from streamrl.tools.mcp import MCPToolset
toolset = MCPToolset({"command": "sh", "args": ["-c", sys.argv[1]]})
toolset.tools()
print("listed", flush=True)
time.sleep(600)
"""


def test_a_stdio_server_dies_with_a_worker_killed_outright():
    """The SDK starts stdio servers in a session of their own, so a server that does not exit when its
    stdin closes could outlive a SIGKILLed worker (here: a shell that, once the Python server exits,
    goes on sleeping); it must die with the worker."""
    tag = f"streamrl-mcp-{time.time_ns()}"
    script = f"{sys.executable} -m {SERVER}; sleep 600 # {tag}"
    parent = subprocess.Popen([sys.executable, "-c", MCP_PARENT, script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "listed"
        assert _pids_with_tag(tag)  # the shell wrapping the server runs
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _pids_with_tag(tag):
        assert time.monotonic() < deadline, "the stdio server outlived its worker"
        time.sleep(0.05)


def _pids_with_tag(tag: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if tag.encode() in cmdline and state != "Z":
                found.append(int(entry))
    return found
