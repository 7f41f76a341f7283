"""LearnerGroup: two FSDP2 ranks on gloo (CPU) take the same step as one process."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from tests.learner.test_engine import _batch


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _sync_names(engine) -> list[tuple[str, tuple[int, ...], float]]:
    return [(n, tuple(t.shape), float(t.double().sum())) for n, t in engine.named_parameters_for_sync()]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_two_rank_fsdp_group_matches_single_process(ray_cluster, tmp_path):
    from streamrl.learner.group import LearnerGroup

    # chunked LM head and activation checkpointing on: both must compose with FSDP2's hooks
    cfg = LearnerConfig(
        model="tiny",
        device="cpu",
        algo="ppo",
        lr=1e-3,
        micro_batch_tokens=24,
        seed=3,
        correction={"mode": "decoupled"},
        logits_chunk_tokens=7,
        gradient_checkpointing=True,
    )
    single = TrainingEngine(cfg)
    group = LearnerGroup(cfg, num_workers=2, num_cpus_per_worker=1)
    try:
        for step in range(1):
            batch = _batch(versions=(step,) * 4, seed=step)
            expected = single.train_step(batch)
            got = group.train_step(batch)
            assert got["learner/loss"] == pytest.approx(expected["learner/loss"], rel=1e-4, abs=1e-6)
            assert got["learner/grad_norm"] == pytest.approx(expected["learner/grad_norm"], rel=1e-4)
            assert got["is/ratio_mean"] == pytest.approx(expected["is/ratio_mean"], rel=1e-4)
        assert group.policy_version == 1
        # every rank iterates the per-parameter all-gathers; names/shapes are the HF ones
        ranks = group.inspect_all(_sync_names)
        local = _sync_names(single)
        assert [r[:2] for r in ranks[0]] == [r[:2] for r in local] == [r[:2] for r in ranks[1]]
        for (_, _, a), (_, _, b) in zip(ranks[0], local):
            assert a == pytest.approx(b, rel=1e-3, abs=1e-3)
        logp = group.compute_logprobs(_batch(seed=9))
        assert torch.allclose(logp, single.compute_logprobs(_batch(seed=9)), atol=1e-3)
        group.save_hf(tmp_path / "hf")
        assert (tmp_path / "hf" / "model.safetensors").exists()
        group.save_checkpoint(tmp_path / "ckpt")
        # the same state checkpointed in the background (every rank gathers, rank 0 writes) while the
        # group trains on: the files are those of the inline save
        group._wait(group.start_snapshot(tmp_path / "background"))
        group.train_step(_batch(versions=(1,) * 4, seed=5))
        assert group._wait([group.rank0.finish_checkpoint.remote()]) == [str(tmp_path / "background")]
        assert _files(tmp_path / "background") == _files(tmp_path / "ckpt")
        group.load_checkpoint(tmp_path / "ckpt")
        assert group.policy_version == 1
    finally:
        group.shutdown()
