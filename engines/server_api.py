"""The wire formats of the inference servers a `ServerEngine` drives: one `ServerAPI` per server kind.

A `ServerAPI` only maps: our request -> (path, JSON body), one streamed JSON chunk -> the tokens it
adds, and the names of the control endpoints. `ServerEngine` (engines/http_server.py) owns
the connection, the abort and pause semantics, the version labels and the weight-sync fence.

vLLM (`vllm serve`, 0.32): `/v1/completions` with the prompt as token ids, streamed, `logprobs=0`
(the sampled token's own logprob) and `return_token_ids` (each chunk's new token ids, the first
chunk also the prompt ids it saw). Control endpoints are vLLM's development endpoints
(`VLLM_SERVER_DEV_MODE=1`): `/pause?mode=abort`, `/resume`, `/reset_prefix_cache`,
`/collective_rpc`.

Scoring given tokens (a distillation teacher, `InferenceEngine.score`): vLLM's non-streamed
`/v1/completions` with `prompt_logprobs=0` and one sampled token; SGLang's is not built.

SGLang: the native `/generate` with `input_ids`, `return_logprob` and `stream`; chunks carry the
output ids and `meta_info.output_token_logprobs` ([logprob, token id, text] per token), cumulative
by default and per chunk with `--incremental-streaming-output`: both are read through
`meta_info.completion_tokens`, the count so far. Control: `/abort_request`, `/pause_generation`,
`/continue_generation`, `/update_weights_from_disk`, `/flush_cache`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from streamrl.engines.base import SamplingParams


@dataclass(kw_only=True, slots=True)
class ChunkTokens:
    """What one streamed chunk adds to a request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while the request runs
    num_prompt_tokens: int | None = None  # prompt tokens the server saw, when the chunk says
    num_cached_tokens: int | None = None


class ServerProtocolError(RuntimeError):
    """The server answered something this client cannot read (another version or API)."""


