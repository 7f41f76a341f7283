"""A GRPO group's shared prompt, forwarded once: the packing behind `learner.shared_prefix`.

The rows of a group are one prompt and `group_size` responses. The dense forward runs the prompt
once per row, in forward and again in backward; here each group becomes one packed row — the prompt
once, then every row's continuation (response, and in multi-turn rows the observations and later
turns) after it — and one 4-D attention mask lets each continuation see the prompt and itself, never
another continuation. Position ids restart at the prompt's length for every continuation, so each
token sees exactly the keys, values and rotary positions it sees in the dense forward: the log-probs,
entropies, values and gradients are the dense ones up to floating-point summation order. The prompt's
activations are built once and their gradient sums the continuations' contributions, as autograd
does for any reused tensor. This is the packed equivalent of forwarding the prompt once and the
continuations against its cached keys and values; HF drops `past_key_values` under gradient
checkpointing in train mode, so a cache-based version would silently attend to nothing.

Which rows share (`plan_segments`): a group whose rows have the same prompt, token for token
(`TrainBatch.prompt_lens`, else the tokens before each row's first loss token); only that prompt is
shared, never a response token. A group whose rows differ there, and a lone row, stay rows of their
own (a segment of one row, forwarded whole — what the dense path computes). Micro-batching: a packed
group counts its tokens as forwarded (prompt once + continuations) against `micro_batch_tokens`; a
group larger than that is cut into chunks of rows, each chunk repeating the prompt (the prompt is then
computed once per chunk). Segments are packed into micro-batches like rows (`pack_by_tokens`).

The shared prompt's own positions are not scored: the packed forward returns log-prob, entropy and
value 0 there, as on padding. They carry no loss (the prefix ends before every row's first sampled
token), so the step's losses and gradients are unchanged. The no-grad passes (`compute_logprobs`, the
start-of-step pass of `learner.step_inputs`) stay dense: their callers read every position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from streamrl.learner.model import ForwardOut, PackedTokens, pack_by_tokens

if TYPE_CHECKING:
    from streamrl.learner.model import PolicyModel
    from streamrl.learner.types import TrainBatch

# attention implementations that take an arbitrary 4-D mask (bool for SDPA, additive for eager)
PACKABLE_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Rows forwarded as one packed row. `prefix_len > 0`: rows of one group whose first `prefix_len`
    tokens (their prompt) are equal, packed as the prefix once and each row's tokens after it;
    `prefix_len == 0`: a single row, forwarded whole."""

    rows: tuple[int, ...]  # [num_rows] row indices into the batch the segment was planned on
    prefix_len: int
    num_tokens: int  # tokens forwarded: prefix_len + Σ (seq_len − prefix_len)

    @property
    def is_shared(self) -> bool:
        return self.prefix_len > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchPlan:
    """One micro-batch of the training pass: its batch rows and its segments, whose `rows` index
    positions in `rows` (0 … len(rows) − 1), in the order `TrainBatch.select(rows)` puts them."""

    rows: torch.Tensor  # [b] int64 batch row indices
    segments: tuple[Segment, ...]

    @property
    def is_shared(self) -> bool:
        """Whether any group in it shares a prompt (else the dense forward computes it as is)."""
        return any(s.is_shared for s in self.segments)


def prompt_lens(batch: TrainBatch) -> list[int]:
    """[B] each row's prompt: `prompt_lens` capped at the first loss token (tokens before the first
    loss token when the batch has no prompt lengths). Nothing sampled is ever part of a prefix."""
    width = batch.input_ids.shape[1]
    loss = batch.loss_mask != 0
    first_loss = torch.where(loss.any(1), loss.int().argmax(1), torch.full_like(batch.seq_lens, width))
    lens = first_loss if batch.prompt_lens is None else torch.minimum(batch.prompt_lens, first_loss)
    return lens.tolist()


def shared_prompt_len(batch: TrainBatch, rows: Sequence[int], prompts: Sequence[int]) -> int:
    """The prompt length every row of `rows` shares token for token (`prompts`: `prompt_lens(batch)`),
    0 when they differ in length or tokens, when fewer than two rows, or when a row has nothing after it."""
    if len(rows) < 2:
        return 0
    length = prompts[rows[0]]
    seq_lens = batch.seq_lens[list(rows)].tolist()
    if length < 1 or any(prompts[r] != length for r in rows) or min(seq_lens) <= length:
        return 0
    ids = batch.input_ids[list(rows), :length]
    return length if bool((ids == ids[:1]).all()) else 0


