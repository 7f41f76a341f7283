"""The trainable module: a HF causal LM plus (PPO) a scalar value head on its last hidden state,
and the micro-batch packing both the training pass and the log-prob recompute use.

`PolicyModel.forward` returns per-token log-probs, entropies and values already shifted to the
token they score (position t is predicted from the hidden state at t − 1), so everything downstream
works on [B, T] tensors aligned with `input_ids`.

A vision-language model (an image-text-to-text HF model, e.g. Idefics3) runs its full multimodal
base model — vision tower, connector, image features scattered into the placeholder positions, text
decoder — on the rows' pixels (`learner.vision`), then the same LM head; a text-only LM runs its
decoder alone. Either way the head sees [B, T, H] hidden states aligned with `input_ids`.

An MoE policy replays the engine's routes (`routes`, [B, T, num_moe_layers, top_k]) through its
routers (`learner.moe_replay`); a dense one has no `route_replay` and takes no routes.

Memory: full-vocabulary logits are the largest tensors of a step ([B, T, V] float32: 0.8 GB for
4096 tokens of a 49k vocabulary, and autograd keeps several of them for backward). With
`logits_chunk_tokens > 0` the LM head runs on chunks of that many token positions
(`chunked_token_logprobs_and_entropy`), each under activation checkpointing, so forward and
backward hold one chunk's logits at a time and nothing vocabulary-sized survives to backward.
Where the head is a plain bias-free Linear outside autocast (CPU fp32, one process) the chunks run
as one autograd function (`learner.lm_head`) that also keeps a single weight gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from streamrl.learner.lm_head import chunked_head_logprobs, fused_head_applies
from streamrl.learner.losses import token_logprobs_and_entropy
from streamrl.learner.moe_replay import RouteReplay, enable_replay_checkpointing
from streamrl.learner.vision import collate_images, is_vision_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from streamrl.learner.vision import RowImages

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ForwardOut:
    logp: torch.Tensor  # [B, T] log π(token t | prefix), 0 at t = 0
    entropy: torch.Tensor | None  # [B, T]
    values: torch.Tensor | None  # [B, T] V(prefix before token t), 0 at t = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedTokens:
    """A packed forward's layout (`learner.shared_prefix`): the positions rotary embeddings use, and
    which tokens are scored — hidden state `source[n]` (flat over [B·T]) scores token `targets[n]`.
    With it, `attention_mask` is a 4-D mask and `PolicyModel.forward` returns [N] tensors."""

    position_ids: torch.Tensor  # [B, T]
    source: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]


class PolicyModel(nn.Module):
    """HF causal LM or image-text-to-text model `lm` + optional `value_head` (Linear(hidden, 1),
    zero-initialised)."""

    def __init__(self, lm: PreTrainedModel, *, with_value_head: bool, logits_chunk_tokens: int = 0) -> None:
        super().__init__()
        self.lm = lm
        self.logits_chunk_tokens = logits_chunk_tokens  # 0: one [B, T, V] logits tensor (no chunking)
        # chunks as one function with one weight gradient (learner.lm_head); off once FSDP manages the
        # head's weight: its gather and gradient reduction hook the head module's own calls
        self.fused_head = True
        self.is_vision = is_vision_config(lm.config)
        # wraps the routers of an MoE model so a forward can replay recorded routes; None for a dense model
        self.route_replay = RouteReplay.attach(lm)
        if self.route_replay is not None and getattr(lm, "is_gradient_checkpointing", False):
            enable_replay_checkpointing(lm, self.route_replay)  # recomputed layers replay their routes too
        hidden = lm.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1) if with_value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]; [B, 1, T, T] with `packed`
        *,
        images: Sequence[RowImages | None] | None = None,  # [B] (learner.vision); None: text only
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_requires_grad: bool = True,
        packed: PackedTokens | None = None,
        routes: torch.Tensor | None = None,  # [B, T, num_moe_layers, top_k] expert ids to replay, -1 = live
    ) -> ForwardOut:
        """Log-probs, entropies and values of every token ([B, T]), or with `packed` of the tokens it
        names ([N]: one module call either way, so FSDP's root hooks gather embeddings and heads)."""
        if routes is not None and self.route_replay is None:
            raise ValueError("routes given for a model without MoE routers (a dense policy replays nothing)")
        if self.route_replay is not None:
            with self.route_replay.routes(routes):
                return self._forward(
                    input_ids, attention_mask, images, temperature, with_entropy, entropy_requires_grad, packed
                )
        return self._forward(
            input_ids, attention_mask, images, temperature, with_entropy, entropy_requires_grad, packed
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        images: Sequence[RowImages | None] | None,
        temperature: float,
        with_entropy: bool,
        entropy_requires_grad: bool,
        packed: PackedTokens | None,
    ) -> ForwardOut:
        if packed is not None:
            return self._packed_forward(
                input_ids, attention_mask, packed, temperature, with_entropy, entropy_requires_grad
            )
        hidden = self.hidden_states(input_ids, attention_mask, images)
        head = self.output_head()
        score = dict(temperature=temperature, with_entropy=with_entropy, entropy_requires_grad=entropy_requires_grad)
        if self.logits_chunk_tokens > 0:
            logp, entropy = chunked_token_logprobs_and_entropy(
                hidden, head, input_ids, chunk_tokens=self.logits_chunk_tokens, fused=self.fused_head, **score
            )
        else:
            logp, entropy = token_logprobs_and_entropy(head(hidden), input_ids, **score)
        values = None
        if self.value_head is not None:
            v = self.value_head(hidden[:, :-1]).squeeze(-1).float()
            values = nn.functional.pad(v, (1, 0))
        return ForwardOut(logp=logp, entropy=entropy, values=values)

    def _packed_forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, 1, T, T]
        packed: PackedTokens,
        temperature: float,
        with_entropy: bool,
        entropy_requires_grad: bool,
    ) -> ForwardOut:  # [N] each
        if self.is_vision:
            raise ValueError("a packed forward is text only: the vision-language model's rows need their pixels")
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=packed.position_ids
        ).last_hidden_state
        src = hidden.reshape(-1, hidden.shape[-1])[packed.source]  # [N, H]
        logp, entropy = score_positions(
            src,
            self.output_head(),
            packed.targets,
            chunk_tokens=self.logits_chunk_tokens or max(src.shape[0], 1),
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
            fused=self.fused_head,
        )
        values = self.value_head(src).squeeze(-1).float() if self.value_head is not None else None
        return ForwardOut(logp=logp, entropy=entropy, values=values)

    def output_head(self) -> nn.Module:
        """The LM head, called as a module (per chunk) so FSDP2 hooks see it and its weight is unsharded."""
        head = self.lm.get_output_embeddings()
        if head is None:  # as calling None would, but saying what is missing
            raise TypeError(f"{type(self.lm).__name__} has no output embeddings (LM head) to score tokens with")
        return head

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: Sequence[RowImages | None] | None
    ) -> torch.Tensor:  # [B, T, H] last hidden states
        if not self.is_vision:
            if images is not None and any(r is not None and r.num_images for r in images):
                raise ValueError(f"batch has images but the model ({type(self.lm).__name__}) has no vision tower")
            return self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if images is not None and len(images) != input_ids.shape[0]:
            raise ValueError(f"images for {len(images)} rows, input_ids has {input_ids.shape[0]}")
        vision = collate_images(images or [], self.lm.config.model_type)
        return self.lm.model(input_ids=input_ids, attention_mask=attention_mask, **vision).last_hidden_state


