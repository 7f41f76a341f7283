"""`--resume` refuses overrides that change what the run trains on, and a dataset changed under the
run, with an error naming the key: a new `data.seed` would reorder the stream so the saved cursor skips
prompts (0, 3 and 7 in the test), and `buffer.group_size` 4 -> 8 would leave every recovered group
open forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.rollout.data import load_records
from streamrl.streaming.config import load_config
from streamrl.streaming.resume import SAFE_ON_RESUME, prompts_sha256, resume_config, safe_on_resume
from streamrl.streaming.train import open_run


def _run_dir(tmp_path: Path, *overrides: str) -> Path:
    """A run directory as `streamrl train` leaves it at the start (run_info.json only)."""
    cfg = load_config("configs/tiny.toml", list(overrides))
    records = load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    info = RunInfo(
        run_name="run",
        model_path="tiny",
        mode=cfg.trainer.mode,
        config=cfg.model_dump(mode="json"),
        prompts_sha256=prompts_sha256(records),
        num_prompts=len(records),
    )
    RunDir(run_dir).write_info(info)
    return run_dir


def test_overrides_that_change_the_prompts_or_the_groups_are_refused_in_one_error(tmp_path):
    run_dir = _run_dir(tmp_path)
    with pytest.raises(ValueError) as info:
        open_run(None, ["data.seed=1", "buffer.group_size=8", "trainer.total_steps=9"], str(run_dir))
    message = str(info.value)
    assert "data.seed (0 -> 1)" in message and "buffer.group_size (4 -> 8)" in message
    assert "trainer.total_steps" not in message.split("Start a new run")[0]  # allowed: not listed as refused


@pytest.mark.parametrize(
    "override",
    [
        "data.shuffle=false",
        "data.num_prompts=32",
        "model=smollm2",
        "trainer.mode=sync",
        "learner.lr=0.5",
        "buffer.max_staleness=0",
        "eval.k=4",
        "eval.num_prompts=8",
        "rollout.agent.reward_fn=exact_match",
    ],
)
def test_each_override_that_changes_what_is_trained_is_refused(tmp_path, override):
    with pytest.raises(ValueError, match="cannot change"):
        open_run(None, [override], str(_run_dir(tmp_path)))


def test_allowed_overrides_and_unchanged_values_resume(tmp_path):
    run_dir = _run_dir(tmp_path)
    allowed = [
        "trainer.total_steps=12",
        "trainer.stall_timeout_s=60",
        "wandb.enabled=false",
        "eval.every_steps=2",
        "buffer.batch_size=16",
        "rollout.engine.kv_cache_space_gb=2",
        "learner.micro_batch_tokens=2048",
        "data.seed=0",
        "buffer.group_size=4",
    ]  # the last two: the values the run already has
    cfg, run, state = open_run(None, allowed, str(run_dir))
    assert (cfg.trainer.total_steps, cfg.buffer.batch_size, cfg.buffer.group_size) == (12, 16, 4) and run == run_dir
    assert all(safe_on_resume(k.split("=")[0]) for k in allowed[:7]) and not safe_on_resume("wandbx.enabled")
    assert all(k.endswith(".") or k.count(".") >= 1 for k in SAFE_ON_RESUME)


def test_a_dry_run_refuses_the_same_overrides(tmp_path):
    from streamrl.streaming.preflight import resolve_config

    with pytest.raises(ValueError, match=r"data\.seed \(0 -> 3\)"):
        resolve_config(None, ["data.seed=3"], str(_run_dir(tmp_path)))
    assert resume_config(_run_dir(tmp_path / "b"), [])[0].data.seed == 0


def test_a_dataset_changed_under_the_run_is_refused(tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"what is {i} + {i}?"}], "ground_truth": str(2 * i)} for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = _run_dir(tmp_path, f"data.source={data}")
    open_run(None, [], str(run_dir))  # unchanged: resumes
    rows[3]["ground_truth"] = "7"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="the training prompts changed since the run started"):
        open_run(None, [], str(run_dir))


def test_a_run_without_a_fingerprint_resumes_with_a_warning(tmp_path, caplog):
    run_dir = _run_dir(tmp_path)
    info = json.loads((run_dir / "run_info.json").read_text())
    del info["prompts_sha256"]
    (run_dir / "run_info.json").write_text(json.dumps(info))
    open_run(None, [], str(run_dir))
    assert "records no prompts_sha256" in caplog.text
