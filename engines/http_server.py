"""`ServerEngine`: the `InferenceEngine` over an inference server the user runs (vLLM or SGLang, HTTP).

Token ids in, token ids + logprobs out, streamed: every request is one streamed HTTP call
(`ServerAPI` in engines/server_api.py maps the wire format), and each token is tagged with the
`policy_version` the engine serves when its chunk arrives, as in `VLLMEngine`.

Abort = close the stream. `abort(id)` cancels the task reading the request's stream, which closes
its connection (the server aborts a request whose client went away; SGLang also gets an explicit
`/abort_request`); the pending `generate` returns the tokens received so far with
`finish_reason="abort"`. Tokens the server sampled but had not delivered are not part of the
output, so the caller's re-prefill continues exactly after what it kept.

Pause: ABORT closes every stream (each `generate` returns its tokens so far) and pauses the server's
scheduler. KEEP closes every stream too but holds each request in the engine: after `resume` it
continues by re-prefill (the prompt plus the tokens it kept, the rest of its budget) under whatever
weights are loaded then. The server's own keep mode is not used because a client cannot tell which
tokens it sampled before a weight swap: chunks still in the HTTP stream when the label flips would
be tagged with the new version. Closing the stream first makes the split exact (every token read
before the pause is the old version's, every token of the continuation the new one's), at the cost
of recomputing the held requests' KV, which the new weights make stale anyway. Requests sent while
paused wait in the server until `resume`. Weight-sync calls are fenced by the sync epoch
(`SyncFence`), as in `VLLMEngine`.

Weights: `VLLMServerEngine` forwards `collective_rpc` to vLLM's `/collective_rpc`, so with the
server running streamrl's worker extension (`--worker-extension-cls`) the whole filesystem weight
sync (staging, checksums, commit) runs inside the server as it does in-process.
`SGLangServerEngine` stages a filesystem version by remembering its folder and commits with
`/update_weights_from_disk` (the server reads the folder itself, so there are no checksums to verify).
"""

from __future__ import annotations

import abc
import ast
import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.engines.base import (
    EngineCounters,
    GenerationOutput,
    ImageInput,
    InferenceEngine,
    PauseMode,
    PromptMismatchError,
    RequestTable,
    SamplingParams,
    SyncFence,
    check_request,
    score_span,
)
from streamrl.engines.config import EngineConfig
from streamrl.engines.server_api import SGLangServerAPI, server_api
from streamrl.engines.server_process import ServerProcess, wait_healthy

logger = logging.getLogger(__name__)

ABORT = "abort"
CONNECT_TIMEOUT_S = 10.0


class ServerRequestError(RuntimeError):
    """The server refused or failed a call (status and body in the message)."""


@dataclass(kw_only=True, slots=True)
class _InFlight:
    """One request while its `generate` call is pending."""

    token_ids: list[int] = field(default_factory=list)  # [num_new_tokens]
    logprobs: list[float] = field(default_factory=list)  # [num_new_tokens]
    versions: list[int] = field(default_factory=list)  # [num_new_tokens]
    finish_reason: str | None = None
    num_cached: int = 0
    task: asyncio.Future[Any] | None = None  # reads the current stream
    stream_start: int = 0  # tokens received before the current stream (a continuation's prefix)
    held: bool = False  # KEEP-paused: the stream is closed; the request continues after `resume`
    ended: bool = False  # stopped: the request returns what it has, held or not
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a held request's resume (or stop)

    def stop(self) -> None:
        """End the request: `generate` returns the tokens received so far."""
        self.ended = True
        self.wake.set()
        if self.task is not None:
            self.task.cancel()

    def hold(self) -> None:
        """Close the stream and keep the request for a continuation after `release`. Cancelling the
        reader happens before any await, so no chunk is read after this point."""
        self.held = True
        self.wake.clear()
        if self.task is not None:
            self.task.cancel()

    def release(self) -> None:
        self.wake.set()

    def continues(self, max_tokens: int) -> bool:
        """Whether a request whose stream was closed has a continuation to wait for."""
        return self.held and not self.ended and self.finish_reason is None and len(self.token_ids) < max_tokens


