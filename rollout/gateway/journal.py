"""A gateway session's state and its append-only journal: one durable record per answered call.

`GatewayState` is what a session knows beyond its token record (`AgentData`): the journal of answered
calls (what retries and a restarted program are answered from), the sampled choices of the last call
not yet on the record, summaries of the records it forked away from, counters. It is written into
`AgentData.gateway` when the program ends; while the program runs it is never serialised whole.

Instead each answered call is one `CallRecord`, made durable as a `JournalRecord` (its payload) before
the response leaves (`Session._answer`): its journal entry (the response), where the call went on the
token record (`Placement`: which earlier choice the agent continued with, the observation ids appended
or the prompt a fork started from, the messages beyond those the record already had) and the choices it
sampled. A call costs the bytes of its own delta, whatever came before it.

`apply` is the one function that changes a session by a record: the live session applies each record
once it is durable, and a resumed trajectory folds the records of earlier attempts onto the row it
resumed from with the same function (`fold`), so the recovered record, journal and pending choices are
exactly those the crashed attempt had: a re-run program gets byte-identical answers.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, Field

from streamrl.rollout.gateway import protocol
from streamrl.rollout.types import AgentData, JournalRecord

logger = logging.getLogger(__name__)


class Segment(BaseModel):
    """A token record the session forked away from (the agent rewrote its history). Only its size is
    kept: training takes the session's last record, and the budget counts the tokens of all of them."""

    num_prompt_tokens: int = 0
    num_response_tokens: int = 0  # sampled and observation tokens: what the response budget counts
    num_sampled_tokens: int = 0
    num_messages: int = 0


class Branch(BaseModel):
    """One sampled choice of the last call, not yet on the record."""

    message: dict[str, Any]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class ResponseLink(BaseModel):
    """A stored Responses-API answer's place in its conversation (`responses.py`): the conversation of
    response `previous` (None: nothing), then `messages`, then this answer's output. `previous` is the one
    the call named (`previous_response_id`) or, for a call that sent its whole conversation again, the
    last stored response it begins with, so a record holds only the call's new input, never the history."""

    previous: str | None = None
    messages: list[dict[str, Any]]  # OpenAI chat format; the call's instructions are not part of it


class JournalEntry(BaseModel):
    key: str  # sha256 of session, attempt, path, body (without the stream flags)
    body_sha: str  # sha256 of path and body only: matches the same call made by a later attempt
    attempt: int
    api: str
    response: dict[str, Any]  # the non-streamed response object; a stream is rendered from it
    link: ResponseLink | None = None  # a Responses-API answer kept for `previous_response_id` (`store`)


class Placement(BaseModel):
    """Where a call went on the token record. First the previous call's choice the agent continued
    with joins the record (`chosen`, None when no choice was pending); then either the record is
    extended by `ids` (observation tokens, mask 0) or a new record starts from prompt `ids` (the first
    call, or a fork). The record's messages become its first `keep_messages` ones plus `messages`."""

    kind: Literal["start", "extend", "fork"]
    chosen: int | None = None
    ids: list[int]  # "extend": [num_observation_tokens]; "start" / "fork": [num_prompt_tokens]
    keep_messages: int = 0
    messages: list[dict[str, Any]]
    tools_sha: str | None = None  # the tools the record is rendered with (after this call)


class CallRecord(BaseModel):
    """One answered call as the journal holds it (the payload of its `JournalRecord`)."""

    entry: JournalEntry
    placement: Placement
    branches: list[Branch]  # the call's sampled choices, [n]
    num_interrupts: int = 0  # generations of the call a weight sync aborted and continued


