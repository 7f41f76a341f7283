"""The package layout: the project's top-level folders install under one import namespace
(`streamrl.buffer`, `streamrl.rollout`, ...), nothing generic lands in site-packages, and no module
imports a folder by its bare name (which would load a second copy of it beside the installed one)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from streamrl.core import syntax

REPO = Path(__file__).resolve().parents[1]
TOP = (
    "buffer",
    "core",
    "engines",
    "learner",
    "models",
    "observability",
    "rollout",
    "sim",
    "streaming",
    "tools",
    "weight_sync",
    "workloads",
)
BARE = re.compile(rf"^\s*(from|import) ({'|'.join(TOP)})(\.|\s|$)", re.M)


def test_every_package_folder_is_installed_under_the_namespace():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"streamrl": "."}
    folders = {
        "streamrl." + ".".join(p.parent.relative_to(REPO).parts)
        for top in TOP
        for p in (REPO / top).rglob("__init__.py")
    }
    assert set(cfg["packages"]) == folders


def test_no_module_imports_a_bare_top_level_name():
    files = [p for d in (*TOP, "tests", "bench") for p in (REPO / d).rglob("*.py")]
    bad = [f"{p.relative_to(REPO)}: {m.group(0).strip()}" for p in files for m in BARE.finditer(p.read_text())]
    assert bad == []


def test_the_namespace_imports_outside_the_checkout_and_the_bare_names_do_not(tmp_path):
    code = (
        "import importlib.util as u, streamrl.streaming.cli as c; "
        f"print(c.__file__); print([n for n in {TOP!r} if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cli_file, bare = out.stdout.splitlines()
    assert Path(cli_file).resolve() == (REPO / "streaming" / "cli.py").resolve()
    assert bare == "[]"  # no generic `buffer`, `rollout`, ... importable from site-packages


# ---- the package import graph ----------------------------------------------------------------------
# Layers, bottom first: a package imports only itself and the packages before it. `core` is the
# ground floor (primitives every package may use); `streaming` (the driver, the CLI, the Ray actors)
# is the top and may import everything.
LAYERS = (
    "core",
    "models",
    "engines",
    "tools",
    "rollout",
    "workloads",
    "buffer",
    "learner",
    "weight_sync",
    "observability",
    "sim",
    "streaming",
)
# What a library package may use of another library package: its interface, not a primitive that
# happens to live there (primitives belong in `core`). `streaming` is not listed: it wires everything.
INTERFACES = {
    # resolve_model, image bytes and references (`models.images`), image tokens and templates
    ("engines", "models"): {"models", "models.images", "models.multimodal"},
    ("tools", "models"): {"models.images"},  # the images a tool returns
    ("rollout", "models"): {"models", "models.images", "models.multimodal"},
    # the engine interface and config it drives, and the per-token side data an engine returns
    ("rollout", "engines"): {"engines.base", "engines.config", "engines.token_side"},
    # the tool records and interfaces the agent loop drives; the parsers build `tools.types.ToolCall`s
    ("rollout", "tools"): {
        "tools.types",
        "tools.schema",  # validate_call: a parsed call against the tools' schemas
        "tools.instances",  # per-trajectory instance state, shared by tools and interactions
        "tools.calculator",  # the generated arithmetic tasks compute their answers with it
        "tools.slots",  # the gateway runs agent programs in the tools' bounded threads
        "tools.sandbox.execute",  # the gateway caps its programs' output as the sandbox does
        "tools.sandbox",  # a coding harness's shell commands run in the sandbox (rollout/mini_swe/shell.py)
    },
    # example tools and environments: the tool and interaction interfaces
    ("workloads", "tools"): {
        "tools.base",
        "tools.calculator",
        "tools.executor",
        "tools.sandbox.stages",
        "tools.schema",
    },
    ("workloads", "rollout"): {"rollout.interactions.base"},
    ("buffer", "rollout"): {"rollout.types"},  # the records the buffer stores
    ("buffer", "engines"): {"engines.token_side"},  # the per-token side data stored with them
    ("learner", "models"): {"models", "models.multimodal"},
    # the engines it updates; its worker extension carries the engine's route capture
    ("weight_sync", "engines"): {"engines.base", "engines.vllm_compat", "engines.route_capture"},
    ("observability", "rollout"): {"rollout.types"},
    ("observability", "buffer"): {"buffer.types", "buffer.images", "buffer.log"},  # the report reads buffers
    # the simulator decides with the buffer's own admission, group and batching code, and reads run buffers
    ("sim", "buffer"): {"buffer.admission", "buffer.config", "buffer.groups", "buffer.sampling", "buffer.cli"},
    ("sim", "rollout"): {"rollout.types"},  # the row statuses it feeds the group table
}


# Modules a lower package names but never imports, because another program loads them by that name:
# vLLM mixes the weight-sync receiver into its worker processes from the engine config's
# `worker_extension_cls` (also passed to `vllm serve`). The one reference against the layers: the
# receiver runs inside the engine's processes but is the weight transport's far end, so it lives with
# the transports in `weight_sync`, above the engines that name it.
NAMED_PLUGINS = {("engines", "weight_sync"): {"weight_sync.worker_extension"}}


def layered_edges() -> dict[tuple[str, str], set[tuple[str, str]]]:
    """`package_imports` without the references of NAMED_PLUGINS."""
    edges = {}
    for (a, b), sites in package_imports().items():
        kept = {(f, m) for f, m in sites if m not in NAMED_PLUGINS.get((a, b), set())}
        if kept:
            edges[(a, b)] = kept
    return edges


# A module named in a string: `importlib.import_module("streamrl.x.y")`, a `"streamrl.x.y:attr"` spec,
# a hook path such as Ray's `worker_process_setup_hook`, a `python -m streamrl.x.y` command.
NAMED_IN_STRING = re.compile(r"^streamrl(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")


def is_module(dotted: str) -> bool:
    """Whether `dotted` (without the `streamrl.` prefix) is a module or package of the checkout."""
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def resolve(name: str) -> str | None:
    """The module a `streamrl.` name refers to: the longest prefix that is a module (a trailing
    function, class or `:attr` is not), without the `streamrl.` prefix; None for other names."""
    parts = name.split(":")[0].split(".")
    if parts[0] != "streamrl" or len(parts) < 2:
        return None
    for end in range(len(parts), 1, -1):
        if is_module(".".join(parts[1:end])):
            return ".".join(parts[1:end])
    return None


def imported_modules(node: ast.AST) -> list[str]:
    """The checkout's modules one AST node imports (without the `streamrl.` prefix): `import a.b`,
    `from a import b` (module `a.b` when b is a submodule, `a` when it is a name in it), and a
    string naming a module (`NAMED_IN_STRING`)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED_IN_STRING.match(node.value):
        names = [node.value]
    else:
        return []
    return [m for m in map(resolve, names) if m is not None]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(importing package, imported package) -> {(file, imported module)}, from every `import` and
    `from ... import` statement of the library packages, lazy ones inside functions included, and
    every string that names a module."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for top in LAYERS:
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(syntax.parse(path.read_text())):
                for module in imported_modules(node):
                    package = module.split(".")[0]
                    if package != top:
                        edges.setdefault((top, package), set()).add((str(path.relative_to(REPO)), module))
    return edges


