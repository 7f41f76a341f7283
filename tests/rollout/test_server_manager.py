"""ServerManager routing: least-outstanding first turn, sticky later turns, LRU bound, health."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines import EngineConfig, FakeEngine, SamplingParams
from streamrl.rollout.server_manager import NoHealthyEngineError, ServerManager

SAMPLING = SamplingParams(max_tokens=4)


def fleet(num: int, **kwargs) -> list[FakeEngine]:
    return [FakeEngine(f"e{i}", **kwargs) for i in range(num)]


@pytest.mark.timeout(30)
async def test_first_turn_goes_to_least_outstanding_engine():
    engines = fleet(3, script=[list(range(200))], token_delay_s=0.005)
    manager = ServerManager(engines)
    slow = [
        asyncio.create_task(manager.generate(f"t{i}", f"r{i}", [1], SamplingParams(max_tokens=200))) for i in range(4)
    ]
    await asyncio.sleep(0.01)
    # 4 long requests over 3 engines: 2 + 1 + 1 outstanding, spread by tie-breaking.
    assert sorted(manager.stats().outstanding.values()) == [1, 1, 2]
    busiest = max(manager.stats().outstanding, key=manager.stats().outstanding.get)
    quick, engine_id = await manager.generate("fresh", "q", [1], SAMPLING)
    assert engine_id != busiest and len(quick.token_ids) == 4
    await manager.pause_all()
    outs = await asyncio.gather(*slow)
    assert all(out.finish_reason == "abort" for out, _ in outs)
    await manager.resume_all()
    assert manager.stats().num_in_flight == 0


@pytest.mark.timeout(30)
async def test_trajectory_sticks_to_its_engine_across_turns():
    manager = ServerManager(fleet(3))
    _, first = await manager.generate("traj", "t0", [1, 2], SAMPLING)
    for turn in range(1, 6):
        # Load elsewhere does not move a trajectory that already has an engine.
        await manager.generate(f"other{turn}", f"o{turn}", [3], SAMPLING)
        _, engine_id = await manager.generate("traj", f"t{turn}", [1, 2, turn], SAMPLING)
        assert engine_id == first
    requests = {e: [rid for rid, _ in manager.engine(e).requests_seen] for e in manager.engine_ids}
    assert all(f"t{turn}" in requests[first] for turn in range(6))


@pytest.mark.timeout(30)
async def test_sticky_map_is_lru_bounded():
    manager = ServerManager(fleet(2), max_sticky_keys=3)
    for i in range(3):
        await manager.generate(f"t{i}", f"r{i}", [1], SAMPLING)
    await manager.generate("t0", "r0b", [1], SAMPLING)  # refresh t0: t1 is now the oldest
    await manager.generate("t3", "r3", [1], SAMPLING)
    assert manager.sticky_engine("t1") is None
    assert all(manager.sticky_engine(k) is not None for k in ("t0", "t2", "t3"))
    stats = manager.stats()
    assert stats.num_sticky_keys == 3 and stats.num_sticky_evictions == 1
    manager.release("t0")
    assert manager.sticky_engine("t0") is None


@pytest.mark.timeout(30)
async def test_failing_engine_is_removed_and_request_retried():
    engines = fleet(2)
    manager = ServerManager(engines)
    _, engine_id = await manager.generate("traj", "r0", [1], SAMPLING)
    broken = manager.engine(engine_id)
    broken.fail_with = RuntimeError("worker crashed")
    out, new_engine = await manager.generate("traj", "r1", [1, 2], SAMPLING)
    assert new_engine != engine_id and len(out.token_ids) == 4
    assert manager.healthy_engine_ids == [new_engine]
    assert manager.sticky_engine("traj") == new_engine
    stats = manager.stats()
    assert stats.num_engine_failures == 1 and stats.num_retries == 1 and stats.num_healthy == 1
    assert manager.pin("traj", engine_id) is False  # can't pin to an unhealthy engine

    manager.engine(new_engine).fail_with = RuntimeError("also crashed")
    with pytest.raises(RuntimeError, match="also crashed"):
        await manager.generate("traj", "r2", [1], SAMPLING)
    with pytest.raises(NoHealthyEngineError):
        await manager.generate("traj", "r3", [1], SAMPLING)


@pytest.mark.timeout(30)
async def test_bad_request_does_not_mark_engine_unhealthy():
    manager = ServerManager(fleet(2))
    with pytest.raises(ValueError):
        await manager.generate("traj", "r0", [], SAMPLING)
    assert manager.stats().num_healthy == 2


@pytest.mark.timeout(30)
async def test_mark_unhealthy_reroutes_and_pin_restores_affinity():
    manager = ServerManager(fleet(2))
    assert manager.pin("resumed", "e1") is True
    _, engine_id = await manager.generate("resumed", "r0", [1], SAMPLING)
    assert engine_id == "e1"
    manager.mark_unhealthy("e1", reason="test")
    assert manager.sticky_engine("resumed") is None
    _, engine_id = await manager.generate("resumed", "r1", [1], SAMPLING)
    assert engine_id == "e0"
    manager.mark_healthy("e1")
    assert manager.pin("resumed", "e1") is True
    with pytest.raises(ValueError, match="unknown engine"):
        manager.mark_unhealthy("nope")


@pytest.mark.timeout(30)
async def test_probe_restores_an_engine_that_answers_again_at_the_current_version():
    engines = fleet(2)
    manager = ServerManager(engines)
    assert await manager.probe_unhealthy() == []  # nothing to do while all are healthy
    engines[1].fail_with = RuntimeError("actor died")
    # Two concurrent first turns spread over both engines: e1's fails, is retried on e0.
    await asyncio.gather(*(manager.generate(f"t{i}", f"r{i}", [1], SAMPLING) for i in range(2)))
    assert manager.healthy_engine_ids == ["e0"]
    assert await manager.probe_unhealthy(timeout_s=1.0) == []  # still dead
    engines[1].fail_with = None
    engines[0].policy_version = 3  # weight sync moved on while e1 was away
    assert await manager.probe_unhealthy(timeout_s=1.0) == []  # answers, but with stale weights
    assert manager.healthy_engine_ids == ["e0"]
    engines[1].policy_version = 3
    assert await manager.probe_unhealthy(timeout_s=1.0, keep_out={"e1"}) == []  # weight sync dropped it
    assert await manager.probe_unhealthy(timeout_s=1.0) == ["e1"]
    assert manager.healthy_engine_ids == ["e0", "e1"] and manager.stats().num_restored == 1
    _, engine_id = await manager.generate("fresh", "r2", [1], SAMPLING)
    assert engine_id == "e1"  # least loaded again


@pytest.mark.timeout(30)
async def test_align_follows_the_weight_sync_set():
    """I6 wiring: an engine weight sync dropped leaves routing even while it still answers (it may
    serve stale or half-loaded weights); once sync takes it back it rejoins at the current version."""
    engines = fleet(3)
    manager = ServerManager(engines)
    assert await manager.align(keep_out=["e2"]) == []
    assert manager.healthy_engine_ids == ["e0", "e1"]
    outputs = await asyncio.gather(*(manager.generate(f"t{i}", f"r{i}", [1], SAMPLING) for i in range(6)))
    assert {engine_id for _, engine_id in outputs} == {"e0", "e1"}  # nothing routed to the dropped engine
    assert await manager.align(keep_out=["e2"]) == []  # still dropped: stays out though it answers
    assert await manager.align(keep_out=[]) == ["e2"]  # sync took it back
    assert manager.healthy_engine_ids == ["e0", "e1", "e2"]


@pytest.mark.timeout(30)
async def test_probe_is_bounded_when_an_engine_never_answers():
    class Hung(FakeEngine):
        async def ping(self) -> int:
            await asyncio.sleep(3600)
            return 0

    manager = ServerManager([FakeEngine("e0"), Hung("e1")])
    manager.mark_unhealthy("e1", reason="test")
    started = asyncio.get_running_loop().time()
    assert await manager.probe_unhealthy(timeout_s=0.2) == []
    assert asyncio.get_running_loop().time() - started < 2.0
    assert manager.healthy_engine_ids == ["e0"]


@pytest.mark.timeout(30)
async def test_abort_is_routed_to_the_engine_holding_the_request():
    manager = ServerManager(fleet(2, script=[list(range(500))], token_delay_s=0.002))
    task = asyncio.create_task(manager.generate("traj", "long", [1], SamplingParams(max_tokens=500)))
    await asyncio.sleep(0.02)
    await manager.abort("long")
    await manager.abort("unknown")
    out, _ = await task
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 500


def test_constructor_validation():
    with pytest.raises(ValueError, match="at least one"):
        ServerManager([])
    with pytest.raises(ValueError, match="unique"):
        ServerManager([FakeEngine("a"), FakeEngine("a")])
    with pytest.raises(ValueError, match="max_sticky_keys"):
        ServerManager([FakeEngine("a")], max_sticky_keys=0)


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.timeout(400)
async def test_sticky_routing_over_two_ray_vllm_engines(ray_cluster, tiny_model_path):
    from streamrl.streaming.actors.engine import RayEngineClient

    cfg = EngineConfig(
        model=str(tiny_model_path),
        device="cpu",
        max_model_len=2048,
        max_num_seqs=8,
        num_cpus=1,
        startup_timeout_s=300,
        call_timeout_s=300,
    )
    engines = [RayEngineClient.launch(cfg, f"ray-{i}") for i in range(2)]
    manager = ServerManager(engines)
    try:
        assert await asyncio.gather(*(e.wait_ready() for e in engines)) == ["cpu", "cpu"]
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        prompts = {"traj-a": [5, 6, 7], "traj-b": [8, 9, 10]}
        first = await asyncio.gather(*(manager.generate(k, f"{k}-0", p, greedy) for k, p in prompts.items()))
        homes = {k: engine_id for k, (_, engine_id) in zip(prompts, first, strict=True)}
        assert set(homes.values()) == {"ray-0", "ray-1"}  # concurrent first turns spread out
        for turn in range(1, 3):
            for key, (out, _) in zip(prompts, first, strict=True):
                prompts[key] = prompts[key] + out.token_ids
            first = await asyncio.gather(*(manager.generate(k, f"{k}-{turn}", p, greedy) for k, p in prompts.items()))
            assert {k: e for k, (_, e) in zip(prompts, first, strict=True)} == homes
        # Abort while a generate is in flight inside the actor.
        task = asyncio.create_task(
            manager.generate("traj-a", "long", [5, 6, 7], SamplingParams(max_tokens=2000, temperature=0.0))
        )
        await asyncio.sleep(0.5)
        await manager.abort("long")
        out, engine_id = await asyncio.wait_for(task, 60)
        assert engine_id == homes["traj-a"] and out.finish_reason == "abort" and len(out.token_ids) < 2000
        remote = await engines[0].remote_stats()
        assert remote.engine_id == "ray-0" and remote.num_generated_tokens > 0
    finally:
        await manager.shutdown()


@pytest.mark.timeout(30)
async def test_added_engine_waits_out_of_routing_and_a_retired_one_hands_its_requests_back():
    """Elastic engines: a new engine serves only once let in; retiring an engine aborts its in-flight
    requests (the caller gets the streamed tokens) and the trajectory's next request goes elsewhere."""
    engines = fleet(2, script=[list(range(200))], token_delay_s=0.005)
    manager = ServerManager(engines)
    late = FakeEngine("e2", script=[list(range(200))], policy_version=-1)
    assert manager.add_engine(late) and not manager.add_engine(late)
    assert "e2" not in manager.healthy_engine_ids
    assert await manager.align(keep_out=["e2"]) == []  # kept out by the caller
    assert await manager.probe_unhealthy() == []  # answers at version -1 < 0: stays out
    late.policy_version = 0  # a sync brought it to the served version
    assert await manager.probe_unhealthy() == ["e2"]

    long = SamplingParams(max_tokens=200)
    task = asyncio.create_task(manager.generate("t", "r0", [1], long))
    await asyncio.sleep(0.05)
    home = manager.sticky_engine("t")
    assert home is not None and manager.stats().outstanding[home] == 1
    assert await manager.retire(home) == 1
    out, engine_id = await task
    assert engine_id == home and out.finish_reason == "abort" and 0 < len(out.token_ids) < 200
    assert home not in manager.engine_ids and home not in manager.healthy_engine_ids
    _, again = await manager.generate("t", "r1", [1, *out.token_ids], SAMPLING)
    assert again != home  # the trajectory continues on another engine
    assert await manager.probe_unhealthy() == [] and home not in manager.engine_ids
    assert await manager.retire(home) == 0  # unknown now: ignored
    assert not manager.add_engine(FakeEngine(home))  # ids are never reused


