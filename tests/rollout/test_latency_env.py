"""The benchmark's slow environment: long-tailed latencies and per-trajectory episode lengths."""

from __future__ import annotations

import statistics

import pytest

from streamrl.workloads.interactions.latency_env import LatencyEnvironment


def test_lognormal_latency_has_the_configured_median_and_tail():
    env = LatencyEnvironment({"latency_s": 0.5, "distribution": "lognormal", "p99_over_median": 10.0, "seed": 3})
    draws = sorted(env.draw_latency() for _ in range(20_000))
    median, p99 = statistics.median(draws), draws[int(0.99 * len(draws))]
    assert 0.47 < median < 0.53
    assert 8.5 < p99 / median < 11.5  # the tail: a few calls take ten times the usual
    assert min(draws) > 0


def test_uniform_latency_stays_within_the_jitter():
    env = LatencyEnvironment({"latency_s": 1.0, "jitter_s": 0.2, "seed": 1})
    draws = [env.draw_latency() for _ in range(1000)]
    assert all(0.8 <= d <= 1.2 for d in draws) and max(draws) - min(draws) > 0.3


async def test_each_trajectory_keeps_its_own_number_of_replies_across_a_restore():
    config = {"latency_s": 0.0, "num_turns": 4, "min_turns": 1, "seed": 7}
    env = LatencyEnvironment(config)
    turns = {f"traj-{i}": env.turns_of(f"traj-{i}") for i in range(200)}
    assert set(turns.values()) == {1, 2, 3, 4}  # lengths differ a lot
    assert LatencyEnvironment(config).turns_of("traj-5") == turns["traj-5"]  # another process agrees

    for trajectory, expected in list(turns.items())[:20]:
        await env.start_interaction(trajectory)
        replies, done = 0, False
        while not done:
            done, _, _, _ = await env.generate_response(trajectory, [])
            replies += 1
            if replies == 1 and not done:  # the process dies: a fresh one restores from the messages
                env2 = LatencyEnvironment(config)
                messages = [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "obs 1"},
                ]
                await env2.restore(trajectory, messages)
                env = env2
        assert replies == expected


def test_min_turns_above_num_turns_is_refused():
    with pytest.raises(ValueError, match="min_turns"):
        LatencyEnvironment({"num_turns": 2, "min_turns": 3})
