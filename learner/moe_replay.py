"""Routing replay: the training forward of an MoE policy routes each token through the experts the
engine routed it through when it generated the token.

Without it the learner's router re-decides every near-tied token, and a token whose engine and
learner experts differ gets a log-prob from another sub-network than the one that sampled it: the
importance ratios of those tokens are noise. With replay the expert *selection* comes from the
recorded routes (`TrainBatch.routed_experts`, [B, T, num_moe_layers, top_k]); the gating weights
are still the live router's softmax at those experts, so the router weights keep their gradient.
A token with no recorded route (-1: padding, a dense row, a prompt position the engine served from
its prefix cache without routes) is routed live, exactly as without replay.

`RouteReplay.attach(lm)` finds the HF top-k routers (Qwen2-MoE, Qwen3-MoE, Mixtral: softmax over
the router logits, top-k, optional renormalisation) and wraps their forward; a dense model has none
and gets no `RouteReplay`. `PolicyModel` sets the routes of one forward with `replay.routes(...)`;
with gradient checkpointing each checkpointed layer re-installs the routes it was first run with
when backward recomputes it (`checkpoint_contexts`, torch's `context_fn`), so the recomputation
routes as the forward did even after the `with` block has ended.

Layers are numbered in module order, the order vLLM records them in (both walk the decoder layers
in order, MoE layers only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# HF router classes with the softmax → top-k (→ renormalise) scheme `replay_topk` reproduces
SUPPORTED_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")


def replay_topk(
    router_logits: torch.Tensor,  # [N, E]
    recorded: torch.Tensor | None,  # [N, K] int64 expert ids, a row of -1 = route live
    top_k: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, K] float32, indices [N, K] int64
    """The experts of each token — the recorded ones where present, else the live top-k — and their
    gating weights from the live softmax (renormalised over the k when `normalize`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    _, live = torch.topk(probs, top_k, dim=-1)
    if recorded is None:
        indices = live
    else:
        if recorded.shape != live.shape:
            raise ValueError(f"recorded routes {tuple(recorded.shape)} for router output {tuple(live.shape)}")
        use = (recorded >= 0).all(-1, keepdim=True)
        if bool((recorded[use.expand_as(recorded)] >= router_logits.shape[-1]).any()):
            raise ValueError(f"recorded expert id >= num_experts {router_logits.shape[-1]}")
        indices = torch.where(use, recorded.clamp(min=0), live)
    weights = probs.gather(-1, indices)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, indices


class RouteReplay:
    """The routers of one HF MoE model, wrapped to replay the routes set for the current forward."""

    def __init__(self, routers: list[Any]) -> None:  # HF router modules (top_k, hidden_dim, weight)
        self.routers = routers
        self.num_layers = len(routers)
        self.top_k = int(routers[0].top_k)
        self.current: torch.Tensor | None = None  # [N, L, K] routes of the forward running now
        for layer, router in enumerate(routers):
            router.forward = self._forward_of(router, layer)  # instance attribute: shadows the class forward

    @classmethod
    def attach(cls, lm: nn.Module) -> RouteReplay | None:
        """Wrap `lm`'s routers; None for a model without MoE routers. ValueError for an MoE router
        of an unknown scheme (replay would silently not apply)."""
        routers = [m for m in lm.modules() if type(m).__name__ in SUPPORTED_ROUTERS]
        unknown = {type(m).__name__ for m in lm.modules() if type(m).__name__.endswith("Router")} - set(
            SUPPORTED_ROUTERS
        )
        if unknown:
            raise ValueError(f"routing replay supports {SUPPORTED_ROUTERS}; the model has {sorted(unknown)}")
        return cls(routers) if routers else None

    def _forward_of(self, router: Any, layer: int) -> Any:
        normalize = bool(getattr(router, "norm_topk_prob", True))  # Mixtral always renormalises

        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden_states = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden_states, router.weight)  # [N, E]
            recorded = None if self.current is None else self.current[:, layer]
            weights, indices = replay_topk(logits, recorded, router.top_k, normalize)
            return logits, weights.to(logits.dtype), indices

        return forward

    def check(self, routes: torch.Tensor) -> None:
        if routes.dim() != 4 or routes.shape[2:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"routes must be [B, T, {self.num_layers} MoE layers, top_k {self.top_k}], got {tuple(routes.shape)}"
            )

    def routes(self, routes: torch.Tensor | None) -> contextlib.AbstractContextManager[None]:
        """Replay `routes` ([B, T, L, K], aligned with the forward's input_ids) in the forward run
        inside; None routes every token live."""
        if routes is not None:
            self.check(routes)
            routes = routes.reshape(-1, self.num_layers, self.top_k).long()
        return self._installed(routes)

    @contextlib.contextmanager
    def _installed(self, routes: torch.Tensor | None) -> Iterator[None]:
        previous, self.current = self.current, routes
        try:
            yield
        finally:
            self.current = previous

    def checkpoint_contexts(self) -> tuple[Any, Any]:
        """torch checkpoint's `context_fn`: nothing around the forward, and around backward's
        recomputation the routes that were current when the layer first ran."""
        return contextlib.nullcontext(), self._installed(self.current)


def enable_replay_checkpointing(lm: Any, replay: RouteReplay) -> None:
    """(Re-)enable non-reentrant gradient checkpointing so recomputed layers replay their routes."""
    lm.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": replay.checkpoint_contexts}
    )
