"""The pipeline simulator (streamrl.sim): determinism, the limits its loops must reach (a saturated
engine, sync phases that never overlap, the staleness bound of admission), and the engine's
processor sharing against a hand computation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.sim.costs import Costs, EngineCost, LearnerCost, SyncCost, ToolLatency, TrajectoryShape
from streamrl.sim.engine import Request, SharedCores, SimEngine
from streamrl.sim.loop import EventLoop
from streamrl.sim.pipeline import SimConfig, SimPipeline, simulate

TOOL = ToolLatency(0.3, 3.0)


def costs(*, tool: ToolLatency = TOOL, learner_s: float = 0.5, fixed_tokens: bool = False) -> Costs:
    tokens = (64.0, 64.0) if fixed_tokens else (8.0, 64.0, 128.0)
    return Costs(
        engine=EngineCost(base_s=0.005, per_seq_s=0.0005, request_s=0.02, max_batch=64),
        tool=tool,
        shape=TrajectoryShape(
            turn_probs=(1.0,) if fixed_tokens else (0.25, 0.25, 0.25, 0.25),
            turn_tokens=tokens,
            prompt_tokens=200.0,
            observation_tokens=20.0,
        ),
        learner=LearnerCost(base_s=learner_s, per_token_s=0.0, step_overhead_s=0.05),
        sync=SyncCost(base_s=0.1, pause_base_s=0.05),
    )


def config(**kw) -> SimConfig:
    buffer = BufferConfig(batch_size=16, group_size=4, max_staleness=kw.pop("max_staleness", 2))
    return SimConfig(buffer=buffer, total_steps=kw.pop("total_steps", 20), **kw)


def test_same_seed_same_run_other_seed_other_run():
    a, b = simulate(config(seed=1), costs()), simulate(config(seed=1), costs())
    c = simulate(config(seed=2), costs())
    assert a == b
    assert a.trained_samples_per_hour != c.trained_samples_per_hour


def test_no_tool_latency_and_no_staleness_bound_keep_the_engine_busy():
    # the learner is fast and admission never waits for it: the engine always has work
    fast = costs(tool=ToolLatency(0.0, 0.0), learner_s=0.01)
    r = simulate(config(max_staleness=10_000, max_concurrent=64), replace(fast, sync=SyncCost(base_s=0.1)))
    assert r.engine_busy_fraction > 0.99
    assert r.learner_idle_fraction > 0.5  # and the learner waits for it
    # a sync's pause aborts the engine's requests: it is not busy then (as `engine/busy_s` counts)
    paused = simulate(config(max_staleness=10_000, max_concurrent=64), fast)
    assert paused.sync_pause_share > 0.01
    assert paused.engine_busy_fraction == pytest.approx(1 - paused.sync_pause_share, abs=0.01)


def test_a_slow_learner_bounds_async_throughput_and_leaves_the_engine_idle():
    r = simulate(config(max_staleness=4), costs(learner_s=5.0))
    step_s = 5.0 + 0.1 + 0.05  # train + sync + per-step overhead
    assert r.trained_samples_per_hour == pytest.approx(16 / step_s * 3600, rel=0.01)
    assert r.learner_idle_fraction < 0.01
    assert r.engine_busy_fraction < 0.9  # admission stops at the staleness bound


class Recording(SimPipeline):
    """Notes every interval the learner trains and every request submitted to an engine."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.overlaps = 0
        self.trainings = 0
        submit = self.router.submit

        def watched(trajectory, request) -> None:
            self.overlaps += self.learner_state == "training"
            submit(trajectory, request)

        self.router.submit = watched  # type: ignore[method-assign]

    def _set_learner(self, state) -> None:
        if state == "training":
            self.trainings += 1
            self.overlaps += sum(e.in_flight for e in self.engines)
        super()._set_learner(state)


def test_sync_mode_never_generates_while_the_learner_trains():
    p = Recording(config(mode="sync"), costs())
    r = p.run()
    assert p.trainings == 20 and p.overlaps == 0
    assert r.lag_mean == 0.0 and r.lag_hist["staleness/lag_frac/trajectories/0"] == 1.0