class GatewayState(BaseModel):
    session_id: str
    attempt: int = 0  # the attempt of the program run the session serves now
    sample_messages: list[dict[str, Any]] = Field(default_factory=list)  # the dataset prompt, for the program
    tools_sha: str | None = None  # the tools the current record was rendered with
    branches: list[Branch] = Field(default_factory=list)
    journal: list[JournalEntry] = Field(default_factory=list)
    segments: list[Segment] = Field(default_factory=list)
    num_records: int = 0  # journal records applied: the seq of the next one
    num_calls: int = 0  # calls that sampled
    num_forks: int = 0
    num_retries_answered: int = 0  # calls answered from the journal by key
    num_replayed: int = 0  # calls of a restarted program answered from an earlier attempt's journal
    num_unused_choices: int = 0
    num_interrupts: int = 0  # generations aborted by a weight sync and continued
    num_restarts: int = 0  # program runs after the first (a resume in another attempt)
    length_exceeded: bool = False  # a call was refused for the context budget

    @property
    def num_forked_response_tokens(self) -> int:
        """Response tokens of the records forked away from: they count against the session's budget."""
        return sum(s.num_response_tokens for s in self.segments)


def commit_branch(data: AgentData, state: GatewayState, chosen: int | None) -> None:
    """Put choice `chosen` of the last call on the record (None: choice 0, when the program ended)."""
    if not state.branches:
        return
    branch = state.branches[chosen or 0]
    data.append_sampled(branch.token_ids, branch.logprobs, branch.versions)
    data.messages.append(branch.message)
    data.num_assistant_turns += 1
    data.num_tool_calls += len(branch.message.get("tool_calls", ()))  # the model's calls; the program runs them
    state.num_unused_choices += len(state.branches) - 1
    state.branches = []


def apply(data: AgentData, state: GatewayState, record: CallRecord) -> None:
    """Change the session by one answered call (live, once its record is durable; or in `fold`)."""
    p = record.placement
    assert (p.chosen is None) == (not state.branches), "a record placed against other pending choices"
    commit_branch(data, state, p.chosen)
    if p.kind == "extend":
        data.append_observation(p.ids)
        data.num_user_turns += 1
        del data.messages[p.keep_messages :]
        data.messages.extend(p.messages)
    else:
        if p.kind == "fork":
            state.segments.append(
                Segment(
                    num_prompt_tokens=len(data.prompt_ids),
                    num_response_tokens=len(data.response_ids),
                    num_sampled_tokens=sum(data.response_mask),
                    num_messages=len(data.messages),
                )
            )
            state.num_forks += 1
            data.response_ids, data.response_mask, data.behavior_logprobs, data.policy_versions = [], [], [], []
            data.num_assistant_turns = data.num_user_turns = data.num_tool_calls = 0
        data.prompt_ids = list(p.ids)
        data.messages = list(p.messages)
    state.tools_sha = p.tools_sha
    state.branches = list(record.branches)
    state.journal.append(record.entry)
    state.num_calls += 1
    state.num_interrupts += record.num_interrupts
    state.num_records += 1


def to_journal_record(data: AgentData, state: GatewayState, record: CallRecord) -> JournalRecord:
    """The durable form of the session's next record."""
    return JournalRecord(
        trajectory_id=data.trajectory_id, attempt=state.attempt, seq=state.num_records, payload=record.model_dump_json()
    )


def fold(data: AgentData, state: GatewayState, records: list[JournalRecord]) -> int:
    """Apply the records the session's state does not hold yet (`seq >= num_records`), in order; returns
    how many were applied. A gap in the sequence is a bug of the writer or the store."""
    applied = 0
    for r in sorted(records, key=lambda r: r.seq):
        if r.seq < state.num_records:
            continue
        assert r.seq == state.num_records, f"journal of {data.trajectory_id}: record {r.seq} after {state.num_records}"
        apply(data, state, CallRecord.model_validate_json(r.payload))
        applied += 1
    if applied:
        logger.info("gateway session %s: %d answered calls recovered from its journal", state.session_id, applied)
    return applied


def common_prefix(canonical: list[tuple], messages: list[dict[str, Any]]) -> int:
    """How many leading `messages` equal the record's (given in `protocol.canonical_message` form)."""
    n = 0
    for have, m in zip(canonical, messages):
        if have != protocol.canonical_message(m):
            break
        n += 1
    return n
