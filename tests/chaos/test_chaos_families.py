"""The plumbing of the chaos bench's I/O-fault and hostile-callback families, without a real run:
the seeded fault plans, how segments get their STREAMRL_IO_FAULTS and overrides, how faults are
counted and a stop recognised as clear, the hostile fixtures through the real scoring and tool paths,
and the by-kind summary. `make chaos` / `python -m bench.chaos --families io,hostile` run them for real."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from bench import chaos, chaos_families, chaos_hostile, chaos_io, hostile
from streamrl.buffer.log import LogFailedError, SegmentWriter
from streamrl.core import iofaults


def test_io_segments_are_seeded_and_each_arms_one_hard_fault_of_every_kind():
    segments = chaos_io.io_segments(0)
    assert segments == chaos_io.io_segments(0) and segments != chaos_io.io_segments(1)
    kinds = []
    for spec in segments:
        plan = iofaults.parse(spec)
        assert len(plan.faults) == 1 and plan.kinds == (iofaults.FaultKind.SHORT,) and plan.rate > 0
        kinds += [f.kind.value for f in plan.faults.values()]
    assert set(kinds) == set(chaos_io.HARD_KINDS)


def _real_log_failure(tmp_path: Path) -> str:
    """The message the buffer prints when its log's first write fails (the real writer and plan)."""
    plan = iofaults.FaultPlan((iofaults.Fault(kind=iofaults.FaultKind.EIO, at=0, log="traj"),))
    writer = SegmentWriter(
        tmp_path, prefix="traj", schema=pa.schema([("x", pa.int64())]), segment_max_bytes=1 << 20, io=plan
    )
    with pytest.raises(LogFailedError) as failed:
        writer.open()
    writer.close()
    return f"streamrl.buffer.log.LogFailedError: {failed.value}"


def test_a_segment_stopped_by_an_io_fault_is_recognised_and_counted(tmp_path, monkeypatch):
    """run_scenario hands each segment its STREAMRL_IO_FAULTS (none to the clean resume), records how
    the faulted one stopped, and the family counts the buffer actor's log lines by kind."""
    failure = _real_log_failure(tmp_path)
    run_dir = tmp_path / "io-s0"
    calls = []

    def fake_segment(args, env, log, timeout_s, kill_after_s=None):
        calls.append((args, env.get(chaos.IO_FAULTS_ENV)))
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "run_info.json").touch()  # the run started (the next segment resumes it)
        if len(calls) == 1:
            (run_dir / "logs" / "BufferActor-1.log").write_text(
                "WARNING streamrl.core.iofaults: I/O fault injected: write call #0 on log traj: short\n"
                "WARNING streamrl.core.iofaults: I/O fault injected: write call #3 on log traj: torn\n"
            )
            log.write_text(f"Traceback ...\n{failure}\nRuntimeError: admission loop failed\n")
            return 1, 1.0, False
        return 0, 1.0, False

    monkeypatch.setattr(chaos, "_segment", fake_segment)
    spec = chaos_io.io_segments(0)[0]
    result = chaos.run_scenario("io", 0, [], tmp_path, io_faults=[spec])
    assert [io for _, io in calls] == [spec, None] and result.completed
    assert "trainer.total_steps=8" in calls[0][0] and calls[1][0] == ["--resume", str(run_dir)]
    first = result.segments[0]
    assert first["stopped_clearly"] and first["error"].startswith("streamrl.buffer.log.LogFailedError")
    counts = chaos_io.injected_faults(run_dir)
    assert counts == Counter({"short": 1, "torn": 1})
    summary = chaos_io.summarize_io(counts, result.segments)
    assert summary["io_faults_injected"] == 2 and summary["io_hard_faults"] == 1
    assert summary["io_segments_stopped_clearly"] == summary["io_segments_faulted"] == 1
    assert not chaos_io.stopped_clearly("RuntimeError: admission loop failed")


def test_the_hostile_scenario_names_its_reward_and_function_tool(tmp_path, monkeypatch):
    seen = []

    def fake_segment(args, env, log, timeout_s, kill_after_s=None):
        seen.append(args)
        log.touch()
        return 0, 1.0, False

    monkeypatch.setattr(chaos, "_segment", fake_segment)
    chaos.run_scenario("hostile", 0, [""], tmp_path, max_clean=0)
    (args,) = seen
    assert "rollout.agent.reward_fn=bench.hostile:mixed_reward" in args and "rollout.agent.tool_timeout_s=2" in args
    tool_config = next(a for a in args if a.startswith("rollout.agent.tool_config="))
    from streamrl.tools.config import load_tool_config

    registry = load_tool_config(tool_config.split("=", 1)[1])
    assert registry.names == ["calculator"]
    assert registry.schemas()[0]["function"]["parameters"]["required"] == ["expression"]


def _text_in_bucket(bucket: int, modulo: int) -> str:
    return next(t for t in (f"\\boxed{{{i}}}" for i in range(1000)) if hostile.bucket(t, modulo) == bucket)