class ServerAPI(abc.ABC):
    """One server kind's request and response mapping (stateless)."""

    name: str
    health_path = "/health"

    @abc.abstractmethod
    def generate_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, salt: str
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a streamed token-in/token-out request."""

    @abc.abstractmethod
    def read_chunk(self, chunk: dict[str, Any], num_received: int) -> ChunkTokens:
        """The tokens one stream chunk adds, given how many this request has received so far."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        """An explicit abort call, or None where closing the stream is the abort."""

    def score_request(self, request_id: str, token_ids: list[int]) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a non-streamed request returning the log-prob of every given token
        (`InferenceEngine.score`, a distillation teacher)."""
        raise NotImplementedError(f"the {self.name} client cannot score tokens (a distillation teacher needs it)")

    def read_scores(self, answer: dict[str, Any], token_ids: list[int], start: int) -> list[float]:
        """The log-probs of `token_ids[start:]` in the answer to `score_request`."""
        raise NotImplementedError(f"the {self.name} client cannot score tokens")

    @abc.abstractmethod
    def pause_request(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """(path, query params, JSON body) of a pause that aborts the server's requests (the engine
        holds KEEP-paused requests itself: `ServerEngine.pause`)."""

    @abc.abstractmethod
    def resume_path(self) -> str: ...

    @abc.abstractmethod
    def reset_prefix_cache_path(self) -> str: ...


FINISH_REASONS = ("stop", "length", "abort")


class VLLMServerAPI(ServerAPI):
    name = "vllm_server"

    def generate_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, salt: str
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else 0,
            # Explicit neutral values: the server would otherwise apply the model's generation_config.
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": list(sampling.stop_token_ids),
            "stop": list(sampling.stop),
            "seed": sampling.seed,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": True,
            "request_id": request_id,
            "cache_salt": salt,
        }
        return "/v1/completions", body

    def read_chunk(self, chunk: dict[str, Any], num_received: int) -> ChunkTokens:
        if "error" in chunk:
            raise ServerProtocolError(f"vLLM server error: {chunk['error']}")
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk after the last token
            return ChunkTokens(token_ids=[], logprobs=[])
        choice = choices[0]
        token_ids = list(choice.get("token_ids") or [])
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(token_ids) or any(lp is None for lp in logprobs):
            raise ServerProtocolError(
                f"vLLM chunk with {len(token_ids)} token ids and {len(logprobs)} logprobs: the server must "
                "support return_token_ids and logprobs (vLLM >= 0.10)"
            )
        prompt = choice.get("prompt_token_ids")
        return ChunkTokens(
            token_ids=token_ids,
            logprobs=[float(lp) for lp in logprobs],
            finish_reason=_finish(choice.get("finish_reason")),
            num_prompt_tokens=len(prompt) if prompt is not None else None,
        )

    def abort_request(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        return None  # vLLM aborts a streamed request when its connection closes

    def score_request(self, request_id: str, token_ids: list[int]) -> tuple[str, dict[str, Any]]:
        body = {
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,  # each position's own token, whatever its rank
            "stream": False,
            "request_id": request_id,
        }
        return "/v1/completions", body

    def read_scores(self, answer: dict[str, Any], token_ids: list[int], start: int) -> list[float]:
        choices = answer.get("choices") or []
        positions = choices[0].get("prompt_logprobs") if choices else None
        if positions is None or len(positions) != len(token_ids):
            raise ServerProtocolError(
                f"vLLM answered {None if positions is None else len(positions)} prompt log-probs for "
                f"{len(token_ids)} tokens (send prompt_logprobs)"
            )
        out = []
        for t in range(start, len(token_ids)):
            entry = (positions[t] or {}).get(str(token_ids[t]))  # JSON keys: the token ids as text
            if entry is None:
                raise ServerProtocolError(f"vLLM prompt log-probs of position {t} do not name its token")
            out.append(float(entry["logprob"]))
        return out

    def pause_request(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        return "/pause", {"mode": "abort", "clear_cache": "false"}, {}

    def resume_path(self) -> str:
        return "/resume"

    def reset_prefix_cache_path(self) -> str:
        return "/reset_prefix_cache"


class SGLangServerAPI(ServerAPI):
    name = "sglang_server"

    def generate_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, salt: str
    ) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        body = {
            "input_ids": list(prompt_ids),
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,  # logprobs of the output tokens only
            "stream": True,
            "rid": request_id,
        }
        return "/generate", body  # SGLang has no cache salt: a weight update flushes its cache

    def read_chunk(self, chunk: dict[str, Any], num_received: int) -> ChunkTokens:
        if "error" in chunk:
            raise ServerProtocolError(f"SGLang server error: {chunk['error']}")
        meta = chunk.get("meta_info")
        if meta is None or "completion_tokens" not in meta:
            raise ServerProtocolError(f"SGLang chunk without meta_info.completion_tokens: {sorted(chunk)}")
        total = int(meta["completion_tokens"])
        new = total - num_received
        output_ids = list(chunk.get("output_ids") or [])
        token_logprobs = meta.get("output_token_logprobs") or []
        if new < 0 or len(output_ids) < new or len(token_logprobs) < new:
            raise ServerProtocolError(
                f"SGLang chunk reports {total} tokens after {num_received} received, with {len(output_ids)} ids and "
                f"{len(token_logprobs)} logprobs (send return_logprob)"
            )
        ids = output_ids[len(output_ids) - new :] if new else []
        entries = token_logprobs[len(token_logprobs) - new :] if new else []
        if [int(e[1]) for e in entries] != ids:
            raise ServerProtocolError("SGLang output_token_logprobs do not name the output ids")
        reason = meta.get("finish_reason")
        return ChunkTokens(
            token_ids=ids,
            logprobs=[float(e[0]) for e in entries],
            finish_reason=_finish(reason.get("type") if isinstance(reason, dict) else reason),
            num_prompt_tokens=meta.get("prompt_tokens"),
            num_cached_tokens=meta.get("cached_tokens"),
        )

    def abort_request(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        return "/abort_request", {"rid": request_id}

    def pause_request(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        return "/pause_generation", {}, {"mode": "abort"}

    def resume_path(self) -> str:
        return "/continue_generation"

    def reset_prefix_cache_path(self) -> str:
        return "/flush_cache"

    def update_weights_request(self, folder: str, policy_version: int) -> tuple[str, dict[str, Any]]:
        return "/update_weights_from_disk", {
            "model_path": folder,
            "weight_version": str(policy_version),
            "flush_cache": True,
        }


def _finish(reason: Any) -> str | None:
    if reason is None:
        return None
    if reason not in FINISH_REASONS:
        raise ServerProtocolError(f"unknown finish reason {reason!r}")
    return str(reason)


def server_api(backend: str) -> ServerAPI:
    if backend == "vllm_server":
        return VLLMServerAPI()
    if backend == "sglang_server":
        return SGLangServerAPI()
    raise ValueError(f"no server API for backend {backend!r}")
