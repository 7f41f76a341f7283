"""A rollout worker killed mid-session, on the real actor path: a `RolloutWorkerActor` (Ray) runs the
`gateway` agent loop, whose OpenAI-SDK program makes three chained calls; every answered call is made
durable in the real `BufferActor` (a record of the trajectory's journal) before it is sent. The worker
process dies (SIGKILL, the `gateway.before_answer` fault point) with its second answer durable and never
sent. The trajectory is resubmitted as the driver does (`Pipeline.resubmit_orphans`: the next attempt
recorded durably, then handed to a new worker); the new worker folds the journal onto the admission row,
re-runs the program from the start, and its repeats of the two journaled calls get the journaled answers
(the one no client ever saw included) without a new sample; only the third call samples, and the
session's one record continues (no fork).

The engine is a FakeEngine in a Ray actor (every sample a new text, counted), so the test runs without
vLLM; the worker, the buffer, the kill and the resubmission are the real ones."""

from __future__ import annotations

import asyncio
import itertools
import types
from typing import Any

import openai
import pytest

from streamrl.core import faults
from streamrl.workloads.answer_ledger import read_answers, record
from tests.fixtures.ray_cluster import RAY_TIMEOUT_S

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

HERE = "tests.rollout.gateway.test_gateway_worker_kill"
NUM_CALLS = 3


