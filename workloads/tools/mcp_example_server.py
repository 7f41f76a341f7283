"""A small MCP server for tests and as an example of what `mcp:` tool entries connect to.

Built with the official SDK's `MCPServer` (FastMCP's name since mcp 2): each decorated function is one
tool, its type hints become the tool's `inputSchema`. Besides two useful tools (`add`, `echo`) and one
that returns an image with a line of text (`solid_color`, a PNG drawn with PIL: what image results
look like to the client) it has the failure modes a client must survive: `fail` raises (the server
answers `isError`), `crash` kills the server process mid-call (the client must report that call and
reconnect for the next one), and `slow` sleeps (timeouts). `pid` tells a test which process served it.

    python -m streamrl.workloads.tools.mcp_example_server              # stdio (what `command:` runs)
    python -m streamrl.workloads.tools.mcp_example_server --http 8765  # streamable HTTP on 127.0.0.1

The HTTP transport binds 127.0.0.1 only: these tools are for a trainer on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os

from mcp.server.mcpserver import Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer(
    "streamrl-example",
    instructions="Arithmetic, echo, image and failure-injection tools for tests.",
    log_level="WARNING",
)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return `text` unchanged."""
    return text


@server.tool()
def solid_color(width: int, height: int, color: str) -> list[str | Image]:
    """Draw a `width` x `height` PNG filled with `color` (a name such as "red" or "#rrggbb")."""
    from PIL import Image as PILImage
    from PIL import ImageColor

    if not (1 <= width <= 1024 and 1 <= height <= 1024):
        raise ToolError(f"width and height must be 1..1024 pixels, got {width} x {height}")
    try:
        rgb = ImageColor.getrgb(color)
    except ValueError:
        raise ToolError(f"unknown color {color!r}") from None
    buf = io.BytesIO()
    PILImage.new("RGB", (width, height), rgb[:3]).save(buf, format="PNG")
    return [f"a {width}x{height} PNG filled with {color}", Image(data=buf.getvalue(), format="png")]


@server.tool()
def fail(message: str = "this tool always fails") -> str:
    """Fail with `message` (the server answers with an error result)."""
    raise ToolError(message)


@server.tool()
def crash() -> str:
    """Kill this server process at once, without answering."""
    os._exit(1)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep `seconds`, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def pid() -> int:
    """The id of the server process."""
    return os.getpid()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT (default: stdio)"
    )
    args = parser.parse_args(argv)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