def test_async_mode_does_generate_while_the_learner_trains():
    p = Recording(config(mode="async"), costs())
    p.run()
    assert p.overlaps > 0  # the recorder can see an overlap


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_admission_bounds_the_lag_when_trajectories_finish_in_start_order(bound):
    # every trajectory takes the same time: groups settle in start order, so admission's bound is exact
    r = simulate(config(max_staleness=bound, total_steps=15), costs(tool=ToolLatency(0.2, 0.2), fixed_tokens=True))
    hist = r.lag_hist
    assert hist["staleness/lag_frac/trajectories/over"] == 0.0
    assert hist[f"staleness/lag_frac/trajectories/{bound}"] > 0  # and it is reached
    assert all(v == 0 for k, v in hist.items() if k.rsplit("/", 1)[1] not in {"over", *map(str, range(bound + 1))})


def test_long_tails_can_exceed_the_bound_as_the_buffer_documents():
    r = simulate(config(max_staleness=1, total_steps=30), costs(tool=ToolLatency(0.3, 10.0)))
    assert r.lag_hist["staleness/lag_frac/trajectories/over"] > 0


def test_processor_sharing_matches_a_hand_computation():
    loop = EventLoop()
    engine = SimEngine(0, EngineCost(base_s=0.1, per_seq_s=0.1, request_s=0.0), loop)
    done: dict[str, float] = {}
    for name, tokens in (("a", 2), ("b", 4)):
        engine.submit(Request(tokens, 0.0, lambda v: None, lambda n=name: done.__setitem__(n, loop.now)))
    loop.run(lambda: len(done) == 2)
    # both decode at 0.3 s a token until a is done (2 tokens, 0.6 s); b then alone at 0.2 s a token
    assert done["a"] == pytest.approx(0.6) and done["b"] == pytest.approx(0.6 + 2 * 0.2)
    assert engine.busy_until_now() == pytest.approx(1.0)


@pytest.mark.parametrize("shared", [False, True])
def test_engines_on_shared_cores_take_turns_and_separate_ones_do_not(shared):
    loop = EventLoop()
    engines = [SimEngine(i, EngineCost(base_s=0.1, per_seq_s=0.1, request_s=0.0), loop) for i in range(2)]
    if shared:
        cores = SharedCores()
        for engine in engines:
            cores.add(engine)
    done: dict[str, float] = {}
    for engine, name, tokens in ((engines[0], "a", 2), (engines[1], "b", 4)):
        engine.submit(Request(tokens, 0.0, lambda v: None, lambda n=name: done.__setitem__(n, loop.now)))
    loop.run(lambda: len(done) == 2)
    if shared:  # a step of either lasts 0.2 + 0.2 while both decode; b alone after a's 2 tokens
        assert done["a"] == pytest.approx(0.8) and done["b"] == pytest.approx(0.8 + 2 * 0.2)
    else:  # each at 0.2 s a token on its own accelerator
        assert done["a"] == pytest.approx(0.4) and done["b"] == pytest.approx(0.8)


def test_a_pause_stops_decoding_for_its_length():
    loop = EventLoop()
    engine = SimEngine(0, EngineCost(base_s=0.1, per_seq_s=0.0), loop)
    done: list[float] = []
    engine.submit(Request(10, 0.0, lambda v: None, lambda: done.append(loop.now)))
    loop.after(0.5, engine.pause)
    loop.after(0.8, engine.resume, 1)
    loop.run(lambda: bool(done))
    assert done[0] == pytest.approx(1.0 + 0.3) and engine.paused_s == pytest.approx(0.3)


