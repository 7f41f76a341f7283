"""The package layout: the project's top-level folders install under one import namespace
(`streamrl.buffer`, `streamrl.rollout`, ...), nothing generic lands in site-packages, and no module
imports a folder by its bare name (which would load a second copy of it beside the installed one)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("buffer", "learner", "observability", "rollout", "streaming", "weight_sync")
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
