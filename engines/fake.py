"""`FakeEngine`: a scripted `InferenceEngine` for logic tests (agent loops, routing, interrupts).

It honours the same contract as `VLLMEngine` — abort returns the partial tokens with
`finish_reason="abort"`, ABORT-pause aborts everything in flight, KEEP-pause freezes requests until
`resume`, requests submitted while paused wait, each token is tagged with the policy_version current
when it was produced, stop token ids end a turn (the stop token is included), `max_tokens` bounds it —
but produces tokens from a script with a configurable per-token delay, so tests can interrupt a
generation at a chosen point without a model. Weight-sync calls go through the same `SyncFence` as
the real engine; `commit_weights` loads through the `commit_weights` rpc handler (a fake worker), and
`pause_delay_s` makes a pause land late (fencing tests).

Images are accepted and recorded (`images_seen`, in call order) so loop tests can check what a
trajectory sent; given `image_token_id`, the fake also rejects requests whose placeholder runs and
images disagree, as the real engine does.

Logprobs are deterministic: `fake_logprob(position, token_id)` where position is the absolute index
of the token in prompt + response, so a resumed (re-prefilled) generation reproduces them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from streamrl.engines.base import (
    EngineCounters,
    GenerationOutput,
    ImageInput,
    InferenceEngine,
    PauseMode,
    SamplingParams,
    SyncFence,
    score_span,
)
from streamrl.models.multimodal import count_image_runs

logger = logging.getLogger(__name__)

Script = Sequence[Sequence[int]] | Callable[[list[int]], Sequence[int]]


def fake_logprob(position: int, token_id: int) -> float:
    """Deterministic pseudo logprob in [-0.97, -0.01] for a token at an absolute position."""
    return -0.01 * (1 + (token_id * 31 + position * 17) % 97)


def default_script(prompt_ids: list[int]) -> list[int]:
    """Without a script: 64 tokens derived from the prompt (same prompt -> same completion)."""
    base = sum(prompt_ids) * 7 + len(prompt_ids)
    return [(base + 13 * i) % 997 + 3 for i in range(64)]


class FakeEngine(InferenceEngine):
    """Scripted engine. `script` is a list of completions used in call order (cycling) or a callable
    `prompt_ids -> completion`; a completion shorter than `max_tokens` ends with finish "stop"."""

    def __init__(
        self,
        engine_id: str = "fake-0",
        script: Script | None = None,
        *,
        token_delay_s: float = 0.0,
        policy_version: int = 0,
        rpc_handlers: dict[str, Callable[..., Any]] | None = None,
        image_token_id: int | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.policy_version = policy_version
        self.token_delay_s = token_delay_s
        self.script: Script = default_script if script is None else script
        if not callable(self.script) and len(self.script) == 0:
            raise ValueError("script must hold at least one completion")
        self.rpc_handlers = dict(rpc_handlers or {})
        self.fail_with: BaseException | None = None  # set to make every generate and ping raise (health tests)
        self.pause_delay_s = 0.0  # how long a pause takes to land once admitted (fencing tests)
        self.loaded_paths: list[tuple[str, int]] = []
        self.requests_seen: list[tuple[str, list[int]]] = []  # (request_id, prompt_ids) in call order
        self.images_seen: list[tuple[str, list[ImageInput]]] = []  # (request_id, images) in call order
        self.image_token_id = image_token_id  # None: images are recorded, not checked against the ids
        self.score_logprob: Callable[[int, int], float] = fake_logprob  # (position, token id) -> teacher log-prob
        self.scored: list[tuple[str, list[int], int]] = []  # (request_id, token_ids, start) of `score` calls
        self._num_calls = 0
        self._abort_flags: dict[str, asyncio.Event] = {}
        self._running = asyncio.Event()
        self._running.set()
        self._fence = SyncFence(engine_id)
        self.counters = EngineCounters()

    def _completion(self, prompt_ids: list[int]) -> list[int]:
        if callable(self.script):
            return list(self.script(list(prompt_ids)))
        completion = self.script[self._num_calls % len(self.script)]
        return list(completion)

    async def _generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput]
    ) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        num_runs = None if self.image_token_id is None else count_image_runs(prompt_ids, self.image_token_id)
        if num_runs is not None and num_runs != len(images):
            raise ValueError(f"prompt_ids hold {num_runs} image placeholder runs for {len(images)} images")
        for image in images:
            image.check()
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        if request_id in self._abort_flags:
            raise ValueError(f"request_id {request_id!r} is already in flight on engine {self.engine_id}")
        if self.fail_with is not None:
            raise self.fail_with
        self._fence.check_serving()
        completion = self._completion(prompt_ids)
        self._num_calls += 1
        self.requests_seen.append((request_id, list(prompt_ids)))
        self.images_seen.append((request_id, images))
        aborted = self._abort_flags[request_id] = asyncio.Event()
        stop_ids = set(sampling.stop_token_ids)
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish_reason = "stop"
        try:
            await self._wait_running(aborted)  # submitted while paused: wait for resume
            for token in completion:
                if len(token_ids) >= sampling.max_tokens:
                    finish_reason = "length"
                    break
                await asyncio.sleep(self.token_delay_s)
                await self._wait_running(aborted)  # KEEP pause freezes here
                if aborted.is_set():
                    finish_reason = "abort"
                    break
                token_ids.append(token)
                logprobs.append(fake_logprob(len(prompt_ids) + len(token_ids) - 1, token))
                versions.append(self.policy_version)
                if token in stop_ids:
                    break
            else:
                if len(token_ids) >= sampling.max_tokens:
                    finish_reason = "length"
        finally:
            del self._abort_flags[request_id]
        return GenerationOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            policy_versions=versions,
            finish_reason=finish_reason,
            num_prompt_tokens=len(prompt_ids),
        )

    async def score(self, request_id: str, token_ids: list[int], start: int) -> list[float]:
        """`fake_logprob` of every scored position: a fake teacher scores a fake student's tokens
        exactly as the student sampled them (`score_logprob` overrides it, e.g. to make a better teacher)."""
        if self.fail_with is not None:
            raise self.fail_with
        self._fence.check_serving()
        score_span(self.engine_id, token_ids, start, max_model_len=2**31)
        self.scored.append((request_id, list(token_ids), start))
        return [self.score_logprob(t, token_ids[t]) for t in range(start, len(token_ids))]

    async def _wait_running(self, aborted: asyncio.Event) -> None:
        """Block while paused, unless this request gets aborted meanwhile."""
        if self._running.is_set() or aborted.is_set():
            return
        waiters = [asyncio.ensure_future(self._running.wait()), asyncio.ensure_future(aborted.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def abort(self, request_id: str) -> None:
        if (aborted := self._abort_flags.get(request_id)) is not None:
            aborted.set()

    async def pause(self, mode: PauseMode = PauseMode.ABORT, *, epoch: int | None = None) -> None:
        async def pause_now() -> None:
            await asyncio.sleep(self.pause_delay_s)
            if PauseMode(mode) is PauseMode.ABORT:
                self._abort_all()
            self._running.clear()
            await asyncio.sleep(0)  # let aborted generations observe the flag before we return

        await self._fence.pause(epoch, pause_now, self._resume_now)

    async def resume(self, *, epoch: int | None = None) -> None:
        self._fence.note_resume(epoch)
        await self._resume_now()

    async def _resume_now(self) -> None:
        self._running.set()

    def _abort_all(self) -> None:
        for aborted in self._abort_flags.values():
            aborted.set()

    async def commit_weights(self, policy_version: int, *, epoch: int, timeout_s: float | None = None) -> None:
        async def load() -> None:
            try:
                await self.collective_rpc("commit_weights", args=(policy_version,), timeout=timeout_s)
            except BaseException:
                self._abort_all()  # frozen (KEEP) requests must not continue on half-loaded weights
                raise
            self.policy_version = policy_version

        await self._fence.commit(epoch, load)

    async def ping(self) -> int:
        if self.fail_with is not None:
            raise self.fail_with
        self._fence.check_serving()
        return self.policy_version

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        self.loaded_paths.append((str(path), policy_version))
        self.policy_version = policy_version

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Runs `rpc_handlers[method]` as the single fake worker; one result per worker, like vLLM."""
        handler = self.rpc_handlers.get(method)
        if handler is None:
            raise ValueError(f"FakeEngine {self.engine_id} has no rpc handler {method!r}")
        result = handler(*args, **(kwargs or {}))
        if isinstance(result, Awaitable):
            result = await asyncio.wait_for(result, timeout)
        return [result]

    async def shutdown(self) -> None:
        for request_id in list(self._abort_flags):
            await self.abort(request_id)
        self._running.set()
