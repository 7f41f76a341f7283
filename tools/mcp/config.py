"""`MCPServerConfig`: one `mcp:` entry of a tools YAML (see `tools/config.py`), validated when the
config loads: exactly one transport (a stdio `command` / `module`, or a streamable HTTP `url` that
must be on this machine unless `allow_remote`), the tools to expose, and the call and reconnect bounds.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MCPServerConfig(BaseModel):
    """One `mcp:` entry: where the server is, which of its tools to expose, and how to call them."""

    model_config = ConfigDict(extra="forbid")

    command: str | None = Field(None, min_length=1)  # stdio: the executable to run
    module: str | None = Field(None, min_length=1)  # stdio: `python -m module` with the trainer's interpreter
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = None  # merged over the SDK's safe default (HOME, PATH, ...)
    cwd: str | None = None
    url: str | None = None  # streamable HTTP endpoint, e.g. http://127.0.0.1:8765/mcp
    allow_remote: bool = False  # a url off this machine must be allowed explicitly
    include: list[str] | None = None  # MCP tool names to expose (default: all)
    exclude: list[str] = Field(default_factory=list)
    prefix: str = Field("", pattern=r"^[A-Za-z0-9_.\-]*$")  # prepended to each tool's name
    idempotent: bool | list[str] = False  # true: all tools; a list: those MCP tool names
    timeout_s: float = Field(60.0, gt=0)  # one call (the executor's own timeout also applies)
    connect_timeout_s: float = Field(30.0, gt=0)  # start + handshake of one connection attempt
    max_connect_attempts: int = Field(3, ge=1)  # per call, when the connection is down
    backoff_s: float = Field(0.5, ge=0)  # before the 2nd attempt; doubles after each failure

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        given = [key for key in ("command", "module", "url") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of `command`, `module` (stdio) or `url` (streamable HTTP), got {given or 'none'}"
            )
        if self.url is not None:
            stdio_only = [k for k in ("args", "env", "cwd") if getattr(self, k)]
            if stdio_only:
                raise ValueError(f"{stdio_only} apply to stdio servers (`command` / `module`), not to `url`")
            _check_url(self.url, self.allow_remote)
        elif self.allow_remote:
            raise ValueError("`allow_remote` applies to `url` servers only")
        both = sorted(set(self.include or ()) & set(self.exclude))
        if both:
            raise ValueError(f"tool(s) {both} are both included and excluded")
        return self

    @property
    def label(self) -> str:
        """How logs and error observations name the server."""
        if self.url is not None:
            return self.url
        head = f"python -m {self.module}" if self.module is not None else self.command
        return " ".join([str(head), *self.args])

    def is_idempotent(self, mcp_name: str) -> bool:
        return self.idempotent if isinstance(self.idempotent, bool) else mcp_name in self.idempotent


def _check_url(url: str, allow_remote: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url {url!r} is not an http(s) URL like http://127.0.0.1:8765/mcp")
    if allow_remote or parts.hostname == "localhost":
        return
    try:
        local = ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:  # a host name other than localhost
        local = False
    if not local:
        raise ValueError(
            f"url {url!r} is not on this machine (127.0.0.1 / localhost); "
            "set `allow_remote: true` to call a remote MCP server from the rollout workers"
        )
