"""FakeEngine honours the engine contract that logic tests rely on; EngineConfig validation."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from streamrl.engines import EngineConfig, FakeEngine, PauseMode, SamplingParams, fake_logprob

pytestmark = pytest.mark.timeout(30)


async def wait_running(engine: FakeEngine, num: int = 1) -> None:
    while engine.stats().num_running < num:
        await asyncio.sleep(0.001)


async def test_scripted_completions_in_call_order_with_stop_and_length():
    engine = FakeEngine(script=[[10, 11, 12, 2, 13], [20, 21, 22, 23]])
    first = await engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[2]))
    assert first.token_ids == [10, 11, 12, 2] and first.finish_reason == "stop"
    assert first.logprobs == [fake_logprob(3 + i, t) for i, t in enumerate(first.token_ids)]
    assert first.policy_versions == [0, 0, 0, 0]
    second = await engine.generate("b", [1], SamplingParams(max_tokens=2))
    assert second.token_ids == [20, 21] and second.finish_reason == "length"
    third = await engine.generate("c", [1], SamplingParams(max_tokens=9))  # script cycles
    assert third.token_ids == [10, 11, 12, 2, 13] and third.finish_reason == "stop"
    exact = await engine.generate("d", [1], SamplingParams(max_tokens=4))
    assert exact.token_ids == [20, 21, 22, 23] and exact.finish_reason == "length"


async def test_callable_script_sees_prompt():
    engine = FakeEngine(script=lambda prompt: [len(prompt), *prompt])
    out = await engine.generate("a", [7, 8], SamplingParams(max_tokens=5))
    assert out.token_ids == [2, 7, 8]
    assert engine.requests_seen == [("a", [7, 8])]


async def test_abort_mid_generation_keeps_partial():
    engine = FakeEngine(script=[list(range(100, 200))], token_delay_s=0.005)
    task = asyncio.create_task(engine.generate("r", [1], SamplingParams(max_tokens=100)))
    await asyncio.sleep(0.05)
    await engine.abort("r")
    out = await task
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 100
    assert out.token_ids == list(range(100, 100 + len(out.token_ids)))
    assert engine.stats().num_aborted == 1
    await engine.abort("r")  # finished ids are ignored


async def test_pause_abort_ends_all_and_queues_new_requests():
    engine = FakeEngine(script=[list(range(50))], token_delay_s=0.002)
    running = [asyncio.create_task(engine.generate(f"r{i}", [1], SamplingParams(max_tokens=50))) for i in range(3)]
    await wait_running(engine, 3)
    await asyncio.sleep(0.01)
    await engine.pause(PauseMode.ABORT)
    outs = await asyncio.gather(*running)
    assert all(o.finish_reason == "abort" for o in outs)
    queued = asyncio.create_task(engine.generate("late", [1], SamplingParams(max_tokens=3)))
    await asyncio.sleep(0.02)
    assert not queued.done()
    await engine.resume()
    assert (await queued).token_ids == [0, 1, 2]


async def test_keep_pause_freezes_and_retags_versions_after_resume():
    engine = FakeEngine(script=[list(range(40))], token_delay_s=0.002)
    task = asyncio.create_task(engine.generate("r", [1], SamplingParams(max_tokens=40)))
    await asyncio.sleep(0.02)
    await engine.pause(PauseMode.KEEP)
    await asyncio.sleep(0.02)
    await engine.load_weights_from_path("/weights/v1", 1)
    await engine.resume()
    out = await task
    assert out.finish_reason == "length" and out.token_ids == list(range(40))
    switch = out.policy_versions.index(1)
    assert 0 < switch < 40 and out.policy_versions == [0] * switch + [1] * (40 - switch)
    assert engine.loaded_paths == [("/weights/v1", 1)]


async def test_abort_while_paused_returns_promptly():
    engine = FakeEngine(script=[list(range(10))], token_delay_s=0.001)
    await engine.pause(PauseMode.KEEP)
    task = asyncio.create_task(engine.generate("r", [1], SamplingParams(max_tokens=10)))
    await wait_running(engine)
    await engine.abort("r")
    out = await asyncio.wait_for(task, 1.0)
    assert out.finish_reason == "abort" and out.token_ids == []


async def test_fenced_pause_never_outlives_the_resume_of_its_sync():
    engine = FakeEngine(script=[[7, 8, 9]])
    # A pause older than an applied resume is ignored (the call reached the engine late).
    await engine.resume(epoch=5)
    await engine.pause(PauseMode.ABORT, epoch=5)
    assert not engine.paused
    # A pause in flight when the resume of its sync arrives is undone as soon as it lands.
    engine.pause_delay_s = 0.05
    late = asyncio.create_task(engine.pause(PauseMode.ABORT, epoch=6))
    await asyncio.sleep(0.01)
    await engine.resume(epoch=6)
    await late
    assert not engine.paused
    assert (await asyncio.wait_for(engine.generate("r", [1], SamplingParams(max_tokens=3)), 1.0)).token_ids == [7, 8, 9]
    # An older pause landing late does not undo the pause of a newer sync still in progress.
    older = asyncio.create_task(engine.pause(PauseMode.KEEP, epoch=7))
    await asyncio.sleep(0.01)
    engine.pause_delay_s = 0.0
    await engine.pause(PauseMode.KEEP, epoch=8)
    await older
    assert engine.paused
    await engine.resume(epoch=8)
    assert not engine.paused
    # Unfenced calls behave as before.
    await engine.pause(PauseMode.KEEP)
    assert engine.paused
    await engine.resume()
    assert not engine.paused


async def test_commit_relabels_with_the_load_once_per_epoch_and_a_failed_one_stops_sampling():
    from streamrl.engines.base import EngineOutOfServiceError, StaleSyncEpochError

    loads: list[int] = []
    fail = {"next": False}

    async def commit(policy_version: int) -> dict:
        await asyncio.sleep(0.05)
        loads.append(policy_version)
        if fail["next"]:
            raise RuntimeError("reload died midway")
        return {"policy_version": policy_version}

    engine = FakeEngine(script=[[1, 2]], rpc_handlers={"commit_weights": commit})
    # A caller that gives up does not stop the load; a repeated call of the same epoch joins it.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.commit_weights(1, epoch=10), 0.01)
    assert engine.policy_version == 0
    await engine.commit_weights(1, epoch=10)
    assert engine.policy_version == 1 and loads == [1]
    await engine.commit_weights(1, epoch=10)  # already done: no second load
    assert loads == [1]
    # A commit older than an applied resume is refused.
    await engine.resume(epoch=11)
    with pytest.raises(StaleSyncEpochError):
        await engine.commit_weights(2, epoch=11)
    # A failed load leaves the engine out of service (old label, weights unknown) until a commit succeeds.
    fail["next"] = True
    with pytest.raises(RuntimeError, match="midway"):
        await engine.commit_weights(2, epoch=12)
    assert engine.policy_version == 1
    with pytest.raises(EngineOutOfServiceError):
        await engine.generate("r", [1], SamplingParams(max_tokens=2))
    with pytest.raises(EngineOutOfServiceError):
        await engine.ping()
    fail["next"] = False
    await engine.commit_weights(2, epoch=12)  # the repair retries a failed load
    assert loads == [1, 2, 2] and await engine.ping() == 2
    assert (await engine.generate("r", [1], SamplingParams(max_tokens=2))).policy_versions == [2, 2]


async def test_failure_injection_rpc_and_bad_input():
    engine = FakeEngine(rpc_handlers={"echo": lambda x: x * 2})
    assert await engine.collective_rpc("echo", args=(21,)) == [42]
    with pytest.raises(ValueError, match="no rpc handler"):
        await engine.collective_rpc("missing")
    with pytest.raises(ValueError, match="empty"):
        await engine.generate("r", [], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="at least one"):
        FakeEngine(script=[])
    engine.fail_with = RuntimeError("engine died")
    with pytest.raises(RuntimeError, match="engine died"):
        await engine.generate("r", [1], SamplingParams(max_tokens=3))


async def test_default_script_is_deterministic_and_stats_count():
    engine = FakeEngine()
    a = await engine.generate("a", [4, 5], SamplingParams(max_tokens=8))
    b = await engine.generate("b", [4, 5], SamplingParams(max_tokens=8))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    stats = engine.stats()
    assert stats.num_generated_tokens == 16 and stats.num_prompt_tokens == 4 and stats.num_running == 0


def test_engine_config_validation():
    cfg = EngineConfig()
    assert cfg.model == "tiny" and cfg.in_process
    assert EngineConfig(device="cpu").resolved_device() == "cpu"
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(modle="tiny")
    with pytest.raises(ValidationError):
        EngineConfig(max_model_len=0)
    with pytest.raises(ValidationError):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValidationError, match="in_process=False"):
        EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="num_gpus"):
        EngineConfig(device="cpu", num_gpus=1)


def test_importing_the_engine_package_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, streamrl.engines, streamrl.rollout.server_manager; "
        "print(any(m in sys.modules for m in ('vllm', 'ray', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