async def program(base_url: str, api_key: str, sample: dict) -> float:
    """Three chained calls; each answer it gets is a ledger line (attempt, call index, text, id)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = list(sample["messages"])
    for i in range(NUM_CALLS):
        out = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
        text = out.choices[0].message.content
        record({"kind": "answer", "attempt": sample["attempt"], "call": i, "answer": text, "id": out.id})
        messages = [
            *messages,
            out.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Go on."},
        ]
    return 1.0


def engine_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class CountingEngine:
        """An engine actor (the methods `RayEngineClient` calls) over a FakeEngine whose every sample
        is a new text: a call sampled again is visible in its answer and in `num_requests`."""

        def __init__(self, model_path: str) -> None:
            from transformers import AutoTokenizer

            from streamrl.engines.fake import FakeEngine

            tok = AutoTokenizer.from_pretrained(model_path)
            counter = itertools.count()

            def script(prompt_ids: list[int]) -> list[int]:
                return tok.encode(f"Sample {next(counter)}.", add_special_tokens=False) + [tok.eos_token_id]

            self.engine = FakeEngine(script=script, token_delay_s=0.01)

        async def start(self) -> str:
            return "cpu"

        async def generate(self, request_id, prompt_ids, sampling, images=None):
            return await self.engine.generate(request_id, prompt_ids, sampling, images=images)

        async def abort(self, request_id: str) -> None:
            await self.engine.abort(request_id)

        async def ping(self) -> int:
            return self.engine.policy_version

        async def num_requests(self) -> int:
            return len(self.engine.requests_seen)

    return CountingEngine


def _config(model_path, buffer_root) -> Any:
    from streamrl.streaming.config import load_config

    return load_config(
        "configs/tiny.toml",
        [
            f"model={model_path}",
            f"buffer.root_dir={buffer_root}",
            "buffer.batch_size=1",
            "buffer.group_size=1",
            f"rollout.agent.gateway.program={HERE}:program",
            "rollout.agent.gateway.timeout_s=120",
        ],
    )


def _start_worker(cfg, model_path, engine, buffer, env: dict[str, str]):
    from streamrl.streaming.actors.clients import WorkerClient
    from streamrl.streaming.actors.worker import RolloutWorkerActor

    handle = RolloutWorkerActor.options(num_cpus=0, runtime_env={"env_vars": env}).remote(
        "worker-kill-test", cfg, str(model_path), [engine], buffer.handle
    )
    return WorkerClient(handle, timeout_s=RAY_TIMEOUT_S)


async def _until(check, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def test_a_killed_workers_journaled_answer_reaches_the_rerun_program_without_a_new_sample(
    ray_cluster, tmp_path, tiny_model_path
):
    import ray

    from streamrl.rollout.gateway.journal import CallRecord
    from streamrl.rollout.types import AgentData, TrajectoryStatus
    from streamrl.streaming.actors.buffer import create_buffer_actor
    from streamrl.streaming.actors.clients import BufferClient
    from streamrl.streaming.pipeline import Pipeline

    cfg = _config(tiny_model_path, tmp_path / "buffer")
    buffer = BufferClient(create_buffer_actor(cfg.buffer), timeout_s=RAY_TIMEOUT_S)
    engine = engine_actor_class().remote(str(tiny_model_path))
    ledger = tmp_path / "answers.jsonl"
    env = {faults.ANSWER_LEDGER_ENV: str(ledger), faults.LEDGER_ENV: str(tmp_path / "faults")}
    # the first worker dies at its 2nd answer: journaled and durable, not sent
    first = _start_worker(
        cfg, tiny_model_path, engine, buffer, {**env, faults.ENV: "gateway.before_answer=kill_self@2"}
    )
    workers = [first]
    data = AgentData(
        trajectory_id="kill/0", group_id="kill", agent_name="gateway", messages=[{"role": "user", "content": "Hi."}]
    )
    try:
        await buffer.append_durable([data.to_trajectory(TrajectoryStatus.PARTIAL)])  # admission, as the driver
        await first.submit([data])

        async def dead() -> bool:
            try:
                await first.running_ids()
            except ray.exceptions.RayActorError:
                return True
            return False

        await _until(dead)
        (row,) = await buffer.resumable(["kill/0"])
        journal = [CallRecord.model_validate_json(r.payload).entry for r in await buffer.journal("kill/0")]
        assert row.attempt == 0 and len(journal) == 2  # both answers durable before the death
        assert await engine.num_requests.remote() == 2
        before = read_answers(ledger)
        assert [(x["attempt"], x["call"]) for x in before] == [(0, 0)]  # the 2nd answer never left

        second = _start_worker(cfg, tiny_model_path, engine, buffer, env)
        workers.append(second)
        pipeline = types.SimpleNamespace(
            _submit_lock=asyncio.Lock(), workers=[second], buffer=buffer, num_stranded_checks=0, _next_worker=0
        )
        pipeline._submit = lambda items: Pipeline._submit(pipeline, items)
        assert await Pipeline.resubmit_orphans(pipeline) == 1  # the driver's resubmission: attempt 1

        async def finished() -> bool:
            return await buffer.handle.num_ready.remote() == 1

        await _until(finished)
        assert await engine.num_requests.remote() == 3  # the re-run sampled only its third call
        batch = await buffer.handle.sample.remote(0, 1)
    finally:
        for w in workers:
            w.kill()
        ray.kill(engine)
        ray.kill(buffer.handle)

    answers = read_answers(ledger)
    rerun = [x for x in answers if x["attempt"] == 1]
    assert [x["call"] for x in rerun] == [0, 1, 2]
    assert (rerun[0]["answer"], rerun[0]["id"]) == (before[0]["answer"], before[0]["id"])  # the journal's
    unsent = journal[1].response
    assert (rerun[1]["answer"], rerun[1]["id"]) == (unsent["choices"][0]["message"]["content"], unsent["id"])
    assert [x["answer"] for x in rerun] == ["Sample 0.", "Sample 1.", "Sample 2."]  # only the third sampled anew
    traj = batch.table.to_pylist()[0]
    assert traj["attempt"] == 1 and traj["status"] == "finished"
    sampled = [t for t, m in zip(traj["response_ids"], traj["response_mask"]) if m]
    runs = sum(1 for i, m in enumerate(traj["response_mask"]) if m and (i == 0 or not traj["response_mask"][i - 1]))
    assert runs == NUM_CALLS and len(sampled) > 0  # one record, three sampled turns: no fork
