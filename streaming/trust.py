"""Which code a run's config makes streamrl import or start, and a warning for code from outside the project.

Configs and run directories are trusted input (docs/security.md): `rollout.agent.reward_fn`
(`package.module:function`), the tool YAML (`class_name`, `function`, an MCP server's `module` or
`command`) and the interaction YAML (`class_name`) are imported or run by every rollout worker, and
`--resume RUN_DIR` runs the config saved in RUN_DIR/run_info.json. streamrl does not sandbox them.

What it does do is say so when a config reaches beyond the project. Allowed roots:
- `streamrl.*`, the trainer's own modules (built-in rewards, tools and interactions);
- modules whose top-level package or file lies under the current working directory: the project
  `streamrl train` is started from (its own reward functions and tools).
Anything else — a module found elsewhere on `sys.path` (the standard library, site-packages), one
that cannot be located, or an MCP `command` (an arbitrary program) — is named in one
`logger.warning` per reference and process, so a config that runs `os:system` or an unexpected
package does not do it silently. Nothing is imported to decide: `importlib.util.find_spec` of the
top-level name locates it without running it.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from streamrl.streaming.config import StreamRLConfig

logger = logging.getLogger(__name__)

ALLOWED_PREFIX = "streamrl."
_warned: set[tuple[str, str]] = set()  # (where, what): each warned once per process


@dataclass(frozen=True, kw_only=True, slots=True)
class CodeReference:
    """One piece of code a config names: an import path (`module`) or a program (`command`)."""

    where: str  # the config key or YAML entry naming it
    module: str | None = None  # `package.module` (the attribute part removed)
    command: str | None = None


def module_of(path: str) -> str:
    """`pkg.mod` of an import path `pkg.mod:attr` or `pkg.mod.Attr` (as core.registry.import_object reads it)."""
    path = path.removeprefix("verl:")
    module, sep, _ = path.partition(":")
    return module if sep else path.rpartition(".")[0] or path


def _yaml_entries(path: str | None, key: str) -> list[dict[str, Any]]:
    if not path or not Path(path).is_file():
        return []  # absent or unreadable: the loader reports it where it builds the registry
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError:
        return []
    entries = data.get(key) if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def code_references(cfg: StreamRLConfig) -> list[CodeReference]:
    """Every module and program the config makes the rollout workers import or start."""
    agent = cfg.rollout.agent
    refs: list[CodeReference] = []
    if ":" in agent.reward_fn or "." in agent.reward_fn:  # else a registered built-in name
        refs.append(CodeReference(where="rollout.agent.reward_fn", module=module_of(agent.reward_fn)))
    for i, entry in enumerate(_yaml_entries(agent.tool_config, "tools")):
        where = f"{agent.tool_config} tool #{i}"
        for key in ("class_name", "function"):
            if isinstance(entry.get(key), str):
                refs.append(CodeReference(where=f"{where} {key}", module=module_of(entry[key])))
        mcp = entry.get("mcp") if isinstance(entry.get("mcp"), dict) else {}
        if isinstance(mcp.get("module"), str):
            refs.append(CodeReference(where=f"{where} mcp.module", module=mcp["module"]))
        if isinstance(mcp.get("command"), str):
            refs.append(CodeReference(where=f"{where} mcp.command", command=mcp["command"]))
    interactions = _yaml_entries(agent.interaction_config, "interaction") or _yaml_entries(
        agent.interaction_config, "interactions"
    )
    for i, entry in enumerate(interactions):
        if isinstance(entry.get("class_name"), str):
            refs.append(
                CodeReference(
                    where=f"{agent.interaction_config} interaction #{i} class_name",
                    module=module_of(entry["class_name"]),
                )
            )
    return refs


def outside_roots(ref: CodeReference, cwd: Path | None = None) -> str | None:
    """Why `ref` is outside the allowed roots (see module doc), or None when it is inside."""
    if ref.command is not None:
        return f"runs the program {ref.command!r}"
    assert ref.module is not None
    if ref.module == "streamrl" or ref.module.startswith(ALLOWED_PREFIX):
        return None
    top = ref.module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"imports {ref.module!r}, which is not importable from here"
    locations = [spec.origin] if spec.origin not in (None, "built-in", "frozen") else []
    locations += list(spec.submodule_search_locations or [])
    if not locations:
        return f"imports {ref.module!r}, a built-in module"
    root = (cwd or Path.cwd()).resolve()
    if all(Path(loc).resolve().is_relative_to(root) for loc in locations):
        return None
    return f"imports {ref.module!r} from {locations[0]}"


def warn_untrusted_code(cfg: StreamRLConfig) -> list[str]:
    """Warn once per reference (and process) about code outside the allowed roots; returns the lines."""
    lines = []
    for ref in code_references(cfg):
        why = outside_roots(ref)
        if why is None:
            continue
        line = (
            f"{ref.where} {why}: outside streamrl and {Path.cwd()} "
            "(configs and run directories are trusted input, docs/security.md)"
        )
        lines.append(line)
        key = (ref.where, ref.module or ref.command or "")
        if key not in _warned:
            _warned.add(key)
            logger.warning("%s", line)
    return lines
