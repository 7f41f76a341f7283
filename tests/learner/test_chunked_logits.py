"""Chunked LM head (`learner.logits_chunk_tokens`): the same log-probs, entropies and gradients as the
one-tensor path, for chunk sizes that divide the positions, do not, and exceed them; and a train
step with activation checkpointing on top."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from streamrl.learner.model import PolicyModel, load_lm
from tests.learner.test_engine import _batch

pytestmark = pytest.mark.timeout(120)

CHUNKS = [1, 7, 16, 33, 10_000]  # B·(T − 1) = 3·11 = 33 scoring positions below


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, as the learner's batches have
    mask[2, 5:] = 0
    return ids, mask


def _models(tiny_model_path, tied: bool) -> tuple[PolicyModel, PolicyModel]:
    """Two copies of one policy: unchunked and (chunk set per test) chunked."""
    lm = load_lm(tiny_model_path, torch.device("cpu"))
    if not tied:  # an LM head of its own (as in untied checkpoints)
        from transformers import AutoModelForCausalLM

        config = lm.config
        config.tie_word_embeddings = False
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(config)
    copy = load_lm(tiny_model_path, torch.device("cpu")) if tied else AutoModelForCausalLM.from_config(lm.config)
    copy.load_state_dict(lm.state_dict())
    return PolicyModel(lm, with_value_head=True), PolicyModel(copy, with_value_head=True)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_logprobs_entropy_and_grads_match(tiny_model_path, chunk, tied):
    ref, chunked = _models(tiny_model_path, tied)
    chunked.logits_chunk_tokens = chunk
    ids, mask = _inputs(ref.lm.config.vocab_size)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (ref, chunked):
        out = model(ids, mask, temperature=0.7, with_entropy=True, entropy_requires_grad=True)
        loss = (out.logp * weights * mask).sum() - 0.3 * (out.entropy * mask).sum() + (out.values * mask).sum()
        loss.backward()
        outs.append(out)
    a, b = outs
    assert b.logp.shape == a.logp.shape == ids.shape and b.entropy.shape == ids.shape
    assert torch.all(b.logp[:, 0] == 0) and torch.all(b.entropy[:, 0] == 0)
    assert torch.allclose(a.logp, b.logp, atol=1e-5) and torch.allclose(a.entropy, b.entropy, atol=1e-5)
    assert torch.allclose(a.values, b.values)
    ga, gb = _grads(ref), _grads(chunked)
    assert set(ga) == set(gb) and len(ga) > 0
    for k in ga:
        # fp32 sums in another order (one token per chunk): one embedding-gradient element was off by
        # 6.5e-6 on torch 2.13 CPU; 1e-5 is still 1e-6 of the largest gradient (about 12)
        assert torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-5), k


def test_entropy_without_grad_and_without_entropy(tiny_model_path):
    ref, chunked = _models(tiny_model_path, tied=True)
    chunked.logits_chunk_tokens = 5
    ids, mask = _inputs(ref.lm.config.vocab_size)
    for model in (ref, chunked):
        out = model(ids, mask, with_entropy=True, entropy_requires_grad=False)
        assert out.logp.requires_grad and not out.entropy.requires_grad  # metric only: no graph
        out.logp.sum().backward()
    ga, gb = _grads(ref), _grads(chunked)
    assert all(torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-6) for k in ga)
    assert chunked(ids, mask, with_entropy=False).entropy is None
    with torch.no_grad():  # the no-grad pass (π_prox, reference) takes the same path without checkpoints
        a, b = ref(ids, mask, temperature=2.0), chunked(ids, mask, temperature=2.0)
    assert not b.logp.requires_grad and torch.allclose(a.logp, b.logp, atol=1e-5)


def test_chunked_under_bf16_autocast(tiny_model_path):
    ref, chunked = _models(tiny_model_path, tied=True)
    chunked.logits_chunk_tokens = 8
    ids, mask = _inputs(ref.lm.config.vocab_size)
    outs = []
    for model in (ref, chunked):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, mask, with_entropy=True)
        assert out.logp.dtype == torch.float32  # log-softmax in fp32 whatever the compute dtype
        (out.logp * mask).sum().backward()
        outs.append(out)
    assert torch.allclose(outs[0].logp, outs[1].logp, atol=1e-3)
    ga, gb = _grads(ref), _grads(chunked)
    for k in ga:  # the head's weight gradient sums bf16 products chunk by chunk: rounding differs
        assert (ga[k] - gb[k]).norm() <= 1e-2 * ga[k].norm() + 1e-6, k


def _engine(**kw) -> TrainingEngine:
    base = dict(
        model="tiny",
        device="cpu",
        lr=1e-3,
        micro_batch_tokens=64,
        seed=3,
        algo="ppo",
        entropy_coef=0.01,
        correction={"mode": "decoupled", "prox": "recompute"},
    )
    return TrainingEngine(LearnerConfig(**(base | kw)))


def test_train_step_same_with_chunks_and_activation_checkpointing():
    """One-tensor logits vs chunked vs chunked + activation checkpointing: the same step."""
    engines = [
        _engine(logits_chunk_tokens=0),
        _engine(logits_chunk_tokens=6),
        _engine(logits_chunk_tokens=6, gradient_checkpointing=True),
    ]
    assert engines[2].policy.lm.is_gradient_checkpointing
    metrics = [e.train_step(_batch()) for e in engines]
    for m, e in zip(metrics[1:], engines[1:]):
        assert m["learner/loss"] == pytest.approx(metrics[0]["learner/loss"], rel=1e-4, abs=1e-6)
        assert m["learner/entropy"] == pytest.approx(metrics[0]["learner/entropy"], rel=1e-5)
        assert m["learner/grad_norm"] == pytest.approx(metrics[0]["learner/grad_norm"], rel=1e-4)
        ga, gb = _grads(engines[0].policy), _grads(e.policy)
        assert all(torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-7) for k in ga)
    second = engines[2].train_step(_batch(versions=(1, 1, 0, 1), seed=1))  # and keeps training
    assert second["learner/policy_version"] == 2.0 and second["learner/loss"] == second["learner/loss"]


@pytest.mark.parametrize("with_entropy,entropy_grad", [(True, True), (True, False), (False, False)])
def test_fused_head_gradients_are_exact(with_entropy, entropy_grad):
    """`learner.lm_head`'s hand-written backward against finite differences (float64)."""
    from streamrl.learner.lm_head import chunked_head_logprobs

    g = torch.Generator().manual_seed(0)
    src = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)

    def fn(s, w):
        logp, entropy = chunked_head_logprobs(
            s,
            w,
            targets,
            chunk_tokens=3,
            temperature=0.7,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_grad,
        )
        return (logp, entropy) if entropy_grad else logp

    assert torch.autograd.gradcheck(fn, (src, weight), eps=1e-6, atol=1e-6)


def test_default_head_takes_the_fused_path(tiny_model_path):
    """The tiny (and SmolLM2) head is a bias-free Linear: under grad, outside autocast, the chunks run
    as one function; under bf16 autocast (test above) they stay checkpointed."""
    from streamrl.learner.lm_head import fused_head_applies

    model = PolicyModel(load_lm(tiny_model_path, torch.device("cpu")), with_value_head=False, logits_chunk_tokens=4)
    ids, mask = _inputs(model.lm.config.vocab_size)
    out = model(ids, mask, with_entropy=True)
    names, stack = set(), [out.logp.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and type(fn).__name__ not in names:
            names.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
    assert any("ChunkedHead" in n for n in names), names
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_head_applies(model.lm.get_output_embeddings(), ids)
