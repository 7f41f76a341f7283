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
    "learner",
    "models",
    "observability",
    "rollout",
    "sim",
    "streaming",
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
    ("rollout", "models"): {"models", "models.multimodal"},  # resolve_model, templates, image processing
    ("workloads", "rollout"): {  # example tools and environments: the tool and interaction interfaces
        "rollout.interactions.base",
        "rollout.tools.base",
        "rollout.tools.calculator",
        "rollout.tools.executor",
        "rollout.tools.sandbox.stages",
        "rollout.tools.schema",
    },
    ("buffer", "rollout"): {"rollout.types"},  # the records the buffer stores
    ("learner", "models"): {"models", "models.multimodal"},
    ("weight_sync", "rollout"): {"rollout.engine.base", "rollout.engine.vllm_compat"},  # the engines it updates
    ("observability", "rollout"): {"rollout.types"},
    ("observability", "buffer"): {"buffer.types", "buffer.images", "buffer.log"},  # the report reads buffers
    # the simulator decides with the buffer's own admission, group and batching code, and reads run buffers
    ("sim", "buffer"): {"buffer.admission", "buffer.config", "buffer.groups", "buffer.sampling", "buffer.cli"},
    ("sim", "rollout"): {"rollout.types"},  # the row statuses it feeds the group table
}


def package_imports() -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(importing package, imported package) -> {(file, imported module)}, from every `import` and
    `from ... import` statement of the library packages, lazy ones inside functions included."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for top in LAYERS:
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(syntax.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "streamrl":
                    names = [f"streamrl.{a.name}" for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "streamrl" and len(parts) > 1 and parts[1] != top:
                        module = ".".join(parts[1:])
                        edges.setdefault((top, parts[1]), set()).add((str(path.relative_to(REPO)), module))
    return edges


def draw(edges: dict[tuple[str, str], set[tuple[str, str]]]) -> str:
    """The graph as text, one line per package: what it imports, with the number of import sites."""
    lines = []
    for top in reversed(LAYERS):
        deps = sorted((b, len(v)) for (a, b), v in edges.items() if a == top)
        lines.append(f"{top:>13} -> " + (", ".join(f"{b} ({n})" for b, n in deps) or "-"))
    return "\n".join(lines)


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(LAYERS)


def test_no_package_imports_one_above_it():
    edges = package_imports()
    upward = {
        f"{file}: {module}"
        for (a, b), sites in edges.items()
        if b not in LAYERS or LAYERS.index(b) > LAYERS.index(a)
        for file, module in sites
    }
    assert upward == set(), draw(edges)


def test_the_package_graph_has_no_cycle():
    edges = package_imports()
    graph = {a: {b for (x, b) in edges if x == a} for a in LAYERS}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        if seen.get(node) == 1:
            return path + [node]
        if seen.get(node) == 2:
            return None
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if (cycle := visit(nxt, path + [node])) is not None:
                return cycle
        seen[node] = 2
        return None

    cycles = [c for start in LAYERS if (c := visit(start, [])) is not None]
    assert cycles == [], draw(edges)


def test_library_packages_use_each_other_only_through_their_interfaces():
    """A library package imports another only for its interface (INTERFACES), never for a
    primitive that lives there by accident: those go to `core`."""
    edges = package_imports()
    stray = {
        f"{file}: {module}"
        for (a, b), sites in edges.items()
        if a != "streaming" and b != "core"
        for file, module in sites
        if module not in INTERFACES.get((a, b), set())
    }
    assert stray == set(), draw(edges)


def test_core_imports_no_other_package_and_nothing_heavy():
    for path in (REPO / "core").rglob("*.py"):
        for node in ast.walk(syntax.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    assert not name.startswith(("torch", "ray", "vllm", "transformers", "pyarrow")), (path, name)


if __name__ == "__main__":
    print(draw(package_imports()))
