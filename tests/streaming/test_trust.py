"""Configs and run directories are trusted input, but code they name from outside the project is
said out loud: reward functions, tool and interaction classes, MCP servers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from streamrl.streaming import trust
from streamrl.streaming.config import load_config
from streamrl.streaming.trust import CodeReference, code_references, module_of, outside_roots, warn_untrusted_code

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(trust, "_warned", set())


def test_import_paths_name_their_module():
    assert module_of("pkg.mod:fn") == "pkg.mod" and module_of("pkg.mod.Class") == "pkg.mod"
    assert module_of("verl:pkg.mod:compute_score") == "pkg.mod" and module_of("os:system") == "os"


def test_the_project_and_streamrl_are_inside_the_roots_the_rest_is_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def score(inp):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inside = CodeReference(where="r", module="my_rewards")
    assert outside_roots(CodeReference(where="r", module="streamrl.rollout.rewards")) is None
    assert outside_roots(inside, cwd=tmp_path) is None  # the project the run starts from
    assert "imports 'my_rewards' from" in outside_roots(inside, cwd=REPO)  # the same module, seen from elsewhere
    assert "imports 'json' from" in outside_roots(CodeReference(where="r", module="json"), cwd=tmp_path)
    assert "imports 'os', a built-in module" == outside_roots(CodeReference(where="r", module="os"))  # frozen
    assert "not importable" in outside_roots(CodeReference(where="r", module="no_such_module_xyz"))
    assert "runs the program 'npx'" in outside_roots(CodeReference(where="t", command="npx"))


def test_the_shipped_configs_name_only_streamrl_code(caplog):
    for config in sorted((REPO / "configs").glob("*.toml")):
        cfg = load_config(config)
        assert warn_untrusted_code(cfg) == [], config


def test_code_from_outside_is_warned_once(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(REPO)
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: json.JSONDecoder\n  - name: calculator\n  - mcp: {command: npx, args: [server]}\n"
    )
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text("interaction:\n  - name: x\n    class_name: collections:Counter\n")
    cfg = load_config(
        None,
        [
            "rollout.agent.reward_fn=os:system",
            f"rollout.agent.tool_config={tools}",
            f"rollout.agent.interaction_config={interactions}",
        ],
    )
    assert [r.where.split(" ")[-1] for r in code_references(cfg)] == [
        "rollout.agent.reward_fn",
        "class_name",
        "mcp.command",
        "class_name",
    ]
    with caplog.at_level(logging.WARNING, logger="streamrl.streaming.trust"):
        first = warn_untrusted_code(cfg)
        again = warn_untrusted_code(cfg)
    assert len(first) == len(again) == 4
    warned = [r.getMessage() for r in caplog.records if r.name == "streamrl.streaming.trust"]
    assert len(warned) == 4  # once each, not again on the second call
    assert any("rollout.agent.reward_fn imports 'os'" in w and "docs/security.md" in w for w in warned)


def test_streamrl_train_warns_before_it_starts(tmp_path, monkeypatch, caplog):
    """The wiring: `train_main` names the code before any part starts (a resumed run's saved config too)."""
    from streamrl.observability import report
    from streamrl.streaming import train
    from streamrl.streaming.driver_state import DriverState

    async def one_step(cfg, run_dir, state):
        return DriverState(learner_step=1)

    monkeypatch.setattr(train, "_init_ray", lambda cfg, run_dir: None)
    monkeypatch.setattr(train, "_train", one_step)
    monkeypatch.setattr(report, "write_report", lambda run_dir: run_dir / "report.html")
    overrides = [f"trainer.run_root={tmp_path}", "trainer.run_name=r", "rollout.agent.reward_fn=os:system"]
    with caplog.at_level(logging.WARNING, logger="streamrl.streaming.trust"):
        assert train.train_main(config="configs/tiny.toml", overrides=overrides, resume=None) == 0
    assert "rollout.agent.reward_fn imports 'os'" in caplog.text
