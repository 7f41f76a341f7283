"""`streamrl eval` (streaming/eval_cli.py): which models it evaluates and how it refuses bad input. The
real evaluation of a trained run is in test_learning.py."""

from __future__ import annotations

import pytest

from streamrl.core.atomic import atomic_dir
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.streaming.cli import main
from streamrl.streaming.eval_cli import run_targets


def _run(tmp_path, steps: list[int]):
    """A run with a sealed (complete) checkpoint at each of `steps`, as the learner leaves them."""
    run = RunDir(tmp_path)
    run.write_info(RunInfo(run_name="run", model_path="/models/base", mode="async", config={}))
    for step in steps:
        atomic_dir(run.checkpoint(step), lambda d: (d / "hf").mkdir(), sync=True)
    return tmp_path


def test_targets_are_the_base_latest_all_or_named_steps_each_once(tmp_path):
    run = _run(tmp_path, [2, 4, 6])
    assert [t.label for t in run_targets(run, [])] == ["base", "step_000006"]
    assert [t.label for t in run_targets(run, ["all", "4", "base"])] == [
        "step_000002",
        "step_000004",
        "step_000006",
        "base",
    ]
    assert run_targets(run, ["base"])[0].model_path == "/models/base"
    assert run_targets(run, ["2"])[0].model_path == str(run / "checkpoints/step_000002/hf")
    with pytest.raises(ValueError, match="one of the steps \\[2, 4, 6\\]"):
        run_targets(run, ["3"])


def test_a_run_without_checkpoints_can_only_evaluate_its_base(tmp_path):
    run = _run(tmp_path, [])
    with pytest.raises(ValueError, match="no checkpoint"):
        run_targets(run, ["latest"])


def test_a_torn_checkpoint_is_not_evaluated(tmp_path):
    """Complete means sealed (`core.run_dir.why_incomplete`), for `streamrl eval` as for a resume."""
    run = _run(tmp_path, [2, 4])
    (run / "checkpoints" / "step_000006" / "hf").mkdir(parents=True)  # never sealed: torn by a lost machine
    assert [t.label for t in run_targets(run, ["all"])] == ["step_000002", "step_000004"]
    assert [t.label for t in run_targets(run, ["latest"])] == ["step_000004"]


def test_bad_invocations_are_one_clear_error(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "not a streamrl run directory" in capsys.readouterr().err
    assert main(["eval"]) == 2
    assert "a RUN_DIR or --config" in capsys.readouterr().err


async def test_running_rollouts_report_their_progress(caplog):
    import asyncio
    import logging

    from streamrl.streaming.eval import _report_progress

    results: list = []

    async def line_with(text: str) -> str:
        for _ in range(500):  # at most 5 s
            found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
            if found:
                return found[0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no progress line with {text!r}: {caplog.text}")

    with caplog.at_level(logging.INFO, logger="streamrl.streaming.eval"):
        task = asyncio.create_task(_report_progress(results, total=4, every_s=0.01))
        first = await line_with("rollouts: 0/4 samples done")
        results.extend([object(), object()])
        later = await line_with("rollouts: 2/4 samples done")
        task.cancel()
    assert "eta" not in first and " · eta " in later


@pytest.mark.parametrize("backend", ["vllm", "vllm_server"])
async def test_one_engine_scores_every_target_with_its_own_weights(backend, monkeypatch):
    """The engine starts on the first target; every later target's weights are loaded in place, and
    with a server backend (whose server started on its own command's model) the first's too."""
    from types import SimpleNamespace

    import streamrl.engines as engines
    import streamrl.streaming.heldout as heldout
    from streamrl.streaming.eval_cli import Target, evaluate_models

    calls: list = []

    class Engine:
        async def load_weights_from_path(self, path, policy_version):
            calls.append(("load", path))

        async def shutdown(self):
            calls.append(("shutdown",))

    async def run_heldout(cfg, model_path, engines_, records, timeout_s):
        calls.append(("score", model_path))
        return []

    monkeypatch.setattr(engines, "make_engine", lambda cfg, engine_id: calls.append(("build", cfg.model)) or Engine())
    monkeypatch.setattr(heldout, "run_heldout", run_heldout)
    monkeypatch.setattr(heldout, "heldout_metrics", lambda *a, **k: ("summary", {}))
    engine_cfg = SimpleNamespace(
        builds_model=backend == "vllm", model_copy=lambda update: SimpleNamespace(model=update["model"])
    )
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(engine=engine_cfg),
        trainer=SimpleNamespace(step_timeout_s=60),
        eval=SimpleNamespace(k=1, pass_threshold=1.0),
    )
    targets = [Target(label=f"t{i}", model_path=f"/m{i}", served_step=i) for i in range(3)]
    reported = []
    await evaluate_models(cfg, targets, [], lambda t, *rest: reported.append(t.label))
    first = [("load", "/m0")] if backend != "vllm" else []
    assert calls == [
        ("build", "/m0"),
        *first,
        ("score", "/m0"),
        ("load", "/m1"),
        ("score", "/m1"),
        ("load", "/m2"),
        ("score", "/m2"),
        ("shutdown",),
    ]
    assert reported == ["t0", "t1", "t2"]