def plan_segments(batch: TrainBatch, rows: Sequence[int], budget: int) -> list[Segment]:
    """`rows` as segments: each group sharing its prompt packed (cut into chunks of at most `budget`
    forwarded tokens, longest rows first, each chunk repeating the prompt), every other row alone."""
    prompts = prompt_lens(batch)
    seq_lens = batch.seq_lens.tolist()
    groups: dict[int, list[int]] = {}
    for r in rows:
        groups.setdefault(int(batch.group_index[r]), []).append(r)
    segments: list[Segment] = []
    for members in groups.values():
        prefix = shared_prompt_len(batch, members, prompts)
        if prefix == 0:
            segments += [Segment(rows=(r,), prefix_len=0, num_tokens=seq_lens[r]) for r in members]
            continue
        chunks: list[list[int]] = []
        size = budget + 1  # no chunk open yet
        for r in sorted(members, key=lambda r: (-seq_lens[r], r)):
            tail = seq_lens[r] - prefix
            if size + tail > budget:
                chunks.append([])
                size = prefix
            chunks[-1].append(r)
            size += tail
        for chunk in chunks:
            if len(chunk) == 1:
                segments.append(Segment(rows=(chunk[0],), prefix_len=0, num_tokens=seq_lens[chunk[0]]))
            else:
                tokens = prefix + sum(seq_lens[r] - prefix for r in chunk)
                segments.append(Segment(rows=tuple(chunk), prefix_len=prefix, num_tokens=tokens))
    return segments


def plan_micro_batches(batch: TrainBatch, rows: torch.Tensor, budget: int) -> list[MicroBatchPlan]:
    """The training pass's micro-batches over `rows`: segments packed like rows by `pack_by_tokens`
    (segments × longest ≤ budget). Without a shared prompt this is `pack_by_tokens` on the rows."""
    segments = plan_segments(batch, rows.tolist(), budget)
    plans = []
    for members in pack_by_tokens([s.num_tokens for s in segments], budget):
        picked = [segments[i] for i in members]
        flat = [r for s in picked for r in s.rows]
        local, start = [], 0
        for s in picked:
            local.append(
                Segment(rows=tuple(range(start, start + len(s.rows))), prefix_len=s.prefix_len, num_tokens=s.num_tokens)
            )
            start += len(s.rows)
        plans.append(MicroBatchPlan(rows=torch.tensor(flat, dtype=torch.long), segments=tuple(local)))
    return plans


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedLayout:
    """Segments laid out as packed rows, and where each scored token's hidden state is.

    Packed row s holds segment s: its prefix (branch 0), then each row's continuation (branch 1, 2, …);
    padding has branch −1 and position 0. Token (row, t) of the micro-batch, t ≥ max(prefix_len, 1), is
    scored from the packed position of (row, t − 1): in the prefix when t − 1 < prefix_len."""

    input_ids: torch.Tensor  # [S, W] int64
    position_ids: torch.Tensor  # [S, W] int64
    branch: torch.Tensor  # [S, W] int64
    source: torch.Tensor  # [N] flat index into [S·W] of each scored token's hidden state
    targets: torch.Tensor  # [N] the scored token ids
    out_row: torch.Tensor  # [N] micro-batch row of each scored token
    out_col: torch.Tensor  # [N] its position in the row
    # [S, W, num_moe_layers, top_k] recorded routes laid out like `input_ids` (-1: padding, live); None: none
    routes: torch.Tensor | None = None

    @classmethod
    def build(cls, mb: TrainBatch, segments: Sequence[Segment]) -> PackedLayout:
        device = mb.input_ids.device
        width = max(s.num_tokens for s in segments)
        ids = torch.zeros(len(segments), width, dtype=torch.long, device=device)
        pos = torch.zeros_like(ids)
        branch = torch.full_like(ids, -1)
        source, targets, out_row, out_col = [], [], [], []
        seq_lens = mb.seq_lens.tolist()
        recorded = mb.routed_experts
        routes = None if recorded is None else recorded.new_full((len(segments), width, *recorded.shape[2:]), -1)
        for s, seg in enumerate(segments):
            p = seg.prefix_len
            ids[s, :p] = mb.input_ids[seg.rows[0], :p]
            if routes is not None:
                assert recorded is not None
                routes[s, :p] = recorded[seg.rows[0], :p]
            pos[s, :p] = torch.arange(p, device=device)
            branch[s, :p] = 0
            start = p
            for b, r in enumerate(seg.rows, start=1):
                n = seq_lens[r]
                ids[s, start : start + n - p] = mb.input_ids[r, p:n]
                if routes is not None:
                    assert recorded is not None
                    routes[s, start : start + n - p] = recorded[r, p:n]
                pos[s, start : start + n - p] = torch.arange(p, n, device=device)
                branch[s, start : start + n - p] = b
                cols = torch.arange(max(p, 1), n, device=device)  # tokens scored
                prev = cols - 1  # their hidden state's position in the row
                packed = torch.where(prev < p, prev, start + prev - p)
                source.append(s * width + packed)
                targets.append(mb.input_ids[r, cols])
                out_row.append(torch.full_like(cols, r))
                out_col.append(cols)
                start += n - p
            assert start == seg.num_tokens, (start, seg)
        return cls(
            input_ids=ids,
            position_ids=pos,
            branch=branch,
            source=torch.cat(source),
            targets=torch.cat(targets),
            out_row=torch.cat(out_row),
            out_col=torch.cat(out_col),
            routes=routes,
        )

    def attention_mask(self, implementation: str, dtype: torch.dtype) -> torch.Tensor:  # [S, 1, W, W]
        """Query q sees key k iff k is not after q and k is in q's branch or the prefix. A padding
        query sees the padding keys (never a whole row masked, so no NaN to leak into backward)."""
        q_pos, k_pos = self.position_ids[:, :, None], self.position_ids[:, None, :]
        q_branch, k_branch = self.branch[:, :, None], self.branch[:, None, :]
        allowed = (k_pos <= q_pos) & ((k_branch == q_branch) | (k_branch == 0))
        allowed = allowed[:, None]
        if implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )


