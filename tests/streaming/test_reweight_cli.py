"""`streamrl staleness reweight` end to end on a real run directory: a durable buffer whose rows
carry behaviour log-probs computed by the tiny model at the version that labels them, a consumption
log and a real learner checkpoint (the learner path of a run, as in `test_replay.py`, without engines).

    groups a, b, c, d   sampled under version 0 (the initial weights)
    step 1              trains on a, b (lag 0)  -> checkpoint step_000001 = version 1
    groups e, f         sampled under version 1 (the checkpoint's weights)
    step 2              consumes c, d at version 1, step 3 e, f at version 2 (lag 1 both)

Under checkpoint 1 the tokens of version 1 were sampled by exactly its weights, so their
ρ = π_prox/π_behav is 1 up to the forward's numerics; version-0 tokens moved with the update.
"""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest

from streamrl.buffer.store import ReplayBuffer
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.streaming.cli import main
from streamrl.streaming.config import load_config
from streamrl.streaming.reweight_cli import DEFAULT_CORRECTIONS, reweight
from tests.buffer.helpers import make_traj
from tests.conftest import REPO


def _behaviour_logprobs(engine, traj) -> list[float]:
    """log π(response token) under the engine's current weights (0 on observation tokens)."""
    ids = traj.prompt_ids + traj.response_ids
    n, p = len(ids), len(traj.prompt_ids)
    loss_mask = np.array([[0] * p + list(traj.response_mask)], dtype=np.float32)
    padded = types.SimpleNamespace(
        input_ids=np.array([ids]),
        attention_mask=np.ones((1, n), dtype=np.int64),
        loss_mask=loss_mask,
        behavior_logprobs=np.zeros((1, n), dtype=np.float32),
        policy_versions=np.where(loss_mask > 0, 0, -1),
        seq_lens=np.array([n]),
        rewards=np.zeros(1, dtype=np.float32),
        group_index=np.zeros(1, dtype=np.int64),
    )
    logp = engine.compute_logprobs(padded)[0, p:].tolist()
    return [lp if m else 0.0 for lp, m in zip(logp, traj.response_mask)]


def _group(engine, gid: str, version: int, seed: int):
    rows = []
    for i, reward in enumerate([1.0, 0.0] if seed % 2 else [0.0, 1.0]):
        t = make_traj(gid, i, num_response=6 + (seed + i) % 5, reward=reward, version=version)
        t = dataclasses.replace(
            t,
            response_ids=[(17 * seed + 31 * i + 7 * k) % 500 + 50 for k in range(len(t.response_ids))],
            created_at=float(seed),
            finished_at=seed + 0.5,
        )  # the buffer samples oldest first
        rows.append(dataclasses.replace(t, behavior_logprobs=_behaviour_logprobs(engine, t)))
    return rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_path):
    from streamrl.learner.engine import TrainingEngine

    run = tmp_path_factory.mktemp("reweight_run")
    cfg = load_config(
        REPO / "configs/tiny.toml",
        [f"model={tiny_model_path}", "buffer.batch_size=4", "buffer.group_size=2", "learner.lr=1e-2"],
    )
    cfg.learner.model = str(tiny_model_path)
    cfg.buffer.root_dir = str(run / "buffer")
    info = RunInfo(run_name="run", model_path=str(tiny_model_path), mode="async", config=cfg.model_dump(mode="json"))
    RunDir(run).write_info(info)
    buf = ReplayBuffer(cfg.buffer)
    engine = TrainingEngine(cfg.learner)
    buf.append([t for k, g in enumerate("abcd") for t in _group(engine, g, 0, k)])
    assert engine.train_step(buf.sample(served_version=0, learner_step=1).to_padded())["learner/grad_norm"] > 0
    engine.save_checkpoint(run / "checkpoints" / "step_000001")
    buf.append([t for k, g in enumerate("ef") for t in _group(engine, g, 1, k + 4)])
    for step in (2, 3):  # consumption is all reweight reads; no need to train
        assert buf.sample(served_version=step - 1, learner_step=step).lags.tolist() == [1, 1, 1, 1]
    buf.close()
    return run


