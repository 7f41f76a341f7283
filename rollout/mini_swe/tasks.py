"""The coding tasks: small repositories with a bug, a problem statement, and hidden tests.

One TOML file per task in the task folder (`workloads/swe_tasks/<task_id>.toml`; the id is the file's
stem, lower-case letters, digits and `_`):

    split = "train"                      # or "eval": the held-out prompts
    problem = "add() in calc.py ..."     # what the agent is told (its task text)
    [repo]                               # the repository the agent works in: path -> content
    "calc.py" = '''...'''
    [hidden]                             # unittest files the reward runs on the final repository
    "test_calc.py" = '''...'''
    [solution]                           # files that, written over the repository, fix it (tests only)
    "calc.py" = '''...'''

A task is a file, not a folder of `.py` files, so its deliberately buggy code and its tests are data:
never linted, type-checked or imported as the project's code, and reviewed in one place.

The prompt rows (`prompt_rows`) are `{"id": "<split>-<task_id>", "messages": [the problem]}`, so a
sample's group id (`<id>@e<epoch>`, held-out ones prefixed `eval/`) names its task (`task_id_of`).
The hidden tests and the solution never leave the trainer's side: the agent sees the repository only.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

SPLITS = ("train", "eval")
EVAL_GROUP_PREFIX = "eval/"  # held-out group ids (streaming/heldout.py)
_TASK_ID = re.compile(r"^[a-z0-9_]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    task_id: str
    split: str  # one of SPLITS
    problem: str
    repo: dict[str, str]  # relative path -> content: the repository the agent starts from
    hidden: dict[str, str]  # relative path -> content: the unittest files of the reward
    solution: dict[str, str]  # relative path -> content: a fix (checked by the tests, never shown)

    @property
    def num_tests(self) -> int:
        """The test methods of the hidden files (`def test*` in a class): the reward's denominator,
        counted here on the trainer's side, so code under test cannot shrink it."""
        return sum(
            1
            for text in self.hidden.values()
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.ClassDef)
            for item in node.body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith("test")
        )


def load_task(path: Path) -> Task:
    """One task file, checked: a known split, a problem, repository files, hidden tests with at least
    one test method, and relative paths that stay inside their folder."""
    raw: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    task_id = path.stem
    if not _TASK_ID.match(task_id):
        raise ValueError(f"task {path}: its name must be lower-case letters, digits and _")
    unknown = set(raw) - {"split", "problem", "repo", "hidden", "solution"}
    if unknown or raw.get("split") not in SPLITS or not str(raw.get("problem", "")).strip():
        raise ValueError(f"task {path}: needs split (one of {SPLITS}) and problem, and nothing else but files")
    files = {section: _files(path, section, raw.get(section, {})) for section in ("repo", "hidden", "solution")}
    if not files["repo"] or not files["hidden"]:
        raise ValueError(f"task {path}: needs [repo] and [hidden] files")
    task = Task(task_id=task_id, split=raw["split"], problem=raw["problem"].strip(), **files)
    if task.num_tests == 0:
        raise ValueError(f"task {path}: its [hidden] files hold no test method (def test... in a class)")
    return task


def _files(path: Path, section: str, table: Any) -> dict[str, str]:
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ValueError(f"task {path}: [{section}] maps file paths to their text")
    for name in table:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.parts[0] == ".git":
            raise ValueError(f"task {path}: [{section}] path {name!r} must stay inside its folder")
    return dict(table)


def load_tasks(folder: Path) -> dict[str, Task]:
    """Every task of a folder, by id."""
    paths = sorted(folder.glob("*.toml"))
    if not paths:
        raise ValueError(f"no task files (*.toml) in {folder}")
    return {path.stem: load_task(path) for path in paths}


def prompt_rows(tasks: dict[str, Task], split: str) -> list[dict[str, Any]]:
    """The prompt rows of one split, in streamrl's flat prompt layout (`rollout/data/loaders.py`)."""
    return [
        {
            "id": f"{task.split}-{task.task_id}",
            "messages": [{"role": "user", "content": task.problem}],
            "data_source": f"mini_swe:{task.task_id}",
        }
        for task in tasks.values()
        if task.split == split
    ]


def task_id_of(group_id: str) -> str:
    """The task a sample's group id names: `<split>-<task_id>@e<epoch>`, held-out ones after `eval/`."""
    prompt = group_id.removeprefix(EVAL_GROUP_PREFIX).rpartition("@e")[0]
    split, _, task_id = prompt.partition("-")
    if split not in SPLITS or not _TASK_ID.match(task_id):
        raise ValueError(f"group id {group_id!r} names no task (expected <split>-<task_id>@e<epoch>)")
    return task_id


def write_files(folder: Path, files: dict[str, str]) -> None:
    """Write `files` (relative path -> text) under `folder`."""
    for name, text in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