@pytest.mark.parametrize("hostility", ["nan", "inf", "hang"])
def test_a_hostile_reward_fails_its_trajectory_on_the_real_scoring_path(hostility, monkeypatch):
    from streamrl.rollout.agent_loop.scoring import RewardError, call_reward_fn
    from streamrl.rollout.rewards import RewardInput, get_reward_fn

    monkeypatch.setattr(hostile, "HANG_S", 0.5)
    bucket = {v: k for k, v in hostile.REWARD_BUCKETS.items()}[hostility]
    text = _text_in_bucket(bucket, 10)
    inp = RewardInput(response_text=text, final_answer_text=text, ground_truth="1")
    fn = get_reward_fn("bench.hostile:mixed_reward")
    with pytest.raises(RewardError, match="did not return" if hostility == "hang" else f"is {hostility}"):
        asyncio.run(call_reward_fn(fn, inp, timeout_s=0.2))
    normal = _text_in_bucket(5, 10)
    assert (
        asyncio.run(
            call_reward_fn(
                fn, RewardInput(response_text=normal, final_answer_text=normal, ground_truth=normal[7:-1]), timeout_s=5
            )
        )
        == 1.0
    )


def test_the_hostile_calculator_prints_escapes_that_safe_text_shows(tmp_path):
    from streamrl.observability.safe_text import safe_text

    escapes = _text_in_bucket(1, 6).removeprefix("\\boxed{").removesuffix("}")
    assert hostile.TOOL_BUCKETS[hostile.bucket(escapes, 6)] == "escapes"
    out = hostile.calculator(escapes)
    assert out.startswith(hostile.ESCAPES) and out.endswith(escapes)
    shown = safe_text(out)
    assert "\x1b" not in shown and chaos_hostile._ESCAPED_MARKER in shown
    log = tmp_path / "w.log"
    log.write_text(shown + "\n" + out)
    assert chaos_hostile._escapes([log]) == (1, 1)  # the raw payload, and its escaped form


def test_the_all_fail_report_reads_the_real_stop_message():
    from streamrl.rollout.types import RolloutOutcomes
    from streamrl.streaming.failures import FailureWindow, TooManyFailedTrajectories

    window = FailureWindow(window=16, max_fraction=0.9)
    window.observe(
        RolloutOutcomes(
            worker_id="w", num_finished=0, num_failed=16, failure_reasons={"RewardError: the reward ... is nan": 16}
        )
    )
    assert window.tripped
    assert issubclass(TooManyFailedTrajectories, Exception)
    output = f"...\nstreamrl: error: {window.message(0)}\n"  # how `streamrl train` prints it
    report = chaos_hostile.all_fail_report(1, output)
    assert report["stopped_clearly"] and report["nan_rewards_failed"] == 16
    assert not chaos_hostile.all_fail_report(0, output)["stopped_clearly"]


def test_a_decompression_bomb_from_a_tool_is_refused_before_decoding(tmp_path):
    report = chaos_hostile.image_bomb_check(tmp_path)
    assert report["bombs"] == report["refused"] == 3 and report["images_stored"] == 0
    assert all("max_image_pixels" in r["text"] for r in report["results"].values()), report["results"]
    assert report["peak_rss_growth_mb"] < 100  # a decode would take 108 MB


def test_by_kind_sums_every_family_and_reads_the_fuzz_settings():
    fuzz = chaos_families.fuzz_cases()
    assert fuzz and all(n > 0 for n in fuzz.values())
    inv = {"prompts_lost": 0, "stranded": 0, "untracked": 0}
    data = {
        "results": [
            {
                "fault_counts": {"admit.after_append kill_job": 1, "worker.sink raise": 3, "buffer.append delay4": 2},
                "faults_injected": 7,
                "segments": [],
                "invariants": inv,
                "hangs": 0,
            },
            {"faults_injected": 2, "segments": [{"rc": -9}, {"rc": 0}], "invariants": inv, "hangs": 0},
        ],
        "fault_families": [
            {
                "results": [
                    {
                        "name": "io",
                        "io_faults_injected": 30,
                        "io_hard_faults": 5,
                        "io_short_writes": 25,
                        "invariants": inv,
                    },
                    {"name": "hostile", "hostile_callbacks": 12, "invariants": {**inv, "prompts_lost": 1}},
                    {"name": "image_bomb", "hostile_callbacks": 3},
                ]
            },
            {
                "results": [  # another seed's runs: summed too
                    {
                        "name": "io",
                        "io_faults_injected": 10,
                        "io_hard_faults": 4,
                        "io_short_writes": 6,
                        "invariants": inv,
                    },
                ]
            },
        ],
    }
    kinds = chaos_families.by_kind(data, {"num_states_checked": 2000, "num_crash_points_checked": 5}, fuzz)
    assert kinds["kills"] == 1 + 1 + 1  # a kill_job, a runner SIGKILL (7 - 6 fired), a SIGKILLed segment
    assert kinds["other_armed_faults"] == {"raise": 3, "delay": 2} and kinds["armed_faults_not_split_by_kind"] == 1
    assert kinds["io_faults"] == 40 and kinds["io_hard_faults"] == 9 and kinds["hostile_callbacks"] == 15
    assert kinds["power_loss_states_checked"] == 2000 and kinds["fuzz_cases"] == sum(fuzz.values())
    assert kinds["losses_and_violations"]["prompts_lost"] == 1  # a loss anywhere shows
    json.dumps(kinds)
