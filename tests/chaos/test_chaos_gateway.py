"""The plumbing of the chaos bench's `gateway` scenario without a real run: its seeded segments arm
real fault points, every segment gets the answer ledger's path and the first the gateway program and
its prompts (rows naming the `gateway` loop), a segment that died before its run existed is followed
by a fresh start, and `--merge` replaces only the results of the scenario and seeds it ran. `make
chaos` runs it for real; tests/rollout/gateway/ hold the behaviour on the FakeEngine, the real engine
and real Ray actors."""

from __future__ import annotations

import json

from bench import chaos, chaos_gateway, chaos_results
from streamrl.core import faults
from streamrl.rollout.data.loaders import load_prompts


def test_the_gateway_segments_are_seeded_and_arm_real_points():
    segments = chaos.scenarios(0)["gateway"]
    assert segments == chaos.scenarios(0)["gateway"] and segments != chaos.scenarios(1)["gateway"]
    points = set()
    for spec in segments:
        armed = faults._parse(spec)  # raises on an unknown point or action
        points |= set(armed)
        assert any(action == "kill_job" for action, _, _ in armed.values()), spec  # each segment ends
    assert {"gateway.before_answer", "gateway.before_journal"} <= points


def test_the_gateway_scenario_gives_its_segments_the_program_prompts_and_ledger(tmp_path, monkeypatch):
    run_dir = tmp_path / "gateway-s0"
    calls = []

    def fake_segment(args, env, log, timeout_s, kill_after_s=None):
        calls.append((args, env))
        log.touch()
        if len(calls) == 1:  # Ray's node missed its start-up limit: the same segment runs again
            log.write_text(f"Exception: {chaos.RAY_STARTUP_FAILED}. This could happen because ...\n")
            return 1, 1.0, False
        if len(calls) == 2:  # died in start-up before the run existed (another way): a fresh start
            return 1, 1.0, False
        run_dir.mkdir(exist_ok=True)
        (run_dir / "run_info.json").touch()
        return (0 if len(calls) == 4 else -9), 1.0, False

    monkeypatch.setattr(chaos, "_segment", fake_segment)
    plan = chaos.scenarios(0)["gateway"]
    result = chaos.run_scenario("gateway", 0, plan, tmp_path)
    assert result.completed and len(calls) == 4
    (first, env0), (again, env1), (second, _), (third, env3) = calls
    assert f"rollout.agent.gateway.program={chaos_gateway.PROGRAM}" in first and first == again == second
    assert env0[faults.ENV] == env1[faults.ENV] == plan[0]  # the retry after Ray's start-up had the same faults
    assert [s.get("ray_startup_failed", False) for s in result.segments] == [True, False, False, False]
    assert [s["faults"] for s in result.segments] == [plan[0], plan[0], plan[1], plan[2]]
    assert third == ["--resume", str(run_dir)]
    assert env0[faults.ANSWER_LEDGER_ENV] == env3[faults.ANSWER_LEDGER_ENV] == str(run_dir / "answer_ledger.jsonl")
    source = next(a for a in first if a.startswith("data.source=")).split("=", 1)[1]
    records = load_prompts(source)
    assert len(records) == chaos_gateway.NUM_PROMPTS and {r.agent_name for r in records} == {"gateway"}


def test_merge_replaces_only_the_scenarios_run(tmp_path):
    out = tmp_path / "chaos.json"
    old = [
        {"name": "tools", "seed": 0, "faults_injected": 3, "hangs": 0, "completed": True},
        {"name": "gateway", "seed": 0, "faults_injected": 1, "hangs": 1, "completed": False},
        {"name": "gateway", "seed": 1, "faults_injected": 2, "hangs": 0, "completed": True},
    ]
    old = [{**r, "segments": [], "fault_counts": {}, "invariants": {}} for r in old]
    out.write_text(json.dumps({"command": "python -m bench.chaos --seeds 2", "results": old}))
    fresh = chaos.ScenarioResult(name="gateway", seed=0, faults_injected=5, completed=True)
    fresh.invariants = {"gateway_answered_differently": 0, "gateway_answers": {"answers_delivered": 7}}
    assert chaos_results.merge(out, [fresh], "python -m bench.chaos --scenarios gateway --merge", 1.0) == 0
    data = json.loads(out.read_text())
    assert [(r["name"], r["seed"], r["faults_injected"]) for r in data["results"]] == [
        ("tools", 0, 3),
        ("gateway", 1, 2),
        ("gateway", 0, 5),
    ]
    assert data["command"] == "python -m bench.chaos --seeds 2" and data["merged"][0]["scenarios"] == ["gateway"]
    assert data["summary"]["faults_injected"] == 10 and data["summary"]["hangs"] == 0
    assert data["summary"]["gateway_answers_delivered"] == 7 and "by_kind" in data
