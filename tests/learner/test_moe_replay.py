"""Routing replay in the learner's forward (tiny Qwen3-MoE, CPU): exact when the recorded routes are
the live ones, different otherwise, router weights still trained, and unchanged by gradient
checkpointing, micro-batching and the shared-prompt packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.learner.model import PolicyModel, load_lm
from streamrl.learner.moe_replay import replay_topk
from streamrl.learner.shared_prefix import Segment, packed_forward
from streamrl.learner.types import TrainBatch
from tests.learner.helpers import padded_batch


@pytest.fixture(scope="module")
def moe_path():
    from streamrl.models import resolve_model

    return resolve_model("tiny-moe")


def policy(path, *, checkpointing: bool = False) -> PolicyModel:
    return PolicyModel(load_lm(path, torch.device("cpu"), gradient_checkpointing=checkpointing), with_value_head=False)


def live_routes(model: PolicyModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [B, T, L, K]
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for r in model.route_replay.routers]
    with torch.no_grad():
        model(ids, mask)
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1).reshape(*ids.shape, len(seen), -1)


def batch(seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(5, 590, 6).tolist()
    rows = [(prompt, rng.integers(5, 590, n).tolist(), [1] * n) for n in (9, 5, 7)]
    return TrainBatch.from_padded(padded_batch(rows, rewards=[1.0, 0.0, 0.5], group_index=[0, 0, 0]))


def loss_and_grads(model: PolicyModel, tb: TrainBatch, routes: torch.Tensor | None) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    out = model(tb.input_ids, tb.attention_mask, routes=routes)
    loss = -(out.logp * tb.loss_mask).sum()
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replay_topk_uses_recorded_experts_with_live_softmax_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]], requires_grad=True)
    recorded = torch.tensor([[2, 3], [-1, -1]])
    weights, idx = replay_topk(logits, recorded, 2, normalize=True)
    assert idx.tolist() == [[2, 3], [1, 3]]  # row 1 has no record: live top-2
    probs = torch.softmax(logits.detach(), -1)
    assert torch.allclose(weights[0], probs[0, [2, 3]] / probs[0, [2, 3]].sum())
    weights.sum().backward()  # renormalised weights sum to 1 per row: the gradient flows but sums to 0
    assert logits.grad is not None
    with pytest.raises(ValueError, match="num_experts"):
        replay_topk(logits, torch.tensor([[4, 0], [0, 1]]), 2, normalize=True)


def test_replaying_the_live_routes_is_exact_and_other_routes_change_the_forward(moe_path):
    model, tb = policy(moe_path), batch()
    live = live_routes(model, tb.input_ids, tb.attention_mask)
    base_loss, base_grads = loss_and_grads(model, tb, None)
    loss, grads = loss_and_grads(model, tb, live)
    assert loss == base_loss
    assert grads.keys() == base_grads.keys() and all(torch.equal(grads[n], base_grads[n]) for n in grads)
    other = (live + 1) % 4  # the same k-set shifted: every token goes through other experts
    other_loss, _ = loss_and_grads(model, tb, other)
    assert abs(other_loss - base_loss) > 1e-3
    partial = live.clone()
    partial[:, :4] = -1  # unknown positions route live: the same as the live routes there
    assert loss_and_grads(model, tb, partial)[0] == base_loss


def test_router_weights_get_gradients_under_replay(moe_path):
    model, tb = policy(moe_path), batch(1)
    other = (live_routes(model, tb.input_ids, tb.attention_mask) + 2) % 4
    _, grads = loss_and_grads(model, tb, other)
    gates = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert len(gates) == 2 and all(float(grads[n].abs().sum()) > 0 for n in gates)


def test_gradient_checkpointing_recomputes_with_the_replayed_routes(moe_path):
    """Backward recomputes each layer after the forward's route context has closed: it must still
    route through the recorded experts (else the gradients are those of the live routes)."""
    plain, checkpointed, tb = policy(moe_path), policy(moe_path, checkpointing=True), batch(2)
    checkpointed.train()
    other = (live_routes(plain, tb.input_ids, tb.attention_mask) + 1) % 4
    loss_a, grads_a = loss_and_grads(plain, tb, other)
    loss_b, grads_b = loss_and_grads(checkpointed, tb, other)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], atol=1e-6), name


def test_shared_prompt_packing_and_micro_batches_replay_each_rows_routes(moe_path):
    model, tb = policy(moe_path), batch(3)
    routes = (live_routes(model, tb.input_ids, tb.attention_mask) + 1) % 4
    routes[tb.attention_mask == 0] = -1
    tb.routed_experts = routes
    with torch.no_grad():
        dense = model(tb.input_ids, tb.attention_mask, routes=routes).logp
        packed = packed_forward(model, tb, [Segment(rows=(0, 1, 2), prefix_len=6, num_tokens=6 + 9 + 5 + 7)]).logp
        one = tb.select(torch.tensor([1]))  # a micro-batch of one row keeps that row's routes
        single = model(one.input_ids, one.attention_mask, routes=one.routed_experts).logp
    mask = tb.loss_mask.bool()
    assert torch.allclose(dense[mask], packed[mask], atol=1e-5)
    assert torch.allclose(single[0], dense[1, : single.shape[1]], atol=1e-5)


def test_bad_routes_are_refused(moe_path):
    model, tb = policy(moe_path), batch()
    with pytest.raises(ValueError, match="MoE layers"):
        model(tb.input_ids, tb.attention_mask, routes=torch.zeros(*tb.input_ids.shape, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="routed_experts"):
        TrainBatch(
            **{**{f: getattr(tb, f) for f in tb.__slots__}, "routed_experts": torch.zeros(1, 2, 2, 2)}
        ).validate()