def load_time_imports() -> dict[str, set[str]]:
    """Module -> the checkout's modules it imports when it is loaded: statements at module level,
    inside top-level `if`/`try` blocks too, but not under `if TYPE_CHECKING` nor inside functions."""

    def statements(body: list[ast.stmt]):
        for stmt in body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                yield from statements(stmt.orelse)
            elif isinstance(stmt, ast.If):
                yield from statements(stmt.body)
                yield from statements(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                    yield from statements(block)
            elif isinstance(stmt, ast.Import | ast.ImportFrom):
                yield stmt

    graph: dict[str, set[str]] = {}
    for top in LAYERS:
        for path in (REPO / top).rglob("*.py"):
            tree = syntax.parse(path.read_text())
            me = module_name(path)
            graph[me] = {m for stmt in statements(tree.body) for m in imported_modules(stmt) if m != me}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph (its nodes, the first repeated at the end), or None."""
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        if seen.get(node) == 1:
            return path[path.index(node) :] + [node]
        if seen.get(node) == 2:
            return None
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if (cycle := visit(nxt, path + [node])) is not None:
                return cycle
        seen[node] = 2
        return None

    for start in sorted(graph):
        if (cycle := visit(start, [])) is not None:
            return cycle
    return None


def draw(edges: dict[tuple[str, str], set[tuple[str, str]]]) -> str:
    """The graph as text, one line per package: what it imports, with the number of import sites."""
    lines = []
    for top in reversed(LAYERS):
        deps = sorted((b, len(v)) for (a, b), v in edges.items() if a == top)
        lines.append(f"{top:>13} -> " + (", ".join(f"{b} ({n})" for b, n in deps) or "-"))
    return "\n".join(lines)


def test_every_named_plugin_is_still_named():
    """Every NAMED_PLUGINS reference is still there: the list shrinks when one goes."""
    edges = package_imports()
    for (a, b), modules in NAMED_PLUGINS.items():
        named = {m for _, m in edges.get((a, b), set())}
        assert modules <= named, f"{a} no longer names {sorted(modules - named)}: drop it from NAMED_PLUGINS"


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(LAYERS)


def test_no_package_imports_one_above_it():
    edges = layered_edges()
    upward = {
        f"{file}: {module}"
        for (a, b), sites in edges.items()
        if b not in LAYERS or LAYERS.index(b) > LAYERS.index(a)
        for file, module in sites
    }
    assert upward == set(), draw(edges)


def test_the_package_graph_has_no_cycle():
    edges = layered_edges()
    graph = {a: {b for (x, b) in edges if x == a} for a in LAYERS}
    assert find_cycle(graph) is None, draw(edges)


def test_no_module_needs_itself_to_load():
    """Within a package no two modules import each other at load time (the layer tests cannot see
    this: both ends are in one package). Such a cycle works or fails by import order alone."""
    assert find_cycle(load_time_imports()) is None


def test_the_graph_readers_see_what_the_tests_rely_on(tmp_path):
    """The readers behind the tests above: a submodule imported by `from`, a module named in a
    string, a lazy import excluded from the load-time graph, and a cycle the layer test cannot see."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from streamrl.rollout import types\n"
        "from streamrl.rollout.types import AgentData\n"
        "if TYPE_CHECKING:\n"
        "    from streamrl.learner import engine\n"
        "HOOK = 'streamrl.observability.logs.setup_worker_logging'\n"
        "SPEC = 'streamrl.workloads.answer_ledger:run'\n"
        "def lazy():\n"
        "    import streamrl.buffer.store\n"
    )
    tree = syntax.parse(source)
    found = sorted({m for node in ast.walk(tree) for m in imported_modules(node)})
    assert found == [
        "buffer.store",
        "learner.engine",
        "observability.logs",
        "rollout.types",
        "workloads.answer_ledger",
    ]
    assert find_cycle({"rollout.a": {"rollout.b"}, "rollout.b": {"rollout.c"}, "rollout.c": {"rollout.a"}}) == [
        "rollout.a",
        "rollout.b",
        "rollout.c",
        "rollout.a",
    ]
    assert find_cycle({"rollout.a": {"rollout.b"}, "rollout.b": set(), "core.x": {"rollout.a"}}) is None