def test_tool_latency_parses_and_draws_its_median_and_p99():
    import numpy as np

    tool = ToolLatency.parse("p50=2s,p99=60s")
    draws = tool.draw(np.random.default_rng(0), 200_000)
    assert np.median(draws) == pytest.approx(2.0, rel=0.02)
    assert np.quantile(draws, 0.99) == pytest.approx(60.0, rel=0.05)
    assert ToolLatency.parse("p50=500ms,p99=1s,max=2s") == ToolLatency(0.5, 1.0, 2.0)
    assert np.mean(draws) == pytest.approx(tool.mean_s, rel=0.03)
    cut = ToolLatency(2.0, 60.0, max_s=10.0)
    assert np.mean(cut.draw(np.random.default_rng(1), 200_000)) == pytest.approx(cut.mean_s, rel=0.01)
    assert cut.mean_s < tool.mean_s
    with pytest.raises(ValueError):
        ToolLatency.parse("p50=2s")


def test_costs_round_trip_through_json():
    c = replace(costs(), source={"from": "test"})
    assert Costs.from_json(c.to_json()) == c


@pytest.mark.parametrize("share_cores", [True, False], ids=["shared-cores", "own-accelerators"])
def test_the_learner_is_slowed_only_while_engines_decode(share_cores):
    """A learner step of 1 s of work, slowed by 1 + 0.5 x the engines' load. Two engines each get one
    request of 70 tokens: for its first 0.02 s (`request_s`) nothing decodes and the learner runs at
    full speed; then both decode one sequence each (load of a batch of 2) until they finish (engines
    on shared cores take turns: twice as long), and the learner runs at full speed again after: the
    slow-down follows the engines' batch through the step."""
    c = costs()
    c = replace(c, learner=replace(c.learner, base_s=1.0, shared_frac=0.5))
    pipe = SimPipeline(config(num_engines=2, engines_share_cores=share_cores), c)
    for engine in pipe.engines:
        engine.submit(Request(70, 10.0, lambda v: None, lambda: None))
    pipe._train(0)
    pipe.loop.run(lambda: pipe.learner_step >= 1)
    slow = 1 + 0.5 * c.engine.load(2)
    decode_s = 70 * c.engine.step_s(1, 10.0) * (2 if share_cores else 1)
    assert 1 < slow < 1.5  # two sequences are a light load, not a full one
    assert pipe.loop.now == pytest.approx(0.02 + decode_s + (1.0 - 0.02 - decode_s / slow))
    assert pipe.engine_load() == 0


@pytest.mark.parametrize("share_cores", [True, False], ids=["shared-cores", "own-accelerators"])
def test_a_second_engine_process_on_the_cores_slows_the_learner_while_both_decode(share_cores):
    """A learner step of 1 s of work, no load term, 0.5 per engine process decoding beside the first:
    while the two engines decode one request each (on shared cores), the learner runs at 1 / 1.5; on
    their own accelerators engines do not slow it at all."""
    c = costs()
    c = replace(c, learner=replace(c.learner, base_s=1.0, shared_frac=0.0, process_frac=0.5))
    pipe = SimPipeline(config(num_engines=2, engines_share_cores=share_cores), c)
    for engine in pipe.engines:
        engine.submit(Request(70, 10.0, lambda v: None, lambda: None))
    pipe._train(0)
    pipe.loop.run(lambda: pipe.learner_step >= 1)
    if share_cores:
        decode_s = 70 * c.engine.step_s(1, 10.0) * 2  # the two take turns
        assert pipe.loop.now == pytest.approx(0.02 + decode_s + (1.0 - 0.02 - decode_s / 1.5))
    else:
        assert pipe.loop.now == pytest.approx(1.0)
    assert pipe.extra_engine_processes() == 0


def test_the_engine_load_grows_with_the_batch_to_the_full_machine():
    e = EngineCost(base_s=0.005, per_seq_s=0.0005)
    loads = [e.load(b) for b in (0, 1, 2, 10, 100, 10_000)]
    assert loads[0] == 0 and loads == sorted(loads) and 0.99 < loads[-1] < 1
    assert loads[2] == pytest.approx(0.001 / 0.006)
    assert EngineCost(base_s=0.005, per_seq_s=0.0).load(3) == 1.0  # no per-sequence term: any decoding loads fully
