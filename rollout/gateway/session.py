"""A gateway session: one run of a user program's conversation, recorded as one trajectory.

Owns the token record of a session (the `AgentData` of its trajectory: `prompt_ids`, then observation
tokens with mask 0 and sampled tokens with mask 1, their behaviour log-probs and per-token policy
versions) and the session's `GatewayState` (journal of answered calls, forked segments, the sampled
choices of the last call, counters; `journal.py`), written into `AgentData.gateway` when the program
ends.

How a call is placed on the record (`Session._place`):
- the first call renders its messages with the model's chat template: that is `prompt_ids`;
- a later call whose messages are the session's conversation so far plus the assistant message it was
  answered with (compared by `protocol.canonical_message`), plus new messages, *extends* the record:
  only the new messages are templated (behind a fixed dummy exchange, `ObservationEncoder`), never the
  whole conversation again, and appended with mask 0;
- otherwise, a call whose full rendering starts with the record's token ids exactly also extends it
  (the suffix is appended with mask 0);
- otherwise the agent rewrote its history: the session *forks*, the current record is left behind
  (its size summarised in `GatewayState.segments`, counted in `num_forks`) and a new record starts from
  this call's rendering. Nothing is ever silently re-tokenized.
The model always samples from the record itself, so what is trained is exactly what was sampled. The
response budget (`response_length`) is the session's, not a record's: the response tokens of the
records it forked away from count against it, so rewriting history never buys more sampling.

With `n > 1` every choice is kept until the next call shows which one the agent continued with; that
one joins the record, the others are counted (`num_unused_choices`). At the end (or when the next call
continues none of them) choice 0 joins.

A Responses-API call (`responses.py`) is answered the same way once the session has resolved its
conversation: its `previous_response_id` names a response the session stored (`journal.ResponseLink` on
that answer's journal entry), whose input and output come before the call's own input.

Generation is interruptible the way the agent loops' is (`AgentLoopBase.generate_turn`): while the
worker's cancel Event is set (a weight sync) no request is sent; a request in flight when it is set is
aborted, its streamed tokens kept, and once the Event clears the generation continues from prompt +
tokens so far with the budget left. The HTTP call only takes longer; later tokens carry the new policy
version.

Exactly-once answers: every answered call is journaled (`JournalEntry`, keyed by a hash of session,
attempt, path and request body) and, with `durable_journal`, its record (`journal.CallRecord`: the
answer and the call's delta of the token record, never the whole session) is appended durably through
`AgentContext.append_journal` before its response leaves; only then does the session change. A retry
of the same call (same key) gets the journaled answer and samples nothing. After a crash the trajectory
resumes in a new attempt from its last row, with the journal's records folded on top (`recover`); the
restarted program's calls that match a journaled call of an earlier attempt by body are answered from
the journal (replay), so a deterministic program reaches the point where it died without sampling
again. An append that fails fails the session: no answer is sent that is not durable.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from streamrl.core.faults import ahit
from streamrl.engines.base import SamplingParams
from streamrl.rollout.gateway import journal, protocol, responses
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.journal import Branch, CallRecord, GatewayState, JournalEntry, Placement
from streamrl.rollout.gateway.protocol import ChatCall, Choice, GatewayError, ToolCallOut
from streamrl.rollout.types import AgentData

logger = logging.getLogger(__name__)

PARK_POLL_S = 0.005  # how often a parked generation looks whether the sync is over
# How a session's budget errors begin: OpenAI's own wording for a context overflow, which clients
# (litellm, and through it mini-swe-agent) recognise and stop on instead of retrying the call.
CONTEXT_EXCEEDED = "This model's maximum context length is"


def session_id_for(trajectory_id: str) -> str:
    """URL-safe and stable across attempts: a resumed trajectory keeps its session id."""
    return hashlib.sha256(trajectory_id.encode()).hexdigest()[:24]


def call_key(session_id: str, attempt: int, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """(idempotency key, attempt-free body hash) of a request."""
    canon = json.dumps(protocol.key_fields(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    body_sha = hashlib.sha256(f"{path}\0{canon}".encode()).hexdigest()
    key = hashlib.sha256(f"{session_id}\0{attempt}\0{body_sha}".encode()).hexdigest()
    return key, body_sha


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


@dataclass
class CallStats:
    """What answering one call took (filled by `Session.complete`, summed by the server's counters)."""

    sampled: bool = False  # answered by sampling (not from the journal)
    journal: str | None = None  # "retry": this attempt's journal answered it; "replay": an earlier attempt's
    forked: bool = False  # the call rewrote the history: the session forked
    synced: bool = False  # a weight sync parked or interrupted its generation
    num_interrupts: int = 0  # generations of the call a weight sync aborted and continued
    engine_s: float = 0.0  # seconds with a generation of the call in the engine or parked for a sync

    _active: int = 0  # generations of the call running now (n > 1 runs them side by side)
    _since: float = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.engine_s += time.perf_counter() - self._since


class SessionFailed(RuntimeError):
    """The session cannot answer any more (its journal could not be made durable)."""


class Session:
    """The live side of one session: `complete` answers a call, one at a time per session."""

    def __init__(self, ctx: Any, data: AgentData, cfg: GatewayConfig, *, honor_sampling: bool = False) -> None:
        self.ctx = ctx
        self.data = data
        self.cfg = cfg
        self.honor_sampling = honor_sampling
        if data.gateway is None:
            self.state = GatewayState(session_id=session_id_for(data.trajectory_id), attempt=data.attempt)
        else:
            self.state = GatewayState.model_validate(data.gateway)
        # The session's own bearer token (`GatewayServer.authorize`): random per program run and never
        # saved, so no other sample's program can compute it and a resumed session gets a new one.
        self.token = secrets.token_urlsafe(32)
        self.lock = asyncio.Lock()
        self.failed: BaseException | None = None
        self.stats = CallStats()  # of the call being answered (calls of one session answer one at a time)
        self._by_key: dict[str, JournalEntry] = {}  # this attempt's answers (retries)
        self._by_body: dict[str, JournalEntry] = {}  # earlier attempts' answers (replays)
        self._canonical: list[tuple] = []  # the record's messages as `protocol.canonical_message`s
        self._stored: dict[str, JournalEntry] = {}  # stored Responses answers by id, the latest last
        self._reindex()

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def attempt(self) -> int:
        return self.state.attempt

    def save(self) -> None:
        """Write the state into the AgentData (when the program ended: the trajectory's final row)."""
        self.data.gateway = self.state.model_dump(mode="json")

    async def recover(self) -> int:
        """Serve the trajectory's current attempt: fold the journal records earlier attempts made
        durable onto the row it resumed from (`journal.fold`), so their calls are answered again from
        the journal. Returns how many records were folded."""
        self.state.attempt = self.data.attempt
        records = []
        if self.data.attempt > 0 and self.ctx.read_journal is not None:
            records = await self.ctx.read_journal(self.data.trajectory_id)
        applied = journal.fold(self.data, self.state, records)
        self._reindex()
        return applied

    def _reindex(self) -> None:
        self._by_key = {e.key: e for e in reversed(self.state.journal)}
        self._by_body = {e.body_sha: e for e in reversed(self.state.journal) if e.attempt < self.state.attempt}
        self._canonical = [protocol.canonical_message(m) for m in self.data.messages]
        self._stored = {}
        for entry in self.state.journal:
            self._store(entry)

    def _store(self, entry: JournalEntry) -> None:
        """Keep a Responses answer stored with `store` for `previous_response_id` (latest last)."""
        if entry.link is not None:
            self._stored.pop(entry.response["id"], None)
            self._stored[entry.response["id"]] = entry

    def stored_response(self, response_id: str) -> dict[str, Any] | None:
        """A stored Responses answer by its id (`GET /v1/responses/{id}`)."""
        entry = self._stored.get(response_id)
        return None if entry is None else entry.response

    # ---- answering ----------------------------------------------------------------------------

    def lookup(self, key: str, body_sha: str) -> dict[str, Any] | None:
        """The journaled answer of this call, or of the same call made by an earlier attempt."""
        entry = self._by_key.get(key)
        if entry is not None:
            self.state.num_retries_answered += 1
            self.stats.journal = "retry"
            return entry.response
        entry = self._by_body.get(body_sha)
        if entry is not None:
            self.state.num_replayed += 1
            self.stats.journal = "replay"
            again = entry.model_copy(update={"key": key, "attempt": self.state.attempt})
            self.state.journal.append(again)  # its retries are answered by key (it is durable as `entry`)
            self._by_key[key] = again
            self._store(again)
            return entry.response
        return None

    async def complete(self, call: ChatCall, key: str, body_sha: str, stats: CallStats | None = None) -> dict[str, Any]:
        """Answer `call`: from the journal when it was answered before, else sample, journal (durably)
        and return the response object of the call's API. `stats` receives what answering it took.
        Nothing of the session changes until the call's record is durable, so a call that fails (an
        engine error, a refused budget, a raise) leaves no trace and its retry is placed like a first
        try (only `length_exceeded` stays: the loop reads it)."""
        async with self.lock:
            self.stats = stats if stats is not None else CallStats()
            if self.failed is not None:
                raise GatewayError(500, f"session failed: {self.failed!r}")
            answer = self.lookup(key, body_sha)
            if answer is not None:
                return answer
            if call.responses is not None:  # a Responses call: its conversation from the stored responses
                call = replace(call, messages=responses.conversation(self._stored, call.responses))
            response = await self._answer(call, key, body_sha)
            await ahit("gateway.before_answer")  # a fresh answer only: a crash here is one call of progress
            return response

    async def _answer(self, call: ChatCall, key: str, body_sha: str) -> dict[str, Any]:
        """Sample the call on the record, make its journal record durable, then apply it."""
        placement, prompt, budget = self._place(call)
        self.stats.forked = placement.kind == "fork"
        self.stats.sampled = True
        choices = await asyncio.gather(*(self._sample(call, prompt, budget, i) for i in range(call.n)))
        await ahit("gateway.before_journal")
        link = None
        if call.api == "anthropic":
            response = protocol.anthropic_message(f"msg_{key[:24]}", call.model, choices[0], len(prompt))
        elif call.responses is not None:
            response = responses.response_object(f"resp_{key[:24]}", call, choices[0], len(prompt))
            link = responses.link(self._stored, call.responses)
        else:
            response = protocol.openai_completion(
                f"chatcmpl-{key[:24]}", call.model, choices, len(prompt), logprobs=call.logprobs
            )
        entry = JournalEntry(
            key=key, body_sha=body_sha, attempt=self.state.attempt, api=call.api, response=response, link=link
        )
        record = CallRecord(
            entry=entry,
            placement=placement,
            branches=[
                Branch(message=c.message(), token_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions)
                for c in choices
            ],
            num_interrupts=self.stats.num_interrupts,
        )
        await self._make_durable(record)
        self._apply(record)
        return response

    async def _make_durable(self, record: CallRecord) -> None:
        """Append the call's record to the trajectory's journal (`AgentContext.append_journal`). One
        that fails, or is cancelled with its fate unknown, fails the session: no answer is sent that
        is not durable, and no later record may follow one that might be missing."""
        if not self.cfg.durable_journal or self.ctx.append_journal is None:
            return
        try:
            await self.ctx.append_journal(journal.to_journal_record(self.data, self.state, record))
        except BaseException as exc:
            self.failed = exc
            if not isinstance(exc, Exception):
                raise
            raise GatewayError(500, f"the session's journal could not be made durable: {exc!r}") from exc

    def _apply(self, record: CallRecord) -> None:
        """`journal.apply`, keeping the canonical messages and the answers by key in step."""
        p = record.placement
        if p.chosen is not None:
            self._canonical.append(protocol.canonical_message(self.state.branches[p.chosen].message))
        journal.apply(self.data, self.state, record)
        if p.kind == "extend":
            del self._canonical[p.keep_messages :]
            self._canonical.extend(protocol.canonical_message(m) for m in p.messages)
        else:
            self._canonical = [protocol.canonical_message(m) for m in self.data.messages]
        self._by_key[record.entry.key] = record.entry
        self._store(record.entry)

    # ---- the token record ---------------------------------------------------------------------

    def _encode_prompt(self, call: ChatCall) -> list[int]:
        ids = self.ctx.encoder.encode_prompt(call.messages, call.tools)
        if len(ids) > self.ctx.cfg.prompt_length:
            self.state.length_exceeded = True
            raise protocol.bad_request(
                f"{CONTEXT_EXCEEDED} {self.ctx.cfg.prompt_length} prompt tokens in this session; "
                f"the prompt has {len(ids)}",
                "messages",
                "context_length_exceeded",
            )
        return ids

    def _chosen(self, call: ChatCall) -> int | None:
        """The pending choice the agent continued with (the one its messages repeat), else 0; None
        when no choice is pending."""
        branches = self.state.branches
        if not branches:
            return None
        n = len(self._canonical)
        if len(call.messages) > n and journal.common_prefix(self._canonical, call.messages[:n]) == n:
            sent = protocol.canonical_message(call.messages[n])
            for i, b in enumerate(branches):
                if protocol.canonical_message(b.message) == sent:
                    return i
        return 0

    def _num_response_tokens(self) -> int:
        """Response tokens the session holds so far, across every record it forked away from."""
        return self.state.num_forked_response_tokens + len(self.data.response_ids)

    def _place(self, call: ChatCall) -> tuple[Placement, list[int], int]:
        """Where this call goes on the record (start, extend or fork; see the module doc), without
        changing anything: (placement, the prompt ids to sample after, response tokens left)."""
        data, state = self.data, self.state
        tools_sha = _sha(call.tools)
        limit = self.ctx.cfg.response_length
        if not data.prompt_ids:
            ids = self._encode_prompt(call)
            placement = Placement(kind="start", ids=ids, messages=list(call.messages), tools_sha=tools_sha)
            return placement, list(ids), limit - self._num_response_tokens()
        chosen = self._chosen(call)
        branch = state.branches[chosen] if chosen is not None else None
        tail = branch.token_ids if branch is not None else []
        canonical = [*self._canonical, protocol.canonical_message(branch.message)] if branch else self._canonical
        keep = journal.common_prefix(canonical, call.messages)
        used = self._num_response_tokens() + len(tail)
        ids = self._extension(call, tools_sha, tail, len(canonical) if keep == len(canonical) else None)
        if ids is not None:
            if used + len(ids) >= limit:
                state.length_exceeded = True
                raise protocol.bad_request(
                    f"{CONTEXT_EXCEEDED} reached: the conversation would pass this session's budget of "
                    f"{limit} response tokens",
                    "messages",
                    "context_length_exceeded",
                )
            placement = Placement(
                kind="extend",
                chosen=chosen,
                ids=ids,
                keep_messages=keep,
                messages=list(call.messages[keep:]),
                tools_sha=state.tools_sha,
            )
            return placement, data.prompt_ids + data.response_ids + tail + ids, limit - used - len(ids)
        prompt_ids = self._encode_prompt(call)  # a refused fork changes nothing
        logger.info("gateway session %s forks (segment %d)", state.session_id, len(state.segments) + 1)
        placement = Placement(
            kind="fork", chosen=chosen, ids=prompt_ids, messages=list(call.messages), tools_sha=tools_sha
        )
        return placement, list(prompt_ids), limit - used

    def _extension(self, call: ChatCall, tools_sha: str, tail: list[int], history: int | None) -> list[int] | None:
        """Observation ids that take the record (plus `tail`, the choice joining it) to this call's
        prompt, or None (a fork). `history`: the record's number of messages (its answer joining it
        included) when the call begins with all of them, else None."""
        data = self.data
        if history is not None and len(call.messages) > history and tools_sha == self.state.tools_sha:
            new = call.messages[history:]
            last = tail[-1:] or data.response_ids[-1:]
            after_eos = bool(last) and last[0] == self.ctx.tokenizer.eos_token_id
            return self.ctx.encoder.encode_new_messages(new, after_eos=after_eos)
        record = data.prompt_ids + data.response_ids + tail
        full = self.ctx.encoder.encode_prompt(call.messages, call.tools)
        if len(full) > len(record) and full[: len(record)] == record:
            return full[len(record) :]
        return None

    def finish(self) -> None:
        """The program ended: the last call's choice 0 joins the record (unless continued already)."""
        journal.commit_branch(self.data, self.state, None)
        self.save()

    # ---- sampling -----------------------------------------------------------------------------

    def _sampling(self, call: ChatCall, max_tokens: int, index: int) -> SamplingParams:
        s = self.ctx.cfg.sampling
        temperature, top_p, top_k = s.temperature, s.top_p, s.top_k
        if self.honor_sampling:
            temperature = s.temperature if call.temperature is None else call.temperature
            top_p = s.top_p if call.top_p is None else call.top_p
            top_k = s.top_k if call.top_k is None else call.top_k
        seed = s.seed if call.seed is None else call.seed
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=None if seed is None else seed + index,
            stop_token_ids=self.ctx.stop_token_ids,
            stop=list(call.stop),
        )

    async def _sample(self, call: ChatCall, prompt: list[int], budget: int, index: int) -> Choice:
        max_tokens = min(call.max_tokens or self.ctx.cfg.max_tokens_per_turn, budget)
        if max_tokens <= 0:
            self.state.length_exceeded = True
            raise protocol.bad_request(
                f"{CONTEXT_EXCEEDED} reached: no response budget left in this session",
                "max_tokens",
                "context_length_exceeded",
            )
        tokens, logprobs, versions, finish = await self.generate(
            prompt, lambda n: self._sampling(call, n, index), max_tokens
        )
        tok = self.ctx.tokenizer
        text = tok.decode(tokens, skip_special_tokens=True)
        content, calls = text, []
        parser = self.ctx.parser
        if call.tools and call.tool_choice != "none" and parser is not None:
            parsed = parser.parse(text)
            if parsed.tool_calls and not parsed.num_errors:  # a malformed call is answered as plain text
                content = parsed.content
                prefix = "toolu_" if call.api == "anthropic" else "call_"
                calls = [
                    ToolCallOut(call_id=f"{prefix}{self._call_id(index, j)}", name=c.name, arguments=c.arguments)
                    for j, c in enumerate(parsed.tool_calls)
                ]
        choice = Choice(
            content=content,
            tool_calls=calls,
            finish="length" if finish == "length" else "stop",
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            token_texts=[tok.decode([t]) for t in tokens] if call.logprobs else [],
        )
        return choice

    def _call_id(self, index: int, j: int) -> str:
        seed = f"{self.state.session_id}/{self.state.attempt}/{self.state.num_calls}/{index}/{j}"
        return hashlib.sha256(seed.encode()).hexdigest()[:24]

    async def generate(
        self, prompt: list[int], sampling: Any, max_tokens: int
    ) -> tuple[list[int], list[float], list[int], str]:
        """Sample up to `max_tokens` after `prompt` through the worker's engines, parking in place
        while the cancel Event is set (see the module doc). `sampling(n)` builds the params for n tokens."""
        self.stats.enter()
        try:
            return await self._generate(prompt, sampling, max_tokens)
        finally:
            self.stats.leave()

    async def _generate(
        self, prompt: list[int], sampling: Any, max_tokens: int
    ) -> tuple[list[int], list[float], list[int], str]:
        ctx = self.ctx
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            while ctx.cancel.is_set():  # a weight sync is under way: send nothing until it is over
                self.stats.synced = True
                await asyncio.sleep(PARK_POLL_S)
            left = max_tokens - len(tokens)
            if left <= 0:
                return tokens, logprobs, versions, "length"
            request_id = f"{self.data.trajectory_id}-gw-{uuid.uuid4().hex[:8]}"
            ctx.num_in_engine += 1
            gen = asyncio.ensure_future(
                ctx.server.generate(self.data.trajectory_id, request_id, prompt + tokens, sampling(left))
            )
            cancel = asyncio.ensure_future(ctx.cancel.wait())
            try:
                done, _ = await asyncio.wait({gen, cancel}, return_when=asyncio.FIRST_COMPLETED)
                if gen not in done:
                    await ctx.server.abort(request_id)
                output, engine_id = await gen
            finally:
                ctx.num_in_engine -= 1
                cancel.cancel()
                if not gen.done():
                    gen.cancel()
            self.data.engine_id = engine_id
            tokens.extend(output.token_ids)
            logprobs.extend(output.logprobs)
            versions.extend(output.policy_versions)
            ctx.counters.num_generated_tokens += len(output.token_ids)
            if not output.aborted:
                return tokens, logprobs, versions, output.finish_reason
            self.stats.num_interrupts += 1
            self.stats.synced = True
            ctx.counters.num_interrupts += 1
            ctx.counters.num_reprefill_tokens += len(prompt) + len(tokens)
            if not ctx.cancel.is_set():  # aborted by the engine itself (paused without us): retry shortly
                await asyncio.sleep(PARK_POLL_S)