def test_library_packages_use_each_other_only_through_their_interfaces():
    """A library package imports another only for its interface (INTERFACES), never for a
    primitive that lives there by accident: those go to `core`."""
    edges = layered_edges()
    stray = {
        f"{file}: {module}"
        for (a, b), sites in edges.items()
        if a != "streaming" and b != "core"
        for file, module in sites
        if module not in INTERFACES.get((a, b), set())
    }
    assert stray == set(), draw(edges)


def private_names_imported() -> set[str]:
    """`file: module.name` for every `from streamrl.<other package>... import _name` of the library
    packages: a name with a leading underscore is its module's own business, not an interface."""
    found = set()
    for top in LAYERS:
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(syntax.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("streamrl."):
                    if node.module.split(".")[1] != top:
                        found |= {
                            f"{path.relative_to(REPO)}: {node.module}.{a.name}"
                            for a in node.names
                            if a.name.startswith("_")
                        }
    return found


def test_no_package_imports_a_private_name_of_another():
    """The interface check reads modules; this one reads the names imported from them."""
    assert private_names_imported() == set()


def test_core_imports_no_other_package_and_nothing_heavy():
    for path in (REPO / "core").rglob("*.py"):
        for node in ast.walk(syntax.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    assert not name.startswith(("torch", "ray", "vllm", "transformers", "pyarrow")), (path, name)


if __name__ == "__main__":
    print(draw(package_imports()))
