"""One owner per fact: in the learner's process the served policy_version has one mutable holder, the
weight-sync coordinator's `_served_version`. The publisher, the learner actor and a learner group read
it (`WeightPublisher.served_version`, `nothing_new`) or are told it (the `Published` record of a publish).

The guard scans every module that runs in the learner's processes (weight sync, the learner actor and
its backends, the training engine and its group) for writes to an attribute whose name says it holds
the served label (`*served*`): a second holder, such as the actor keeping the last publish's version,
fails here. A copy kept under an unrelated name escapes it; naming the fact (`served_version`, never
a bare `version`) is what makes such a copy findable.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEARNER_PROCESS = ("weight_sync/*.py", "streaming/actors/learner*.py", "learner/**/*.py")
OWNER = ("weight_sync/coordinator.py", "WeightSyncCoordinator", "_served_version")


def _attribute_targets(target: ast.expr) -> list[str]:
    """Attribute names written by one assignment target (through tuples, lists and starred names)."""
    if isinstance(target, ast.Attribute):
        return [target.attr]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _attribute_targets(element)]
    if isinstance(target, ast.Starred):
        return _attribute_targets(target.value)
    return []


def _written_attributes(node: ast.AST) -> list[str]:
    """Attribute names this statement (or `setattr` call) writes."""
    if isinstance(node, ast.Assign):
        return [name for target in node.targets for name in _attribute_targets(target)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        return _attribute_targets(node.target)
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return _attribute_targets(node.optional_vars)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        name = node.args[1] if len(node.args) > 1 else None
        return [name.value] if isinstance(name, ast.Constant) and isinstance(name.value, str) else []
    return []


def served_label_writes(source: str) -> list[tuple[str, str]]:
    """(enclosing class, attribute) of every write to an attribute named `*served*` in `source`."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, owner: str) -> None:
        owner = node.name if isinstance(node, ast.ClassDef) else owner
        found.extend((owner, name) for name in _written_attributes(node) if "served" in name)
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(ast.parse(source), "<module>")
    return found


def test_the_served_label_has_one_mutable_holder_in_the_learner_process():
    files = sorted({path for pattern in LEARNER_PROCESS for path in REPO.glob(pattern)})
    assert len(files) > 10, files  # the patterns still match the learner's modules
    writes = {
        (str(path.relative_to(REPO)), owner, name)
        for path in files
        for owner, name in served_label_writes(path.read_text())
    }
    assert writes == {OWNER}, "the served policy_version must be read from the weight publisher, not kept"


def test_the_scan_finds_a_second_holder_however_it_is_written():
    source = """
class LearnerActor:
    def __init__(self):
        self.served_version: int | None = None

    async def connect(self, policy_version):
        self.served_version, self.weights_changed = policy_version, False

    async def publish(self, published):
        self.learner.last_served = published.policy_version
        self._served += 1
        setattr(self, "served_version", published.policy_version)


def remember(backend, version):
    [backend.served_version, *backend.rest] = version, 0
"""
    assert served_label_writes(source) == [
        ("LearnerActor", "served_version"),
        ("LearnerActor", "served_version"),
        ("LearnerActor", "last_served"),
        ("LearnerActor", "_served"),
        ("LearnerActor", "served_version"),
        ("<module>", "served_version"),
    ]
    assert served_label_writes("x = self.served_version\nserved_version = 3\n") == []  # reads and locals