def check_packable(policy: PolicyModel) -> None:
    """ValueError unless the policy's attention takes the packed 4-D mask and attends fully."""
    config = policy.lm.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in PACKABLE_ATTENTION:
        raise ValueError(
            f"learner.shared_prefix needs attention that takes a 4-D mask ({', '.join(PACKABLE_ATTENTION)}); "
            f"the model uses {implementation!r}: set learner.shared_prefix = false"
        )
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if set(layer_types) != {"full_attention"}:
        raise ValueError(
            f"learner.shared_prefix packs with full causal attention; the model has layers {sorted(set(layer_types))}: "
            "set learner.shared_prefix = false"
        )


def packed_forward(
    policy: PolicyModel,
    mb: TrainBatch,
    segments: Sequence[Segment],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
) -> ForwardOut:
    """`policy(mb.input_ids, mb.attention_mask, ...)` with each segment's prefix forwarded once:
    [b, T] log-probs, entropies and values as the dense forward gives them, 0 on the shared prompts
    (which carry no loss) and on padding."""
    if mb.images is not None and any(r is not None and r.num_images for r in mb.images):
        raise ValueError("learner.shared_prefix packs text only: this micro-batch has images")
    layout = PackedLayout.build(mb, segments)
    implementation = str(policy.lm.config._attn_implementation)  # checked at engine start: sdpa or eager
    dtype = next(policy.parameters()).dtype
    flat = policy(
        layout.input_ids,
        layout.attention_mask(implementation, dtype),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        packed=PackedTokens(position_ids=layout.position_ids, source=layout.source, targets=layout.targets),
        routes=layout.routes,
    )

    def place(scored: torch.Tensor) -> torch.Tensor:  # [N] → [b, T]
        return scored.new_zeros(mb.input_ids.shape).index_put((layout.out_row, layout.out_col), scored)

    return ForwardOut(
        logp=place(flat.logp),
        entropy=None if flat.entropy is None else place(flat.entropy),
        values=None if flat.values is None else place(flat.values),
    )