@pytest.mark.timeout(300)
def test_reweight_every_preset_on_the_logged_batches(run_dir):
    result, path = reweight(run_dir, 1)
    assert path == run_dir / "staleness" / "reweight.json" and json.loads(path.read_text()) == result
    assert result["steps"] == [1, 2, 3] and result["checkpoint_policy_version"] == 1
    rows = {c["correction"]: c for c in result["corrections"]}
    assert list(rows) == list(DEFAULT_CORRECTIONS)
    assert rows["none"]["weight_min"] == rows["none"]["weight_max"] == 1.0 and rows["none"]["ess"] == 1.0
    assert rows["tis"]["weight_max"] <= 2.0 and rows["decoupled"]["weight_max"] <= 2.0  # the run's cap
    for c in rows.values():
        for key in ("truncated_frac", "masked_frac", "seq_masked_frac", "seq_rejected_frac", "clip_frac", "ess"):
            assert 0.0 <= c[key] <= 1.0, (c["correction"], key)
        assert c["num_tokens"] == rows["none"]["num_tokens"] and c["num_seqs"] == 12
        assert sum(c["loss_share"].values()) == pytest.approx(1.0)
        assert set(c["loss_share"]) <= {"lag_0", "lag_1"}  # the logged lags
    assert set(result["rho_by_lag"]) == {"lag_0", "lag_1"}
    gap = result["rho_by_version_gap"]  # checkpoint version 1 − token version
    assert gap["0"]["max_abs_log"] < 1e-4  # the checkpoint sampled these tokens
    assert gap["1"]["max_abs_log"] > 1e-3  # the update moved the version-0 tokens


@pytest.mark.timeout(300)
def test_the_checkpoint_that_sampled_a_batch_gives_it_weight_one(run_dir, tmp_path):
    result, _ = reweight(run_dir, 1, ["decoupled", "masked", "m2po"], steps="3:3", out=tmp_path)
    assert result["steps"] == [3] and set(result["rho_by_version_gap"]) == {"0"}
    for c in result["corrections"]:
        assert c["weight_mean"] == pytest.approx(1.0, abs=1e-4) and c["ess"] == pytest.approx(1.0, abs=1e-6)
        assert c["masked_frac"] == 0.0 and c["truncated_frac"] == 0.0 and c["clip_frac"] == 0.0
        assert c["loss_share"] == {"lag_1": pytest.approx(1.0)}


@pytest.mark.timeout(300)
def test_cli_table_and_clear_errors(run_dir, tmp_path, capsys):
    argv = [
        "staleness",
        "reweight",
        str(run_dir),
        "--checkpoint",
        "1",
        "--out",
        str(tmp_path),
        "--correction",
        "none",
        "--correction",
        "decoupled:rejection=bounds",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ESS" in out and "decoupled:rejection=bounds" in out and (tmp_path / "reweight.txt").exists()
    assert len(json.loads((tmp_path / "reweight.json").read_text())["corrections"]) == 2
    assert main(["staleness", "reweight", str(run_dir), "--checkpoint", "7"]) == 2
    assert "no checkpoint of step 7; available: 1" in capsys.readouterr().err
    assert main(["staleness", "reweight", str(run_dir), "--checkpoint", "1", "--steps", "9:12"]) == 2
    assert "no logged step in range; logged steps are 1..3" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run_info.json").write_text("{}")
    assert main(["staleness", "reweight", str(tmp_path / "empty"), "--checkpoint", "1"]) == 2
    assert "has no buffer directory" in capsys.readouterr().err
    assert main(["staleness", "reweight", str(run_dir), "--checkpoint", "1", "--correction", "ppo"]) == 2
    assert "unknown correction 'ppo'" in capsys.readouterr().err
