"""The gateway's HTTP server: OpenAI- and Anthropic-compatible endpoints in front of the rollout
worker's sessions.

Owns the FastAPI app, the uvicorn server it runs on (a task on the worker's own event loop, so the
handlers call the sessions, the engines and the cancel Event directly; no thread, no Ray), the check of
each session's own bearer token, the request size limit, the parse of a body (JSON text: not too deep,
no lone surrogates; `parse_body`) and the table of live sessions. Routes, per
session and attempt:

    GET  /s/{session}/{attempt}/v1/models
    POST /s/{session}/{attempt}/v1/chat/completions    (OpenAI; stream=true answers server-sent events)
    POST /s/{session}/{attempt}/v1/responses           (OpenAI Responses, `responses.py`; stream=true likewise)
    GET  /s/{session}/{attempt}/v1/responses/{id}      (a response the session stored)
    POST /s/{session}/{attempt}/v1/messages            (Anthropic; stream=true likewise)

Errors come in the calling API's own error body, with the status codes the official clients act on:
400 (bad request), 401 (a token of no live session), 404 (no such session, or not the token's own),
410 (an attempt the session has moved past), 413 (body too large) are final, and `x-should-retry: false`
says so; 500 and 503 are retried.

A crash takes the server with the worker: its sessions' state is in their trajectories (the last row
and the journal's records of the answered calls), and the resumed trajectories get a new server, port
and attempt in another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import socket
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from streamrl.rollout.gateway import protocol, responses
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.protocol import GatewayError
from streamrl.rollout.gateway.session import CallStats, Session, call_key

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0  # `stop` lets calls in flight finish this long, then cancels them
# The deepest nesting of arrays and objects a body may have. Real requests (messages, content blocks,
# tool schemas) stay far below; deeper ones would hit Python's recursion limit in the parser or in
# whatever walks the body later, a 500 its client would retry.
MAX_JSON_DEPTH = 128
MAX_PROGRAM_NAMES = 32  # distinct names of `rollout/program/<name>/*` one worker logs


# The counters of `GatewayServer.metrics` (`rollout/gateway/<name>`, declared in core/catalogue.py).
COUNTERS = (
    "num_requests",  # API calls received
    "num_errors",  # answered with an error status
    "num_sampled",  # answered by sampling
    "num_retries_answered",  # a retry answered from this attempt's journal (nothing sampled)
    "num_replayed",  # a restarted program's call answered from an earlier attempt's journal
    "num_forks",  # calls that rewrote the history (the session forked)
    "num_calls_across_sync",  # calls whose generation a weight sync parked or interrupted
    "overhead_sum_s",  # seconds the sampled calls spent in the gateway outside the engine
)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a process that owns its signals (a Ray actor, a test): it must not take them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """One per rollout worker process; `start` on the worker's event loop, `add`/`remove` sessions."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.sessions: dict[str, Session] = {}
        self.port: int | None = None
        self.counts = dict.fromkeys(COUNTERS, 0.0)  # totals since start (the driver takes increments)
        self.program_sums: dict[str, float] = {}  # a command's named numbers, summed over its samples
        self.program_samples = 0  # samples whose command left named numbers
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self._starting: asyncio.Task | None = None  # `ensure_started`'s one start
        self.app = build_app(self)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def ensure_started(self) -> None:
        """Start the server unless it is started or starting (then wait for that start)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self.start())
        await asyncio.shield(self._starting)

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=math.ceil(STOP_GRACE_S),  # uvicorn takes whole seconds
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the gateway server stopped while starting")
            await asyncio.sleep(0.01)
        logger.info("gateway listening on http://%s:%d", self.cfg.host, self.port)

    async def stop(self) -> None:
        """Stop listening; calls still in flight after `STOP_GRACE_S` are cancelled (their clients see
        the connection drop and may retry against the trajectory's next attempt)."""
        if self._starting is not None and not self._starting.done():
            await asyncio.gather(self._starting, return_exceptions=True)  # then stop what it started
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STOP_GRACE_S + 3.0)
            except TimeoutError:
                self._server.force_exit = True
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._server = self._task = None

    def base_url(self, session: Session) -> str:
        """The OpenAI-style base URL of a session (ends in /v1; Anthropic clients take it without)."""
        return f"http://{self.cfg.host}:{self.port}/s/{session.session_id}/{session.attempt}/v1"

    def add(self, session: Session) -> None:
        self.sessions[session.session_id] = session

    def remove(self, session: Session) -> None:
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]

    @property
    def num_requests(self) -> int:
        return int(self.counts["num_requests"])

    @property
    def num_errors(self) -> int:
        return int(self.counts["num_errors"])

    def metrics(self) -> dict[str, float]:
        """`rollout/gateway/*` (core/catalogue.py): the open sessions and the counters since start."""
        return {
            "rollout/gateway/num_sessions": float(len(self.sessions)),
            **{f"rollout/gateway/{name}": value for name, value in self.counts.items()},
            **({"rollout/program/num_samples": float(self.program_samples)} if self.program_samples else {}),
            **{f"rollout/program/{name}/sum": total for name, total in self.program_sums.items()},
        }

    def account_program(self, metrics: dict[str, float]) -> None:
        """Add one sample's named numbers (`command.read_metrics`; none: nothing to count). A name a
        sample did not give counts 0 for it, so a flag's mean is the share of samples that set it. A
        worker keeps at most `MAX_PROGRAM_NAMES` names: a program inventing names cannot grow every
        metrics line."""
        if not metrics:
            return
        self.program_samples += 1
        for name, value in metrics.items():
            if name not in self.program_sums and len(self.program_sums) >= MAX_PROGRAM_NAMES:
                logger.warning("program metric %r dropped: this worker has %d names already", name, MAX_PROGRAM_NAMES)
                continue
            self.program_sums[name] = self.program_sums.get(name, 0.0) + value

    def account(self, stats: CallStats, elapsed_s: float) -> None:
        """Count one answered call. Its overhead is the handler's time outside the engine (parsing,
        rendering, the journal's durable append, the response), for sampled calls only."""
        c = self.counts
        c["num_sampled"] += stats.sampled
        c["num_retries_answered"] += stats.journal == "retry"
        c["num_replayed"] += stats.journal == "replay"
        c["num_forks"] += stats.forked
        c["num_calls_across_sync"] += stats.synced
        if stats.sampled:
            c["overhead_sum_s"] += max(elapsed_s - stats.engine_s, 0.0)

    # ---- request handling ---------------------------------------------------------------------

    def authorize(self, request: Request, session_id: str, attempt: int) -> Session:
        """The session a request may use: its bearer token must be that session's own (`Session.token`).
        A token of no live session gets 401. A live session's token used on another session's URL gets
        404, the answer for a session that does not exist: a sample's program can neither use nor probe
        its siblings' sessions, whose ids it can compute from their trajectory ids."""
        auth = request.headers.get("authorization", "")
        token = (auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")).encode()
        session = self.sessions.get(session_id)
        if session is None or not hmac.compare_digest(token, session.token.encode()):
            if not any(hmac.compare_digest(token, s.token.encode()) for s in self.sessions.values()):
                raise GatewayError(
                    401, "invalid or missing API key (the session's bearer token)", code="invalid_api_key"
                )
            raise GatewayError(404, f"no live session {session_id!r}", code="session_not_found")
        if attempt != session.attempt:
            raise GatewayError(
                410 if attempt < session.attempt else 404,
                f"attempt {attempt} of session {session_id!r} is not served here (current attempt {session.attempt})",
                code="stale_attempt",
            )
        return session

    async def body(self, request: Request) -> Any:
        limit = self.cfg.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise GatewayError(413, f"request body of {length} bytes exceeds the limit of {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise GatewayError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return parse_body(b"".join(chunks))

    async def chat(self, api: str, request: Request, session_id: str, attempt: int) -> Response:
        started = time.perf_counter()
        self.counts["num_requests"] += 1
        stream, include_usage, stats = False, False, CallStats()
        try:
            session = self.authorize(request, session_id, attempt)
            body = await self.body(request)
            if api == "anthropic":
                call = protocol.parse_anthropic(body)
            elif api == "responses":
                call = responses.parse(body)
            else:
                call = protocol.parse_openai(body, max_choices=self.cfg.max_choices)
            stream, include_usage = call.stream, call.include_usage
            key, body_sha = call_key(session.session_id, session.attempt, request.url.path.rsplit("/v1/", 1)[-1], body)
            response = await session.complete(call, key, body_sha, stats)
        except GatewayError as err:
            return self.error(api, err)
        except Exception as exc:  # a bug or a broken engine: the client may retry
            logger.exception("gateway call failed")
            return self.error(api, GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))
        if not stream:
            reply: Response = JSONResponse(response)
            self.account(stats, time.perf_counter() - started)
            return reply
        if api == "anthropic":
            events = protocol.anthropic_events(response)
        elif api == "responses":
            events = responses.events(response)
        else:
            events = protocol.openai_events(response, include_usage=include_usage)

        async def send() -> Any:
            for event in events:
                yield event

        self.account(stats, time.perf_counter() - started)
        return StreamingResponse(send(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    def error(self, api: str, err: GatewayError) -> JSONResponse:
        self.counts["num_errors"] += 1
        retry = "true" if err.status in protocol.RETRYABLE else "false"
        return JSONResponse(protocol.error_body(api, err), status_code=err.status, headers={"x-should-retry": retry})


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, or a 400 that says what is wrong with it: not JSON, nested deeper than
    `MAX_JSON_DEPTH`, or a string (value or key) holding a lone surrogate (`"\\ud800"` is valid JSON
    but no text: the tokenizer and every UTF-8 encoder refuse it). These are the client's to fix, so
    they must not come back as a retryable 500."""
    too_deep = protocol.bad_request(f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise protocol.bad_request(f"the body is not valid JSON: {exc}") from None
    level, depth = [body] if type(body) in (dict, list) else [], 0  # a level at a time: no recursion
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise too_deep
        level = [item for c in level for item in (c.values() if type(c) is dict else c) if type(item) in (dict, list)]
    try:  # all strings at once, at C speed; the slow walk below only names the culprit
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        where, char = _lone_surrogate(body)
        raise protocol.bad_request(
            f"{where} holds a lone surrogate (U+{ord(char):04X}), which is not text: send the character itself, "
            "or both halves of its surrogate pair"
        ) from exc
    return body


def _lone_surrogate(body: Any) -> tuple[str, str]:
    """Where in `body` the first string (or key) that is not valid text is, and its bad character."""
    todo: list[tuple[Any, str]] = [(body, "")]
    while todo:
        value, where = todo.pop()
        texts = [(value, where)] if isinstance(value, str) else []
        if isinstance(value, dict):
            texts += [(key, f"a key of {where or 'the body'}") for key in value]
            todo += [(item, f"{where}.{key[:64]}".removeprefix(".")) for key, item in value.items()]
        elif isinstance(value, list):
            todo += [(item, f"{where}[{i}]") for i, item in enumerate(value)]
        for text, place in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return place or "the body", text[exc.start]
    raise AssertionError("no string of the body failed to encode")


def build_app(gateway: GatewayServer) -> FastAPI:
    app = FastAPI(title="streamrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/s/{session_id}/{attempt}/v1/models")
    async def models(request: Request, session_id: str, attempt: int) -> Response:
        try:
            gateway.authorize(request, session_id, attempt)
        except GatewayError as err:
            return gateway.error("openai", err)
        model = {"id": gateway.cfg.model_name, "object": "model", "created": 0, "owned_by": "streamrl"}
        return JSONResponse({"object": "list", "data": [model]})

    @app.post("/s/{session_id}/{attempt}/v1/chat/completions")
    async def chat_completions(request: Request, session_id: str, attempt: int) -> Response:
        return await gateway.chat("openai", request, session_id, attempt)

    @app.post("/s/{session_id}/{attempt}/v1/responses")
    async def create_response(request: Request, session_id: str, attempt: int) -> Response:
        return await gateway.chat("responses", request, session_id, attempt)

    @app.get("/s/{session_id}/{attempt}/v1/responses/{response_id}")
    async def retrieve_response(request: Request, session_id: str, attempt: int, response_id: str) -> Response:
        try:
            stored = gateway.authorize(request, session_id, attempt).stored_response(response_id)
        except GatewayError as err:
            return gateway.error("responses", err)
        if stored is None:
            return gateway.error("responses", GatewayError(404, f"Response with id {response_id!r} not found."))
        return JSONResponse(stored)

    @app.post("/s/{session_id}/{attempt}/v1/messages")
    async def messages(request: Request, session_id: str, attempt: int) -> Response:
        return await gateway.chat("anthropic", request, session_id, attempt)

    return app
