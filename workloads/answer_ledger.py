"""A gateway agent that records every answer it receives: the client side of exactly-once answers.

`run` is an ordinary OpenAI-SDK program for the `gateway` agent loop (`rollout.agent.gateway.program =
"streamrl.workloads.answer_ledger:run"`): a few chat calls, each continuing the conversation with the
answer it got. Like a real client on a bad network it drops some calls (a client-side timeout far
below the generation time, after which it retries the same request), and repeats some answered calls
verbatim. Every answer it is given, and every dropped or failed call, is one line appended (one
`write`, never interleaved) to the ledger named by `STREAMRL_ANSWER_LEDGER`:

    {"kind": "answer" | "drop" | "error", "session", "attempt", "call", "answer", "how", "pid"}

`call` hashes the request it sent, so (session, attempt, call) is the gateway's journal key and
(session, call) the same call made again by a restarted program in a later attempt. The program is
deterministic given its answers (its requests depend only on the sample and on what it was told), so a
program re-run after a crash repeats its journaled calls in order.

`answer_report` reads the ledger back: a call answered twice with different samples is a broken
exactly-once promise (`streaming.invariants` counts it; it must be 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from streamrl.core.faults import ANSWER_LEDGER_ENV

NUM_CALLS = 3
MAX_TOKENS = 48
DROP_P = 0.35  # a call's first try times out on the client (a dropped connection), then it retries
DROP_TIMEOUT_S = (0.05, 0.6)
REPEAT_P = 0.3  # an answered call sent again, verbatim (an impatient or buggy client)
CALL_TIMEOUT_S = 300.0  # an answered call: generous, a weight sync or a worker restart may park it
FOLLOW_UP = "Check that step by step and give the final answer in \\boxed{}."


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _session_of(base_url: str) -> tuple[str, int]:
    """(session, attempt) from `.../s/{session}/{attempt}/v1`."""
    parts = base_url.rstrip("/").split("/")
    return parts[-3], int(parts[-2])


def record(line: dict[str, Any], path: str | None = None) -> None:
    path = path or os.environ.get(ANSWER_LEDGER_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({**line, "pid": os.getpid()}, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def _create(client: Any, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)


async def _call(client: Any, messages: list[dict[str, Any]], rng: random.Random, where: dict[str, Any]) -> Any:
    """One call as an unreliable client makes it: maybe a first try dropped by its own timeout, then
    the request again with the SDK's retries (500 and 503 are retried by the SDK itself)."""
    import openai

    if rng.random() < DROP_P:
        try:
            out = await _create(client.with_options(timeout=rng.uniform(*DROP_TIMEOUT_S), max_retries=0), messages)
            record({**where, "kind": "answer", "answer": _sha(out.model_dump()), "how": "before_drop"})
            return out
        except openai.APITimeoutError:
            record({**where, "kind": "drop"})
    try:
        out = await _create(client, messages)
    except Exception as exc:
        record({**where, "kind": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})
        raise
    record({**where, "kind": "answer", "answer": _sha(out.model_dump()), "how": "call"})
    return out


async def run(base_url: str, api_key: str, sample: dict[str, Any]) -> None:
    """The recording agent: NUM_CALLS calls, each continuing the last; the run's reward function
    scores the final conversation (returns None)."""
    import openai

    session, attempt = _session_of(base_url)
    rng = random.Random(f"{sample['trajectory_id']}/{attempt}")  # drops and repeats vary per attempt
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=CALL_TIMEOUT_S, max_retries=6)
    messages = list(sample["messages"])
    for _ in range(NUM_CALLS):
        request = {"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS}  # what `_create` sends
        where = {"session": session, "attempt": attempt, "call": _sha(request)}
        out = await _call(client, messages, rng, where)
        if rng.random() < REPEAT_P:
            again = await _create(client, messages)
            record({**where, "kind": "answer", "answer": _sha(again.model_dump()), "how": "repeat"})
        reply = out.choices[0].message.model_dump(exclude_none=True)
        messages = [*messages, reply, {"role": "user", "content": FOLLOW_UP}]


def read_answers(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answer_report(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over a ledger. `answered_differently`: journal keys (session, attempt, request) whose
    clients were given more than one distinct answer; `answered_differently_across_attempts`: the
    same over (session, request), a restarted program's repeat of a call answered in an earlier
    attempt included. Both must be 0."""
    by_key: dict[tuple, set[str]] = defaultdict(set)
    by_call: dict[tuple, set[str]] = defaultdict(set)
    attempts: dict[str, set[int]] = defaultdict(set)
    call_attempts: dict[tuple, set[int]] = defaultdict(set)
    call_pids: dict[tuple, set[int]] = defaultdict(set)
    answers = [x for x in lines if x["kind"] == "answer"]
    for x in answers:
        by_key[(x["session"], x["attempt"], x["call"])].add(x["answer"])
        by_call[(x["session"], x["call"])].add(x["answer"])
        attempts[x["session"]].add(x["attempt"])
        call_attempts[(x["session"], x["call"])].add(x["attempt"])
        call_pids[(x["session"], x["call"])].add(x["pid"])
    bad = sorted(k for k, v in by_key.items() if len(v) > 1)
    return {
        "answers_delivered": len(answers),
        "calls_answered": len(by_key),
        "answers_repeated": len(answers) - len(by_key),  # retries and repeats that got an answer
        "calls_dropped": sum(x["kind"] == "drop" for x in lines),
        "calls_errored": sum(x["kind"] == "error" for x in lines),
        "sessions": len(attempts),
        "sessions_in_several_attempts": sum(len(a) > 1 for a in attempts.values()),
        "calls_answered_in_several_attempts": sum(len(a) > 1 for a in call_attempts.values()),
        # a call answered in two processes: a program re-run after its worker or job died got it again
        "calls_answered_after_a_crash": sum(len(p) > 1 for p in call_pids.values()),
        "answered_differently": len(bad),
        "answered_differently_across_attempts": sum(len(v) > 1 for v in by_call.values()),
        "problems": [f"call {k[2][:12]} of session {k[0]} attempt {k[1]}: {len(by_key[k])} answers" for k in bad],
    }
