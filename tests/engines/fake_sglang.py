"""A fake SGLang server: a real FastAPI app (uvicorn on 127.0.0.1, an ephemeral port) answering the
native endpoints `SGLangServerEngine` uses the way SGLang documents them, with scripted tokens.

Token i of a request is `token_at(input_ids, i, weights)` with logprob `-(i + 1) / 10`; `weights`
is the count of `/update_weights_from_disk` calls, so outputs change when weights load. Streams are
SSE `data: {json}` lines ending in `data: [DONE]`; chunks are cumulative (SGLang's default) or per
chunk (`--incremental-streaming-output`). Every request body is recorded for the tests to inspect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class _QuietServer(uvicorn.Server):
    """uvicorn inside the test process: it must not take the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def token_at(input_ids: list[int], i: int, weights: int) -> int:
    return (sum(input_ids) + 7 * i + 101 * weights) % 500 + 10


@dataclass
class FakeSGLang:
    incremental: bool = False
    token_delay_s: float = 0.01
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    weights: int = 0
    paused: bool = False
    aborted: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)
    disconnected: set[str] = field(default_factory=set)
    port: int = 0
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({})

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.calls.append(("/generate", body))
            if not body.get("input_ids") or "sampling_params" not in body:
                return JSONResponse({"error": {"message": "input_ids and sampling_params required"}}, 400)
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        @app.post("/abort_request")
        async def abort_request(request: Request) -> JSONResponse:
            body = await request.json()
            self.calls.append(("/abort_request", body))
            self.aborted.add(body["rid"])
            return JSONResponse({})

        @app.post("/pause_generation")
        async def pause(request: Request) -> JSONResponse:
            body = await request.json()
            self.calls.append(("/pause_generation", body))
            if body.get("mode", "abort") == "abort":
                self.aborted |= self.running
            else:
                self.paused = True
                self._resumed.clear()
            return JSONResponse({})

        @app.post("/continue_generation")
        async def resume() -> JSONResponse:
            self.calls.append(("/continue_generation", {}))
            self.paused = False
            self._resumed.set()
            return JSONResponse({})

        @app.post("/update_weights_from_disk")
        async def update(request: Request) -> JSONResponse:
            body = await request.json()
            self.calls.append(("/update_weights_from_disk", body))
            if not Path(body["model_path"]).is_dir():
                return JSONResponse({"success": False, "message": "no such folder", "num_paused_requests": 0})
            self.weights += 1
            return JSONResponse({"success": True, "message": "ok", "num_paused_requests": 0})

        @app.post("/flush_cache")
        async def flush() -> JSONResponse:
            self.calls.append(("/flush_cache", {}))
            return JSONResponse({})

        return app

    async def _stream(self, body: dict[str, Any]):
        rid, ids = body["rid"], body["input_ids"]
        budget = body["sampling_params"]["max_new_tokens"]
        out: list[int] = []
        logprobs: list[list[Any]] = []
        self.running.add(rid)
        try:
            while True:
                while self.paused:
                    await self._resumed.wait()
                if rid in self.aborted:
                    reason: dict[str, Any] | None = {"type": "abort", "message": "aborted"}
                else:
                    out.append(token_at(ids, len(out), self.weights))
                    logprobs.append([-(len(out)) / 10, out[-1], None])
                    reason = {"type": "length", "length": budget} if len(out) == budget else None
                yield self._chunk(rid, ids, out, logprobs, reason)
                if reason is not None:
                    break
                await asyncio.sleep(self.token_delay_s)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnected.add(rid)
            raise
        finally:
            self.running.discard(rid)

    def _chunk(self, rid: str, ids: list[int], out: list[int], logprobs: list, reason: Any) -> str:
        new = 0 if reason is not None and reason["type"] == "abort" else 1
        meta = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "output_token_logprobs": logprobs[len(logprobs) - new :] if self.incremental else list(logprobs),
        }
        output_ids = out[len(out) - new :] if self.incremental else list(out)
        return f"data: {json.dumps({'text': '', 'output_ids': output_ids, 'meta_info': meta})}\n\n"

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    async def serve(self) -> tuple[_QuietServer, asyncio.Task]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        server = _QuietServer(uvicorn.Config(self.app(), lifespan="off", access_log=False, log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        return server, task