def chunked_token_logprobs_and_entropy(
    hidden: torch.Tensor,  # [B, T, H] last hidden states
    head: nn.Module,  # hidden → logits (the LM head)
    input_ids: torch.Tensor,  # [B, T]
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_requires_grad: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, T] each
    """`token_logprobs_and_entropy(head(hidden), input_ids, ...)` without the [B, T, V] logits: the
    B·(T − 1) scoring positions (hidden at t − 1 scores token t) go through `score_positions`."""
    batch, width, dim = hidden.shape
    logp, entropy = score_positions(
        hidden[:, :-1].reshape(-1, dim),
        head,
        input_ids[:, 1:].reshape(-1),
        chunk_tokens=chunk_tokens,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        fused=fused,
    )

    def assemble(flat: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(flat.view(batch, width - 1), (1, 0))

    return assemble(logp), assemble(entropy) if entropy is not None else None


def score_positions(
    src: torch.Tensor,  # [N, H] hidden states of the scoring positions
    head: nn.Module,  # hidden → logits (the LM head)
    targets: torch.Tensor,  # [N] the token each position scores
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_requires_grad: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [N] float32 each; entropy None without `with_entropy`
    """log softmax(head(src) / τ)[targets] (and the entropy), `chunk_tokens` positions at a time.

    Each chunk runs head → log-softmax → gather (→ entropy) on its own. With grad enabled each chunk
    is checkpointed (non-reentrant): forward keeps only the chunk's hidden slice, backward recomputes
    the chunk's logits, so peak memory is one chunk's logits whatever N is. The entropy carries a
    graph only when `entropy_requires_grad`.
    """
    grad = torch.is_grad_enabled()
    entropy_grad = grad and entropy_requires_grad
    if grad and fused and fused_head_applies(head, src):  # one weight gradient instead of one per chunk
        return chunked_head_logprobs(
            src,
            head.weight,
            targets,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
        )

    def score(h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = head(h).float()  # [n, V]
        if temperature != 1.0:
            logits = logits / temperature
        logp_all = torch.log_softmax(logits, dim=-1)  # [n, V]
        del logits
        logp = torch.gather(logp_all, -1, ids[:, None]).squeeze(-1)
        if not with_entropy:
            return logp, None
        if entropy_grad:
            return logp, -(logp_all.exp() * logp_all).sum(-1)
        with torch.no_grad():  # metric-only: no graph, and one [n, V] temporary instead of two
            return logp, -logp_all.exp().mul_(logp_all).sum(-1)

    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, src.shape[0], chunk_tokens):
        h, ids = src[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if grad:
            logp, entropy = checkpoint(score, h, ids, use_reentrant=False, preserve_rng_state=False)
        else:
            logp, entropy = score(h, ids)
        logps.append(logp)
        if entropy is not None:
            entropies.append(entropy)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else src.new_zeros(0, dtype=torch.float32)

    return cat(logps), cat(entropies) if with_entropy else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """Mixed precision where the device has it: bf16 autocast on CUDA by default, fp32 on CPU."""
    if name == "float32" or (name == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def is_vision_model(path: Path) -> bool:
    """Whether the HF folder holds an image-text-to-text model (its config has a vision tower)."""
    from transformers import AutoConfig

    return is_vision_config(AutoConfig.from_pretrained(path))


def load_lm(path: Path, device: torch.device, *, gradient_checkpointing: bool = False) -> PreTrainedModel:
    """Load a HF folder as a float32 causal LM, or image-text-to-text model when its config has a
    vision tower (master weights stay fp32; autocast handles bf16)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
    lm = auto.from_pretrained(path, dtype=torch.float32)
    lm.config.use_cache = False
    if gradient_checkpointing:  # non-reentrant: composes with FSDP2 and the chunked LM head
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm.to(device)


def pack_by_tokens(seq_lens: list[int], budget: int) -> list[list[int]]:
    """Group row indices into micro-batches whose padded size (rows × longest row) ≤ budget.

    Longest rows first, greedy; a row longer than the budget gets a micro-batch of its own.
    Deterministic, so every rank and every epoch packs a given mini-batch the same way.
    """
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = seq_lens[current[0]] if current else seq_lens[i]
        if current and (len(current) + 1) * max(width, 1) > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def split_minibatches(batch_size: int, num_minibatches: int, generator: torch.Generator | None) -> list[torch.Tensor]:
    """Row indices of each mini-batch; shuffled with `generator` when one is given."""
    if batch_size < num_minibatches:
        raise ValueError(f"batch of {batch_size} sequences cannot split into {num_minibatches} mini-batches")
    perm = torch.randperm(batch_size, generator=generator) if generator is not None else torch.arange(batch_size)
    return list(torch.tensor_split(perm, num_minibatches))