class ServerEngine(RequestTable, InferenceEngine):
    """One inference server behind the engine interface (construct once, `shutdown` at end)."""

    def __init__(self, cfg: EngineConfig, engine_id: str, *, policy_version: int = 0) -> None:
        import httpx

        if len(cfg.server_urls) != 1:
            raise ValueError(f"engine {engine_id} needs exactly one server URL, got {cfg.server_urls} (use for_engine)")
        self.cfg = cfg
        self.engine_id = engine_id
        self.policy_version = policy_version
        self.api = server_api(cfg.backend)
        self.url = cfg.server_urls[0].rstrip("/")
        self.device = f"{cfg.backend} at {self.url}"
        self._process: ServerProcess | None = None
        if cfg.server_command:
            self._process = ServerProcess(cfg.server_command, self.url)
            waited = self._process.wait_ready(self.url + self.api.health_path, cfg.startup_timeout_s)
            logger.info("engine %s: server at %s healthy after %.1fs", engine_id, self.url, waited)
        else:
            wait_healthy(self.url + self.api.health_path, min(cfg.startup_timeout_s, 30.0))
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(cfg.call_timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_num_seqs),
        )
        self._requests: dict[str, _InFlight] = {}
        self.counters = EngineCounters()
        self._paused = False
        self._fence = SyncFence(engine_id)
        logger.info("engine %s up: %s", engine_id, self.device)

    # -- generation -------------------------------------------------------------------------------

    async def _generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput]
    ) -> GenerationOutput:
        """Stream one completion from the server (the base class's `generate` accounts for it)."""
        if images:
            raise ValueError(f"engine {self.engine_id} ({self.cfg.backend}) serves text only; got {len(images)} images")
        self._fence.check_serving()
        max_tokens = check_request(
            self.engine_id,
            request_id,
            prompt_ids,
            sampling,
            in_flight=request_id in self._requests,
            max_model_len=self.cfg.max_model_len,
        )
        state = _InFlight()
        self._requests[request_id] = state
        try:
            for part in itertools.count():
                sent = list(prompt_ids) + state.token_ids  # a held request continues after its tokens
                wire_id = request_id if part == 0 else f"{request_id}+{part}"
                path, body = self.api.generate_request(
                    wire_id, sent, sampling, max_tokens - len(state.token_ids), f"v{self.policy_version}"
                )
                state.stream_start = len(state.token_ids)
                state.task = asyncio.ensure_future(self._stream(wire_id, path, body, state, len(sent)))
                await asyncio.wait({state.task})
                if not state.task.cancelled():
                    state.task.result()  # raises what the stream raised
                    break
                if not state.continues(max_tokens):
                    break  # aborted, or held with nothing left to generate
                await state.wake.wait()
                state.held = False
                if state.ended:
                    break
        except asyncio.CancelledError:  # the caller gave up: do not leave the request running
            state.stop()
            raise
        finally:
            del self._requests[request_id]
        return GenerationOutput(
            token_ids=state.token_ids,
            logprobs=state.logprobs,
            policy_versions=state.versions,
            finish_reason=state.finish_reason or ("length" if len(state.token_ids) >= max_tokens else ABORT),
            num_prompt_tokens=len(prompt_ids),
            num_cached_tokens=state.num_cached,
        )

    async def _stream(
        self, request_id: str, path: str, body: dict[str, Any], state: _InFlight, num_prompt: int
    ) -> None:
        async with self._client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:2000]
                error = ValueError if response.status_code == 400 else ServerRequestError
                raise error(f"{self.url}{path} answered {response.status_code} for request {request_id}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                self._take(request_id, json.loads(data), state, num_prompt)

    def _take(self, request_id: str, raw: dict[str, Any], state: _InFlight, num_prompt: int) -> None:
        chunk = self.api.read_chunk(raw, len(state.token_ids) - state.stream_start)
        if chunk.num_prompt_tokens is not None and chunk.num_prompt_tokens != num_prompt:
            raise PromptMismatchError(
                f"request {request_id} on engine {self.engine_id}: the server saw {chunk.num_prompt_tokens} "
                f"prompt tokens, the caller sent {num_prompt}"
            )
        version = self.policy_version
        state.token_ids.extend(chunk.token_ids)
        state.logprobs.extend(chunk.logprobs)
        state.versions.extend([version] * len(chunk.token_ids))
        if chunk.num_cached_tokens:
            state.num_cached = chunk.num_cached_tokens
        if chunk.finish_reason is not None:
            state.finish_reason = chunk.finish_reason

    async def score(self, request_id: str, token_ids: list[int], start: int) -> list[float]:
        """The server's log-prob of each of `token_ids[start:]` (one non-streamed request)."""
        self._fence.check_serving()
        if score_span(self.engine_id, token_ids, start, max_model_len=self.cfg.max_model_len) == 0:
            return []
        path, body = self.api.score_request(request_id, list(token_ids))
        self.counters.clock.enter()
        try:
            answer = await self._post(path, json=body)
        finally:
            self.counters.clock.exit()
        return self.api.read_scores(answer, list(token_ids), start)

    async def abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        state.stop()
        call = self.api.abort_request(request_id)
        if call is not None:
            try:
                await self._post(call[0], json=call[1])
            except Exception as exc:  # the closed stream already aborts it; the call only hurries it
                logger.warning("engine %s: %s for %s failed: %s", self.engine_id, call[0], request_id, exc)

    # -- pause / resume ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT, *, epoch: int | None = None) -> None:
        """ABORT: end every in-flight request (each returns its partial tokens). KEEP: freeze them in
        the server; they continue after `resume`, under whatever weights are loaded then."""
        mode = PauseMode(mode)

        async def pause_now() -> None:
            for state in self._requests.values():  # before the first await: no chunk is read after
                state.hold() if mode is PauseMode.KEEP else state.stop()
            path, params, body = self.api.pause_request()
            await self._post(path, params=params, json=body)
            self._paused = True

        await self._fence.pause(epoch, pause_now, self._resume_now)

    async def resume(self, *, epoch: int | None = None) -> None:
        self._fence.note_resume(epoch)
        await self._resume_now()

    async def _resume_now(self) -> None:
        try:
            await self._post(self.api.resume_path())
            self._paused = False
        finally:  # held requests continue (a server still paused keeps them waiting in its queue)
            for state in self._requests.values():
                state.release()

    @property
    def paused(self) -> bool:
        return self._paused

    # -- weights ----------------------------------------------------------------------------------

    async def commit_weights(self, policy_version: int, *, epoch: int, timeout_s: float | None = None) -> None:
        """Make the server load the staged weights and flip the label in the same step."""

        async def load() -> None:
            try:
                await self._load_staged(policy_version, timeout_s)
            except BaseException:
                for state in self._requests.values():  # KEEP-frozen requests must not sample on them
                    state.stop()
                raise
            self.policy_version = policy_version
            logger.info("engine %s serves policy_version %d", self.engine_id, policy_version)

        await self._fence.commit(epoch, load)
        await self.reset_prefix_cache()

    @abc.abstractmethod
    async def _load_staged(self, policy_version: int, timeout_s: float | None) -> None:
        """Make the server load the weights staged for `policy_version` (the label is set by the caller)."""

    @abc.abstractmethod
    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """The weight-sync calls the transports address to an engine's workers (`SyncEngine`)."""

    async def reset_prefix_cache(self) -> bool:
        """Drop the server's cached KV blocks (salting already isolates versions where the server has it)."""
        await self._post(self.api.reset_prefix_cache_path())
        return True

    async def ping(self) -> int:
        self._fence.check_serving()
        if self._process is not None and self._process.process.poll() is not None:
            # the port may be answered by someone else now: only the server started here is driven
            raise ServerRequestError(f"{self.url}: the server this engine started exited")
        response = await self._client.get(self.api.health_path, timeout=CONNECT_TIMEOUT_S)
        if response.status_code != 200:
            raise ServerRequestError(f"{self.url} is unhealthy: HTTP {response.status_code}")
        return self.policy_version

    # -- plumbing ---------------------------------------------------------------------------------

    async def _post(
        self, path: str, *, json: Any = None, params: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """POST a control call; the decoded JSON answer (None for an empty body)."""
        response = await self._client.post(
            path, json=json, params=params, timeout=timeout if timeout is not None else self.cfg.call_timeout_s
        )
        if response.status_code != 200:
            raise ServerRequestError(f"{self.url}{path} answered {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None

    async def shutdown(self) -> None:
        for state in list(self._requests.values()):
            state.stop()
        await self._client.aclose()
        if self._process is not None:
            await asyncio.to_thread(self._process.stop)
        logger.info("engine %s shut down", self.engine_id)


class VLLMServerEngine(ServerEngine):
    """`vllm serve` with `VLLM_SERVER_DEV_MODE=1` (pause, resume, cache reset and RPC endpoints)."""

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """`method` on every worker of the server (`/collective_rpc`); one result per worker. vLLM
        returns dicts and lists as JSON and everything else as `str()`: literals are read back."""
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout}
        answer = await self._post(
            "/collective_rpc", json=body, timeout=None if timeout is None else timeout + CONNECT_TIMEOUT_S
        )
        results = (answer or {}).get("results") or []
        return [_literal(r) for r in results]

    async def _load_staged(self, policy_version: int, timeout_s: float | None) -> None:
        await self.collective_rpc("commit_weights", args=(policy_version,), timeout=timeout_s)

    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        folder = _weights_folder(path)
        await self.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        if self.cfg.worker_extension_cls:
            await self.collective_rpc("refresh_packed_embeddings")
        await self.reset_prefix_cache()
        self.policy_version = policy_version
        logger.info("engine %s: server loaded %s as policy_version %d", self.engine_id, folder, policy_version)


class SGLangServerEngine(ServerEngine):
    """SGLang's native server (`python -m sglang.launch_server`)."""

    def __init__(self, cfg: EngineConfig, engine_id: str, *, policy_version: int = 0) -> None:
        super().__init__(cfg, engine_id, policy_version=policy_version)
        self._staged: tuple[int, str] | None = None  # (policy_version, folder) of a filesystem version
        self._report: dict[str, Any] = {}  # the StageReport of the staged version

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """The filesystem transport's staging calls, answered here: staging a version is remembering
        its folder (the server reads it at commit). One "worker" per engine."""
        if method in ("stage_weights_from_path", "begin_stage_weights_from_path"):
            return [self._stage(*args, **(kwargs or {}))]
        if method == "receive_done":
            return [True]
        if method == "finish_receive_weights":
            if self._staged is None:
                raise RuntimeError("finish_receive_weights called before begin_stage_weights_from_path")
            return [self._report]
        if method == "discard_weights":
            staged, self._staged = self._staged, None
            return [staged is not None]
        raise ValueError(
            f"engine {self.engine_id}: SGLang servers take weights from disk only (filesystem transport); no {method!r}"
        )

    def _stage(self, path: str, manifest_json: str, verify: bool = True) -> dict[str, Any]:
        if verify:
            raise ValueError(
                "an SGLang server reads the weight folder itself, nothing is staged to checksum: "
                "set weight_sync.verify_checksum = false"
            )
        manifest = json.loads(manifest_json)
        folder = _weights_folder(path)
        self._staged = (int(manifest["policy_version"]), str(folder))
        self._report = {
            "rank": 0,
            "policy_version": int(manifest["policy_version"]),
            "checksums": [None] * len(manifest["buckets"]),
            "num_bytes": sum(int(b["nbytes"]) for b in manifest["buckets"]),
        }
        return self._report

    async def _load_staged(self, policy_version: int, timeout_s: float | None) -> None:
        if self._staged is None or self._staged[0] != policy_version:
            raise RuntimeError(f"engine {self.engine_id}: commit of v{policy_version} but staged {self._staged}")
        await self._update_from_disk(self._staged[1], policy_version, timeout_s)
        self._staged = None

    async def _update_from_disk(self, folder: str, policy_version: int, timeout_s: float | None) -> None:
        assert isinstance(self.api, SGLangServerAPI)
        path, body = self.api.update_weights_request(folder, policy_version)
        answer = await self._post(path, json=body, timeout=timeout_s)
        if not (answer or {}).get("success"):
            raise ServerRequestError(f"{self.url}{path} failed for {folder}: {answer}")

    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        folder = _weights_folder(path)
        await self._update_from_disk(str(folder), policy_version, None)
        self.policy_version = policy_version
        logger.info("engine %s: server loaded %s as policy_version %d", self.engine_id, folder, policy_version)


def _weights_folder(path: str) -> Path:
    folder = Path(path).resolve()
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"no *.safetensors in {folder}; expected a HF model folder")
    return folder


def _literal(result: Any) -> Any:
    """A `/collective_rpc` result: vLLM sends `str(result)` for anything not a dict or list."""
    if not isinstance(result, str):
        return result
    try:
        return ast.literal_eval(result)
    except (ValueError, SyntaxError):
        return result


def make_server_engine(cfg: EngineConfig, engine_id: str, *, policy_version: int = 0) -> ServerEngine:
    if cfg.backend == "vllm_server":
        return VLLMServerEngine(cfg, engine_id, policy_version=policy_version)
    if cfg.backend == "sglang_server":
        return SGLangServerEngine(cfg, engine_id, policy_version=policy_version)
    raise ValueError(f"backend {cfg.backend!r} is not a server backend")
