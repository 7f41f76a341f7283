"""The chaos suite's `gateway` scenario: a real `streamrl train` run whose every trajectory is an
OpenAI-SDK agent program talking to the rollout worker's gateway (`workloads/answer_ledger.py`), under
kills during calls, dropped client connections and retries.

The program makes three chained calls per sample; about a third of its calls are first sent with a
client timeout far below the generation time (the client drops the connection and retries the same
request), and about a third of its answered calls are sent again verbatim. Every answer a client
receives is appended to `RUN_DIR/answer_ledger.jsonl`. The scenario's segments arm the gateway's
fault points (`core/faults.py`) in the rollout worker:

- `gateway.before_answer`: the answer is journaled and durable but not yet sent. `kill_job` there kills
  the whole job (the resumed job re-runs the programs; their repeats must get the journaled answers);
  `kill_self` kills the rollout worker (the driver resubmits its trajectories in a new attempt);
  `raise` answers 500, which the SDK retries (the retry must get the journaled answer).
- `gateway.before_journal`: the call was sampled but its answer is not journaled. `raise` answers 500
  and must leave the session's record as it was (the retry is sampled afresh and does not fork);
  `kill_self` loses the answer with the worker (no client ever saw it).
- `admit.after_append=kill_job`: the whole job killed wherever its calls are when the driver admits a group.

The invariant checker (`streaming.invariants`) adds "calls answered differently": for each journal
key (session, attempt, request), and for each (session, request) across attempts, every answer given
to a client must be the same. It must be 0, with every other invariant.
"""

from __future__ import annotations

import json
from pathlib import Path

PROGRAM = "streamrl.workloads.answer_ledger:run"
NUM_PROMPTS = 48
GATEWAY_OVERRIDES = [
    f"rollout.agent.gateway.program={PROGRAM}",
    "rollout.agent.gateway.timeout_s=300",
    "rollout.agent.response_length=256",
]


def gateway_segments(n) -> list[str]:
    """The faulted segments; `n(lo, hi, salt)` draws a seeded pass number. A segment ends with a job
    kill at an armed point (a segment the runner killed by the clock could die in a loaded machine's
    start-up, before any call)."""
    return [
        # the whole job killed with an answer durable and unsent; every few samples a 500 before the journal
        f"gateway.before_answer=kill_job@{n(4, 10, 'ga')},gateway.before_journal=raise%{n(3, 6, 'gb')}",
        # every worker incarnation killed after sampling its k-th call (that answer lost, never sent);
        # every few answers a 500 after the journal; the job killed after a few more admissions
        f"gateway.before_journal=kill_self@{n(3, 8, 'gc')},gateway.before_answer=raise%{n(3, 6, 'gd')},"
        f"admit.after_append=kill_job@{n(3, 4, 'ge')}",
        # every worker incarnation killed with its k-th answer durable and unsent
        f"gateway.before_answer=kill_self@{n(4, 9, 'gf')},admit.after_append=kill_job@{n(3, 4, 'gg')}",
    ]


def gateway_files(root: Path, run_name: str) -> list[str]:
    """The run's prompts: the generated easy arithmetic problems, each row naming the `gateway` agent
    loop (a prompt row's `agent_name` picks the loop that runs it)."""
    from streamrl.rollout.data import make_arithmetic_dataset

    path = root / f"{run_name}.prompts.jsonl"
    with path.open("w") as f:
        for record in make_arithmetic_dataset(NUM_PROMPTS, 0, difficulty="easy"):
            row = {
                "id": record.group_id,
                "messages": record.messages,
                "ground_truth": record.ground_truth,
                "agent_name": "gateway",
            }
            f.write(json.dumps(row) + "\n")
    return [f"data.source={path}"]