class SeedOverflowEngine(FakeEngine):
    """Raises on a seed past int64 the way in-process vLLM does (deep inside, not a ValueError)."""

    async def _generate(self, request_id, prompt_ids, sampling, images):
        if sampling.seed is not None and sampling.seed >= 2**63:
            raise RuntimeError("Overflow when unpacking long")
        return await super()._generate(request_id, prompt_ids, sampling, images)


@pytest.mark.timeout(30)
async def test_out_of_range_seed_fails_its_request_only():
    """A seed >= 2**63 is refused before it reaches an engine: the request fails with a clear error,
    no engine leaves service, and the other trajectories keep generating."""
    manager = ServerManager([SeedOverflowEngine(f"e{i}") for i in range(2)])
    with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
        await manager.generate("bad", "r0", [1], SamplingParams(max_tokens=4, seed=2**64))
    assert manager.stats().num_healthy == 2 and manager.stats().num_engine_failures == 0
    out, _ = await manager.generate("good", "r1", [1], SamplingParams(max_tokens=4, seed=2**63 - 1))
    assert len(out.token_ids) == 4


@pytest.mark.timeout(30)
async def test_type_error_of_a_request_does_not_mark_engine_unhealthy():
    engines = fleet(2)
    manager = ServerManager(engines)
    for engine in engines:
        engine.fail_with = TypeError("seed must be an int")
    with pytest.raises(TypeError):
        await manager.generate("traj", "r0", [1], SAMPLING)
    assert manager.stats().num_healthy == 2


def test_sampling_config_refuses_a_seed_no_engine_takes():
    from streamrl.rollout.config import SamplingConfig

    with pytest.raises(ValueError, match="less than or equal to 9223372036854775807"):
        SamplingConfig(seed=2**64)
    assert SamplingConfig(seed=-(2**63)).seed == -(2**63)
