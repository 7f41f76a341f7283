"""The gateway under faults, on the FakeEngine: a call that fails before its answer is journaled leaves
the session's record as it was (its retry does not fork), a call that fails after is answered from the
journal by the SDK's retry, and the recording client of the chaos scenario
(`workloads/answer_ledger.py`) with the checker that reads its ledger: drops and repeats all get one
answer per call, and a gateway that samples a repeat again is caught."""

from __future__ import annotations

import itertools
import json

import pytest

from streamrl.core import faults
from streamrl.rollout.gateway.session import Session
from streamrl.streaming.invariants import InvariantReport, _check_answers
from streamrl.workloads import answer_ledger
from tests.rollout.test_agent_loop import ANSWER

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "What is 12 times 7?"}]


@pytest.fixture
def arm(monkeypatch, tmp_path):
    def arm(spec: str) -> None:
        monkeypatch.setenv(faults.LEDGER_ENV, str(tmp_path / "faults"))
        monkeypatch.setattr(faults, "_armed", faults._parse(spec))
        monkeypatch.setattr(faults, "_hits", {})

    return arm


async def test_a_call_failing_before_its_journal_leaves_the_record_and_its_retry_does_not_fork(make_gateway, arm):
    gw = await make_gateway(["The answer is 84.", "Yes, I am sure."])
    client = gw.openai(max_retries=2)
    first = await client.chat.completions.create(model="p", messages=USER)
    record = (list(gw.data.prompt_ids), list(gw.data.response_ids))
    arm("gateway.before_journal=raise@1")  # the next call is sampled, then answers 500; the SDK retries
    more = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    out = await client.chat.completions.create(model="p", messages=more)
    assert faults._hits["gateway.before_journal"] == 2  # the failed try and the retry both sampled
    assert out.choices[0].message.content == "Yes, I am sure."
    state = gw.session.state
    assert state.num_forks == 0 and state.num_calls == 2 and len(state.journal) == 2
    assert len(gw.engine.requests_seen) == 3
    gw.session.finish()
    data = gw.data
    assert data.prompt_ids == record[0] and data.response_ids[: len(record[1])] == record[1]
    # the second turn's observation is on the record once, then the second answer
    assert data.response_mask.count(0) == len(data.response_ids) - sum(data.response_mask)
    obs = [t for t, m in zip(data.response_ids, data.response_mask) if not m]
    assert obs == gw.ctx.encoder.encode_new_messages(more[2:], after_eos=True)


async def test_a_call_failing_after_its_journal_is_answered_from_it_on_the_retry(make_gateway, arm):
    gw = await make_gateway([ANSWER])
    arm("gateway.before_answer=raise@1")
    out = await gw.openai(max_retries=2).chat.completions.create(model="p", messages=USER)
    assert out.choices[0].message.content == ANSWER
    assert len(gw.engine.requests_seen) == 1 and gw.session.state.num_retries_answered == 1


async def _run_recording_client(gw, ledger, monkeypatch) -> list[dict]:
    monkeypatch.setenv(faults.ANSWER_LEDGER_ENV, str(ledger))
    monkeypatch.setattr(answer_ledger, "DROP_P", 1.0)  # every call's first try is dropped by the client
    monkeypatch.setattr(answer_ledger, "DROP_TIMEOUT_S", (0.05, 0.05))
    monkeypatch.setattr(answer_ledger, "REPEAT_P", 1.0)  # and every answered call is sent again
    sample = {"trajectory_id": gw.data.trajectory_id, "messages": USER}
    await answer_ledger.run(gw.base_url, gw.api_key, sample)
    return answer_ledger.read_answers(ledger)


def _varying_script(tokenizer):
    """Every generation is a new text (a re-sample is visible), each ending the turn."""
    counter = itertools.count()
    return lambda prompt_ids: tokenizer.encode(f"Sample {next(counter)}: \\boxed{{84}}.") + [tokenizer.eos_token_id]


async def test_the_recording_client_gets_one_answer_per_call_through_drops_and_repeats(
    make_gateway, tiny_tokenizer, tmp_path, monkeypatch
):
    gw = await make_gateway(script=_varying_script(tiny_tokenizer), token_delay_s=0.02)  # ~0.2 s a call
    lines = await _run_recording_client(gw, tmp_path / "answers.jsonl", monkeypatch)
    report = answer_ledger.answer_report(lines)
    assert report["calls_dropped"] == answer_ledger.NUM_CALLS and report["calls_errored"] == 0
    assert report["calls_answered"] == answer_ledger.NUM_CALLS
    assert report["answers_delivered"] == 2 * answer_ledger.NUM_CALLS  # the retry after the drop, the repeat
    assert report["answered_differently"] == 0 and report["problems"] == []
    assert len(gw.engine.requests_seen) == answer_ledger.NUM_CALLS and gw.session.state.num_forks == 0


async def test_the_checker_catches_a_gateway_that_samples_a_repeated_call_again(
    make_gateway, tiny_tokenizer, tmp_path, monkeypatch
):
    gw = await make_gateway(script=_varying_script(tiny_tokenizer))
    monkeypatch.setattr(Session, "lookup", lambda self, key, body_sha: None)  # no journal: at-least-once
    ledger = tmp_path / "answers.jsonl"
    await _run_recording_client(gw, ledger, monkeypatch)
    report = InvariantReport(run_dir=str(tmp_path))
    _check_answers(report, ledger)
    assert report.gateway_answered_differently == answer_ledger.NUM_CALLS and not report.ok
    assert len(report.problems) == answer_ledger.NUM_CALLS


def test_answers_are_compared_per_journal_key_and_across_attempts(tmp_path):
    def line(attempt, call, answer, kind="answer"):
        return {"kind": kind, "session": "s", "attempt": attempt, "call": call, "answer": answer, "pid": 10 + attempt}

    same = [line(0, "c1", "a"), line(0, "c1", "a"), line(0, "c2", None, "drop"), line(1, "c1", "a")]
    report = answer_ledger.answer_report(same)
    assert report["answered_differently"] == report["answered_differently_across_attempts"] == 0
    assert report["sessions_in_several_attempts"] == report["calls_answered_in_several_attempts"] == 1
    assert report["calls_answered_after_a_crash"] == 1
    assert report["calls_dropped"] == 1 and report["answers_repeated"] == 1
    resampled = answer_ledger.answer_report([*same, line(2, "c1", "b")])  # a restarted program got a new sample
    assert resampled["answered_differently"] == 0 and resampled["answered_differently_across_attempts"] == 1
    ledger = tmp_path / "answer_ledger.jsonl"
    ledger.write_text("".join(json.dumps(x) + "\n" for x in [*same, line(0, "c1", "z")]))
    report = InvariantReport(run_dir=str(tmp_path))
    _check_answers(report, ledger)
    assert report.gateway_answered_differently == 1 and report.problems and not report.ok
