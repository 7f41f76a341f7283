"""A gateway session: one run of a user program's conversation, recorded as one trajectory.

Owns the token record of a session (the `AgentData` of its trajectory: `prompt_ids`, then observation
tokens with mask 0 and sampled tokens with mask 1, their behaviour log-probs and per-token policy
versions) and the session's `GatewayState` (journal of answered calls, forked segments, the sampled
choices of the last call, counters), kept in `AgentData.gateway` so that it travels with every
snapshot and partial row.

How a call is placed on the record (`Session._place`):
- the first call renders its messages with the model's chat template: that is `prompt_ids`;
- a later call whose messages are the session's conversation so far plus the assistant message it was
  answered with (compared by `protocol.canonical_message`), plus new messages, *extends* the record:
  only the new messages are templated (behind a fixed dummy exchange, `ObservationEncoder`), never the
  whole conversation again, and appended with mask 0;
- otherwise, a call whose full rendering starts with the record's token ids exactly also extends it
  (the suffix is appended with mask 0);
- otherwise the agent rewrote its history: the session *forks*, the current record is kept as a
  finished-with segment (`GatewayState.segments`, counted in `num_forks`) and a new record starts from
  this call's rendering. Nothing is ever silently re-tokenized.
The model always samples from the record itself, so what is trained is exactly what was sampled.

With `n > 1` every choice is kept until the next call shows which one the agent continued with; that
one joins the record, the others are counted (`num_unused_choices`). At the end (or when the next call
continues none of them) choice 0 joins.

Generation is interruptible the way the agent loops' is (`AgentLoopBase.generate_turn`): while the
worker's cancel Event is set (a weight sync) no request is sent; a request in flight when it is set is
aborted, its streamed tokens kept, and once the Event clears the generation continues from prompt +
tokens so far with the budget left. The HTTP call only takes longer; later tokens carry the new policy
version.

Exactly-once answers: every answered call is journaled (`JournalEntry`, keyed by a hash of session,
attempt, path and request body) and, with `durable_journal`, made durable through `AgentContext.snapshot`
before its response leaves. A retry of the same call (same key) gets the journaled answer and samples
nothing. After a crash the trajectory resumes from its last durable snapshot with a new attempt; the
restarted program's calls that match a journaled call of an earlier attempt by body are answered from
the journal (replay), so a deterministic program reaches the point where it died without sampling
again. A snapshot that fails fails the session: no answer is sent that is not durable.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from streamrl.core.faults import ahit
from streamrl.rollout.engine.base import SamplingParams
from streamrl.rollout.gateway import protocol
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.protocol import ChatCall, Choice, GatewayError, ToolCallOut
from streamrl.rollout.types import AgentData

logger = logging.getLogger(__name__)

PARK_POLL_S = 0.005  # how often a parked generation looks whether the sync is over


class Segment(BaseModel):
    """A token record the session forked away from (the agent rewrote its history)."""

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_mask: list[int] = Field(default_factory=list)
    behavior_logprobs: list[float] = Field(default_factory=list)
    policy_versions: list[int] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)


class Branch(BaseModel):
    """One sampled choice of the last call, not yet on the record."""

    message: dict[str, Any]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class JournalEntry(BaseModel):
    key: str  # sha256 of session, attempt, path, body (without the stream flags)
    body_sha: str  # sha256 of path and body only: matches the same call made by a later attempt
    attempt: int
    api: str
    response: dict[str, Any]  # the non-streamed response object; a stream is rendered from it


class GatewayState(BaseModel):
    session_id: str
    attempt: int = 0  # the attempt of the program run the session serves now
    sample_messages: list[dict[str, Any]] = Field(default_factory=list)  # the dataset prompt, for the program
    tools_sha: str | None = None  # the tools the current record was rendered with
    branches: list[Branch] = Field(default_factory=list)
    journal: list[JournalEntry] = Field(default_factory=list)
    segments: list[Segment] = Field(default_factory=list)
    num_calls: int = 0  # calls that sampled
    num_forks: int = 0
    num_retries_answered: int = 0  # calls answered from the journal by key
    num_replayed: int = 0  # calls of a restarted program answered from an earlier attempt's journal
    num_unused_choices: int = 0
    num_interrupts: int = 0  # generations aborted by a weight sync and continued
    num_restarts: int = 0  # program runs after the first (a resume in another attempt)
    length_exceeded: bool = False  # a call was refused for the context budget


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

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def attempt(self) -> int:
        return self.state.attempt

    def save(self) -> None:
        """Write the state into the AgentData (before every snapshot and at the end)."""
        self.data.gateway = self.state.model_dump(mode="json")

    # ---- answering ----------------------------------------------------------------------------

    def lookup(self, key: str, body_sha: str) -> dict[str, Any] | None:
        """The journaled answer of this call, or of the same call made by an earlier attempt."""
        for entry in self.state.journal:
            if entry.key == key:
                self.state.num_retries_answered += 1
                self.stats.journal = "retry"
                return entry.response
        for entry in self.state.journal:
            if entry.body_sha == body_sha and entry.attempt < self.state.attempt:
                self.state.num_replayed += 1
                self.stats.journal = "replay"
                self.state.journal.append(entry.model_copy(update={"key": key, "attempt": self.state.attempt}))
                return entry.response
        return None

    async def complete(self, call: ChatCall, key: str, body_sha: str, stats: CallStats | None = None) -> dict[str, Any]:
        """Answer `call`: from the journal when it was answered before, else sample, journal (durably)
        and return the response object of the call's API. `stats` receives what answering it took."""
        async with self.lock:
            self.stats = stats if stats is not None else CallStats()
            if self.failed is not None:
                raise GatewayError(500, f"session failed: {self.failed!r}")
            answer = self.lookup(key, body_sha)
            if answer is not None:
                return answer
            before = (self.data.model_copy(deep=True), self.state.model_copy(deep=True))
            try:
                response = await self._answer(call, key, body_sha)
            except BaseException:
                if self.failed is None:  # the call left no trace: its retry is placed like a first try
                    self._restore(*before)
                raise
            await ahit("gateway.before_answer")  # a fresh answer only: a crash here is one call of progress
            return response

    def _restore(self, data: AgentData, state: GatewayState) -> None:
        """Put the record and the state back as they were before a call that failed (an engine
        error, a refused budget, a raise): without this its retry would find the record already
        extended by the call's own messages and fork. `length_exceeded` stays: the loop reads it."""
        length_exceeded = self.state.length_exceeded
        for name in AgentData.model_fields:
            setattr(self.data, name, getattr(data, name))
        for name in GatewayState.model_fields:
            setattr(self.state, name, getattr(state, name))
        self.state.length_exceeded = length_exceeded

    async def _answer(self, call: ChatCall, key: str, body_sha: str) -> dict[str, Any]:
        """Sample the call on the record, journal it and make the journal durable."""
        forks = self.state.num_forks
        prompt = self._place(call)
        self.stats.forked = self.state.num_forks > forks
        self.stats.sampled = True
        choices = await asyncio.gather(*(self._sample(call, prompt, i) for i in range(call.n)))
        await ahit("gateway.before_journal")
        if call.api == "anthropic":
            response = protocol.anthropic_message(f"msg_{key[:24]}", call.model, choices[0], len(prompt))
        else:
            response = protocol.openai_completion(
                f"chatcmpl-{key[:24]}", call.model, choices, len(prompt), logprobs=call.logprobs
            )
        self.state.branches = [
            Branch(message=c.message(), token_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions)
            for c in choices
        ]
        self.state.num_calls += 1
        self.state.journal.append(
            JournalEntry(key=key, body_sha=body_sha, attempt=self.state.attempt, api=call.api, response=response)
        )
        self.save()
        if self.cfg.durable_journal and self.ctx.snapshot is not None:
            try:
                await self.ctx.snapshot(self.data.model_copy(deep=True))
            except Exception as exc:  # not durable: this answer must never be sent
                self.failed = exc
                raise GatewayError(500, f"the session's journal could not be made durable: {exc!r}") from exc
        return response

    # ---- the token record ---------------------------------------------------------------------

    def _encode_prompt(self, call: ChatCall) -> list[int]:
        ids = self.ctx.encoder.encode_prompt(call.messages, call.tools)
        if len(ids) > self.ctx.cfg.prompt_length:
            self.state.length_exceeded = True
            raise protocol.bad_request(
                f"the prompt has {len(ids)} tokens; this session allows {self.ctx.cfg.prompt_length}",
                "messages",
                "context_length_exceeded",
            )
        return ids

    def _commit_branch(self, call: ChatCall | None) -> None:
        """Put the choice the agent continued with (or choice 0) on the record."""
        if not self.state.branches:
            return
        data, branches = self.data, self.state.branches
        chosen = branches[0]
        if call is not None:
            n = len(data.messages)
            head = [protocol.canonical_message(m) for m in call.messages[: n + 1]]
            for b in branches:
                if head == [protocol.canonical_message(m) for m in [*data.messages, b.message]]:
                    chosen = b
                    break
        data.append_sampled(chosen.token_ids, chosen.logprobs, chosen.versions)
        data.messages.append(chosen.message)
        data.num_assistant_turns += 1
        self.state.num_unused_choices += len(branches) - 1
        self.state.branches = []

    def _extension(self, call: ChatCall, tools_sha: str) -> list[int] | None:
        """Observation ids that take the record to this call's prompt, or None (a fork)."""
        data = self.data
        n = len(data.messages)
        same_history = len(call.messages) > n and [protocol.canonical_message(m) for m in call.messages[:n]] == [
            protocol.canonical_message(m) for m in data.messages
        ]
        if same_history and tools_sha == self.state.tools_sha:
            new = call.messages[n:]
            after_eos = bool(data.response_ids) and data.response_ids[-1] == self.ctx.tokenizer.eos_token_id
            return self.ctx.encoder.encode_new_messages(new, after_eos=after_eos)
        record = data.prompt_ids + data.response_ids
        full = self.ctx.encoder.encode_prompt(call.messages, call.tools)
        if len(full) > len(record) and full[: len(record)] == record:
            return full[len(record) :]
        return None

    def _place(self, call: ChatCall) -> list[int]:
        """Bring the record to this call's prompt (start, extend or fork); returns the prompt ids."""
        data, state = self.data, self.state
        tools_sha = _sha(call.tools)
        self._commit_branch(call)
        if data.prompt_ids:
            ids = self._extension(call, tools_sha)
            if ids is not None:
                if len(data.response_ids) + len(ids) >= self.ctx.cfg.response_length:
                    state.length_exceeded = True
                    raise protocol.bad_request(
                        f"the conversation would pass this session's budget of {self.ctx.cfg.response_length} "
                        "response tokens",
                        "messages",
                        "context_length_exceeded",
                    )
                data.append_observation(ids)
                data.num_user_turns += 1
                data.messages = list(call.messages)
                return data.prompt_ids + data.response_ids
            prompt_ids = self._encode_prompt(call)  # before anything changes: a refused fork keeps the record
            state.segments.append(
                Segment(
                    prompt_ids=data.prompt_ids,
                    response_ids=data.response_ids,
                    response_mask=data.response_mask,
                    behavior_logprobs=data.behavior_logprobs,
                    policy_versions=data.policy_versions,
                    messages=data.messages,
                )
            )
            state.num_forks += 1
            logger.info("gateway session %s forked (segment %d)", state.session_id, len(state.segments))
            data.response_ids, data.response_mask, data.behavior_logprobs, data.policy_versions = [], [], [], []
            data.num_assistant_turns = data.num_user_turns = 0
        else:
            prompt_ids = self._encode_prompt(call)
        data.prompt_ids = prompt_ids
        data.messages = list(call.messages)
        state.tools_sha = tools_sha
        return list(prompt_ids)

    def finish(self) -> None:
        """The program ended: the last call's choice 0 joins the record (unless continued already)."""
        self._commit_branch(None)
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

    async def _sample(self, call: ChatCall, prompt: list[int], index: int) -> Choice:
        budget = self.ctx.cfg.response_length - len(self.data.response_ids)
        max_tokens = min(call.max_tokens or self.ctx.cfg.max_tokens_per_turn, budget)
        if max_tokens <= 0:
            self.state.length_exceeded = True
            raise protocol.bad_request(
                "no response budget left in this session", "max_tokens", "context_length_exceeded"
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
            self.state.num_interrupts += 1
            self.stats.synced = True
            ctx.counters.num_interrupts += 1
            ctx.counters.num_reprefill_tokens += len(prompt) + len(tokens)
            if not ctx.cancel.is_set():  # aborted by the engine itself (paused without us): retry shortly
                await asyncio.sleep(PARK_POLL_S)
