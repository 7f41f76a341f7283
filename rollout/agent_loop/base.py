"""Agent loop base: the registry, the shared context, and the interruptible generation step.

An agent loop turns one `AgentData` into one `Trajectory`. `run` either finishes the trajectory or,
when the worker's cancel `asyncio.Event` is set (a weight sync is pausing the engines), *parks* it:
the engine request is aborted, every token already streamed is kept in `AgentData`, and a `partial`
trajectory carrying the JSON snapshot is returned. Resuming is simply `run(AgentData)` again, in this
process or another one: a loop in GENERATING re-prefills prompt + response so far and continues the
same assistant turn with the remaining budget; new tokens carry the engine's new policy_version.

Images (docs/multimodal.md): with a VLM policy (`AgentContext.processor` set) a prompt's image parts
are admitted into the worker's `ImageStore` and rendered to expanded ids (`image_prompt.py`); images
in tool / interaction responses are admitted as they arrive (`image_observation.py`) and appended to
`AgentData.images` with their observation's ids (`append_observation`). Every generate, a resumed one
included, sends all the trajectory's images with its ids. Bytes a resuming worker does not hold are
fetched by hash (`AgentContext.fetch_images`, the buffer's image log).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl.core import trace
from streamrl.core.registry import Registry
from streamrl.engines.base import GenerationOutput, SamplingParams
from streamrl.rollout.agent_loop.image_prompt import (
    admit_images,
    encode_image_prompt,
    expand_images,
    has_image_parts,
    image_part_refs,
    template_messages,
)
from streamrl.rollout.agent_loop.observation import ObservationEncoder
from streamrl.rollout.agent_loop.scoring import call_reward_fn, finite, reward_input
from streamrl.rollout.config import AgentConfig
from streamrl.rollout.types import (
    AgentData,
    AgentState,
    FinishReason,
    JournalRecord,
    Trajectory,
    TrajectoryStatus,
)

if TYPE_CHECKING:
    from streamrl.engines.base import ImageInput
    from streamrl.rollout.images import ImageStore

logger = logging.getLogger(__name__)

LOOPS: Registry[type[AgentLoopBase]] = Registry("agent loop")


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    def wrap(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        LOOPS.register(name)(cls)
        cls.name = name
        return cls

    return wrap


def get_agent_loop_cls(name: str) -> type[AgentLoopBase]:
    return LOOPS.get(name)


@dataclass(kw_only=True)
class LoopCounters:
    """Per-worker counters the loops increment; read by the worker for `rollout/*` metrics."""

    num_interrupts: int = 0
    num_parse_errors: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_tool_calls_interrupted: int = 0  # in doubt after a resume, not idempotent: answered, not re-run
    num_generated_tokens: int = 0
    num_reprefill_tokens: int = 0  # prompt tokens re-sent to an engine after an interrupt or a progress cut
    num_progress_rows: int = 0  # partial rows made durable because `progress_every_s` had passed
    num_progress_cuts: int = 0  # generations cut for such a row (the turn went on with a new request)


@dataclass(kw_only=True)
class AgentContext:
    """What every agent loop of one worker shares. `cancel` set = park at the next chance.

    `snapshot`, when set, makes a trajectory durable mid-turn: the tool loop awaits it with a copy of
    the AgentData (PROCESSING_TOOLS, the turn's calls journaled as intents) before a turn with a call
    to a non-idempotent tool runs, and it must return only once that state is durable (a partial row
    flushed to the buffer's log); raising fails the trajectory before the tool runs. It is what makes
    "a tool's side effect happens at most once" hold across worker death and job restart; without
    it, that holds within one process only.

    `append_journal`, when set, makes one `JournalRecord` of a running trajectory durable (the
    gateway's answered call, before its response leaves), returning only once it is: a step that
    costs its own bytes, not a whole partial row. `read_journal(trajectory_id)` returns the records a
    resumed trajectory folds onto the row it resumed from (`buffer/journal.py`).

    `processor` (the policy's `AutoProcessor`) is set for a VLM policy only; image prompts need it and
    `images`, the worker's store of image bytes by hash. `fetch_images(sha256s) -> [bytes]` (same
    order) fills the store with images it lacks, e.g. when a parked trajectory resumes in a worker
    that never saw them (the buffer's `get_images`); None = a missing image is an error.
    `max_images` is the most images one trajectory may hold (the engines' `max_images_per_prompt`:
    every generate sends them all); a tool / interaction response past it becomes an error
    observation. None = not known here: the engine then refuses the over-full request (failed row)."""

    cfg: AgentConfig
    server: Any  # rollout.server_manager.ServerManager
    tokenizer: Any
    encoder: ObservationEncoder
    tools: Any = None  # tools.executor.ToolRegistry | None
    parser: Any = None  # rollout.parsers.base.ToolParser | None
    interactions: dict[str, Any] = field(default_factory=dict)
    reward_fn: Callable[[Any], float] | None = None
    snapshot: Callable[[AgentData], Awaitable[None]] | None = None
    append_journal: Callable[[JournalRecord], Awaitable[None]] | None = None
    read_journal: Callable[[str], Awaitable[list[JournalRecord]]] | None = None
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    counters: LoopCounters = field(default_factory=LoopCounters)
    num_in_engine: int = 0  # loops with an engine request in flight (pause waits for 0)
    processor: Any = None  # transformers AutoProcessor of a VLM policy; None = text-only model
    images: ImageStore | None = None
    fetch_images: Callable[[list[str]], Awaitable[list[bytes]]] | None = None
    max_images: int | None = None
    gateway: Any = None  # rollout.gateway.server.GatewayServer of this worker, made by its first gateway loop

    @property
    def image_token_id(self) -> int | None:
        """The model's image placeholder token (None for a text-only model)."""
        return None if self.processor is None else self.processor.image_token_id

    @property
    def response_images(self) -> ImageStore | None:
        """Where tool / interaction images go: the store for a VLM policy, None for a text one."""
        return None if self.processor is None else self.images

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]


class Parked(Exception):
    """Raised inside a loop when it must park; `run` turns it into a partial trajectory."""


class AgentLoopBase(abc.ABC):
    name: str = "base"

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        # the trajectory's newest durable state: when, and how many response tokens it held (`make_durable`)
        self.durable_at, self.durable_tokens = time.monotonic(), 0

    async def run(self, data: AgentData) -> Trajectory:
        """Drive `data` to TERMINATED, or park it (partial row) when the cancel event is set."""
        if not data.created_at:
            data.created_at = time.time()
        # it starts from a durable row: its admission's PENDING row, or the partial row it resumes from
        self.durable_at, self.durable_tokens = time.monotonic(), len(data.response_ids)
        try:
            await self._run(data)
        except Parked:
            data.num_interrupts += 1
            self.ctx.counters.num_interrupts += 1
            return data.to_trajectory(TrajectoryStatus.PARTIAL, image_token_id=self.ctx.image_token_id)
        data.check_aligned(image_token_id=self.ctx.image_token_id)
        return data.to_trajectory(TrajectoryStatus.FINISHED, image_token_id=self.ctx.image_token_id)

    @abc.abstractmethod
    async def _run(self, data: AgentData) -> None:
        """Advance the state machine until TERMINATED (raise Parked to park)."""

    # ---- shared steps -------------------------------------------------------------------------

    async def encode_prompt(self, data: AgentData, tools: list[dict] | None) -> list[int]:
        """Prompt ids of `data.messages`; an image chat is admitted first (see `image_prompt.py`):
        its messages then hold `image_ref` parts and `data.images` its refs in placeholder order."""
        if not has_image_parts(data.messages):
            return self.ctx.encoder.encode_prompt(data.messages, tools)
        if self.ctx.processor is None or self.ctx.images is None:
            raise ValueError(
                f"trajectory {data.trajectory_id} has an image prompt but the policy is not a VLM "
                "(no processor / image store: set rollout.engine.max_images_per_prompt > 0)"
            )
        await self._ensure_images(image_part_refs(data.messages))
        messages, refs = admit_images(data.messages, self.ctx.images)
        if self.ctx.max_images is not None and len(refs) > self.ctx.max_images:
            raise ValueError(f"prompt of {data.trajectory_id} has {len(refs)} images; max_images={self.ctx.max_images}")
        ids = encode_image_prompt(
            self.ctx.encoder, self.ctx.processor, messages, [self.ctx.images.get(r.sha256) for r in refs], tools
        )
        data.messages, data.images = messages, refs
        return ids

    async def _ensure_images(self, sha256s: list[str]) -> None:
        """Fetch the images the worker's store lacks (a resume in another worker) by hash."""
        store = self.ctx.images
        if store is None:
            raise ValueError(f"{len(sha256s)} images to send but the worker has no image store")
        missing = list(dict.fromkeys(sha for sha in sha256s if sha not in store))
        if not missing:
            return
        if self.ctx.fetch_images is None:
            raise KeyError(f"images {missing} are not in the worker's store and it has no image source")
        blobs = await self.ctx.fetch_images(missing)
        for sha, blob in zip(missing, blobs, strict=True):
            if store.put(blob).sha256 != sha:
                raise ValueError(f"image fetched for {sha} has another hash")

    async def image_inputs(self, data: AgentData) -> list[ImageInput]:
        """The engine's image inputs of `data` (its images in placeholder order), bytes by hash."""
        await self._ensure_images([r.sha256 for r in data.images])
        assert self.ctx.images is not None
        return self.ctx.images.inputs(data.images)

    def remaining_budget(self, data: AgentData) -> int:
        """Tokens this turn may still sample: min(per-turn budget left, response budget left)."""
        used_in_turn = len(data.response_ids) - data.turn_start
        turn_left = self.ctx.cfg.max_tokens_per_turn - used_in_turn
        total_left = self.ctx.cfg.response_length - len(data.response_ids)
        return max(min(turn_left, total_left), 0)

    async def make_durable(self, data: AgentData) -> None:
        """Make the trajectory's current state durable: a partial row appended and fsynced through
        the context's snapshot hook (the caller checks there is one)."""
        assert self.ctx.snapshot is not None
        await self.ctx.snapshot(data.model_copy(deep=True))
        self.durable_at, self.durable_tokens = time.monotonic(), len(data.response_ids)

    def progress_due_in(self, data: AgentData) -> float | None:
        """Seconds until the trajectory's progress is due to be made durable (`progress_every_s`);
        None when progress rows are off or there is nowhere to write them."""
        every = self.ctx.cfg.progress_every_s
        if every is None or self.ctx.snapshot is None:
            return None
        return self.durable_at + every - time.monotonic()

    async def save_progress_if_due(self, data: AgentData) -> None:
        """A partial row before the next generation when `progress_every_s` has passed since the last
        durable one and the trajectory has grown since (tool results, finished turns)."""
        due = self.progress_due_in(data)
        if due is not None and due <= 0 and len(data.response_ids) > self.durable_tokens:
            await self.make_durable(data)
            self.ctx.counters.num_progress_rows += 1

    async def generate_turn(self, data: AgentData) -> str:
        """Sample (the rest of) one assistant turn; returns the engine's finish reason.

        Parks before sending if a pause is pending, and mid-generation if one arrives: the engine
        request is aborted and the streamed tokens are appended before parking. With
        `progress_every_s`, a generation still running when the trajectory's progress is due is cut
        the same way, its tokens made durable, and the turn goes on with a new request.
        """
        while True:
            await self.save_progress_if_due(data)
            finish = await self._sample(data)
            if finish is not None:
                return finish
            await self.make_durable(data)  # cut for progress: the tokens so far, then the rest of the turn
            self.ctx.counters.num_progress_rows += 1
            self.ctx.counters.num_progress_cuts += 1

    async def _sample(self, data: AgentData) -> str | None:
        """One engine request for (the rest of) the turn: its finish reason, or None when it was cut
        because the trajectory's progress fell due (its streamed tokens appended)."""
        image_kw: dict[str, Any] = {}
        if data.images:  # text-only trajectories call the engine exactly as before
            data.check_aligned(image_token_id=self.ctx.image_token_id)
            image_kw["images"] = await self.image_inputs(data)
        if self.ctx.cancel.is_set():
            raise Parked()
        max_tokens = self.remaining_budget(data)
        if max_tokens <= 0:
            return "length"
        s = self.ctx.cfg.sampling
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=self.ctx.stop_token_ids,
        )
        data.request_id = f"{data.trajectory_id}-{uuid.uuid4().hex[:8]}"
        prompt = data.prompt_ids + data.response_ids
        if len(data.response_ids) > data.turn_start:  # the turn resumes after an interrupt or a cut
            self.ctx.counters.num_reprefill_tokens += len(prompt)
        t0, started = time.monotonic(), time.time()
        self.ctx.num_in_engine += 1
        gen = asyncio.ensure_future(
            self.ctx.server.generate(data.trajectory_id, data.request_id, prompt, sampling, **image_kw)
        )
        cancel = asyncio.ensure_future(self.ctx.cancel.wait())
        due = self.progress_due_in(data)
        waiters = {gen, cancel}
        if due is not None:  # progress rows on: the generation is cut when the trajectory's progress falls due
            waiters.add(asyncio.ensure_future(asyncio.sleep(max(due, 0.0))))
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            cut = gen not in done and cancel not in done  # only the progress timer fired
            if gen not in done:
                await self.ctx.server.abort(data.request_id)
            output, engine_id = await gen
        finally:
            self.ctx.num_in_engine -= 1
            for waiter in waiters - {gen}:
                waiter.cancel()
            if not gen.done():
                gen.cancel()
        data.generate_s += time.monotonic() - t0
        data.engine_id = engine_id
        data.append_sampled(output.token_ids, output.logprobs, output.policy_versions)
        data.record_side(output.token_side)  # routes of every position, the first recorded kept
        self.ctx.counters.num_generated_tokens += len(output.token_ids)
        if trace.enabled():
            trace_generate(data, started, engine_id, output)
        if output.aborted:
            if self.ctx.cancel.is_set() or not cut:
                raise Parked()  # a pause (or the engine) ended the request: park
            return None
        return output.finish_reason

    def out_of_room(self, data: AgentData) -> bool:
        return len(data.response_ids) >= self.ctx.cfg.response_length

    def append_observation(self, data: AgentData, messages: list[dict[str, Any]]) -> bool:
        """Template `messages` after the last assistant turn and append them (mask 0).

        Image parts (`image_ref`, admitted into the worker's store) render one image token each, which
        is expanded by the processor rule; their refs join `data.images` with the ids, in order. On a
        VLM the image tokens must match the image parts exactly (a tool text holding the literal image
        token is a ValueError, never a misaligned row). Returns False (and appends nothing) when the
        observation does not fit the response budget: the trajectory then terminates with LENGTH,
        never a truncated half-template.
        """
        last = data.response_ids[-1] if data.response_ids else None
        after_eos = last == self.ctx.tokenizer.eos_token_id
        store = self.ctx.response_images
        if not has_image_parts(messages):
            refs, blobs = [], []
            ids = self.ctx.encoder.encode_new_messages(messages, after_eos=after_eos)
        elif store is None:
            raise ValueError(f"trajectory {data.trajectory_id}: an observation with images on a text-only policy")
        else:
            refs = [store.ref(sha) for sha in image_part_refs(messages)]
            blobs = [store.get(r.sha256) for r in refs]
            ids = self.ctx.encoder.encode_new_messages(template_messages(messages), after_eos=after_eos)
        if self.ctx.processor is not None:
            ids = expand_images(self.ctx.processor, ids, blobs)
        if len(data.response_ids) + len(ids) >= self.ctx.cfg.response_length:
            return False
        data.append_observation(ids)
        data.messages.extend(messages)
        data.images.extend(refs)
        return True

    def decode(self, token_ids: list[int]) -> str:
        return self.ctx.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def finalize(self, data: AgentData) -> float:
        """Score the finished trajectory: the reward fn (off the event loop, within
        `reward_timeout_s`) plus the tool rewards. A non-finite part or a reward fn that does not
        return in time raises `RewardError`: the trajectory fails (`scoring.py`)."""
        reward = 0.0
        if self.ctx.reward_fn is not None:
            reward = await call_reward_fn(self.ctx.reward_fn, reward_input(data), self.ctx.cfg.reward_timeout_s)
        return finite("the total reward", reward + sum(finite("a tool reward", r) for r in data.tool_rewards))

    def terminate(self, data: AgentData, reason: FinishReason) -> None:
        data.state = AgentState.TERMINATED
        data.finish_reason = reason


def trace_generate(data: AgentData, started: float, engine_id: str, output: GenerationOutput) -> None:
    """The lifecycle trace's `generate` span: which engine, which policy versions, how many tokens."""
    versions = output.policy_versions
    trace.complete(
        "generate",
        "trajectory",
        data.trajectory_id,
        started,
        attempt=data.attempt,
        engine=engine_id,
        tokens=len(output.token_ids),
        min_version=min(versions) if versions else None,
        max_version=max(versions) if versions else None,
        aborted=output.aborted,
    )
