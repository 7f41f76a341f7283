"""An image prompt through the agent loop on the project's `VLLMEngine` (tiny VLM) into a real
`ReplayBuffer` and back out as a `PaddedBatch`, and the loop's interrupt protocol on it: parked
mid-generation (the worker's cancel event), its partial row + image bytes appended to the buffer, then
resumed from the row's AgentData JSON by a worker whose `ImageStore` starts empty and is filled only
from the buffer's image log.

Reference: the HF model's forward on the expanded ids + the same pixels (what the learner computes).
One engine for the module (~15 s start), shut down at the end.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.engines.base import PauseMode
from streamrl.models.images import decode_image, encode_png
from streamrl.rollout.agent_loop import AgentContext, SingleTurnAgentLoop
from streamrl.rollout.agent_loop.observation import ObservationEncoder
from streamrl.rollout.config import AgentConfig
from streamrl.rollout.images import ImageStore
from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.types import AgentData, AgentState, TrajectoryStatus
from streamrl.streaming.actors.worker import image_blobs
from tests.rollout.test_multimodal_engine import _image, hf_logprobs, max_diff

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LOGPROB_ATOL = 1e-4  # as tests/rollout/test_tiny_vlm.py (observed ~5e-7 fp32)


def _ctx(processor, engine, store: ImageStore, fetch=None) -> AgentContext:
    return AgentContext(
        cfg=AgentConfig(prompt_length=128, response_length=300, max_tokens_per_turn=300),
        server=ServerManager([engine]),
        tokenizer=processor.tokenizer,
        encoder=ObservationEncoder(processor.tokenizer),
        processor=processor,
        images=store,
        fetch_images=fetch,
    )


def _row(path: str, tid: str) -> AgentData:
    """A prompt row as the dataset brings it: the image as a local path."""
    content = [{"type": "image", "image": path}, {"type": "text", "text": "describe it"}]
    return AgentData(
        trajectory_id=tid, group_id=tid, agent_name="single_turn_agent", messages=[{"role": "user", "content": content}]
    )


def _hf_reference(processor, png: bytes):
    """The HF view of the same prompt and pixels (`render_image_chat` on the decoded bytes)."""
    from streamrl.models.multimodal import render_image_chat

    return render_image_chat(
        processor,
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": decode_image(png)}, {"type": "text", "text": "describe it"}],
            }
        ],
    )


def _buffer(tmp_path) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(root_dir=str(tmp_path / "buffer"), batch_size=1, group_size=1))


async def park_then_sync(ctx, task: asyncio.Task, engine, version: int):
    """What a weight sync does to a loop mid-generation: the worker's pause (the loop aborts its
    request and parks; its partial row is returned), then the engine serves `version`."""
    ctx.cancel.set()
    parked = await asyncio.wait_for(task, 60)
    await engine.pause(PauseMode.ABORT)
    try:
        await engine.set_policy_version(version)
    finally:
        await engine.resume()
    return parked


async def test_image_prompt_runs_to_a_buffer_row_and_a_padded_batch(vlm_engine, processor, hf_vlm, tmp_path):
    png = encode_png(_image((220, 40, 40)))
    (tmp_path / "img.png").write_bytes(png)
    store = ImageStore()
    data = _row(str(tmp_path / "img.png"), "mm-0")
    traj = await SingleTurnAgentLoop(_ctx(processor, vlm_engine, store)).run(data)

    traj.validate(max_model_len=512)
    ref = _hf_reference(processor, png)
    assert traj.status is TrajectoryStatus.FINISHED and len(traj.response_ids) > 0
    assert traj.prompt_ids == ref.input_ids  # vLLM saw these ids (else PromptMismatchError)
    assert traj.image_refs == [data.images[0].sha256] and traj.num_image_tokens == ref.num_image_tokens == [4]
    assert (
        max_diff(traj.behavior_logprobs, hf_logprobs(hf_vlm, ref.input_ids, ref.vision_inputs, traj.response_ids))
        < LOGPROB_ATOL
    )

    buffer = _buffer(tmp_path)
    buffer.append([traj], images=image_blobs(store, traj))
    padded = buffer.sample(served_version=0, learner_step=1).to_padded()
    assert padded.images == [[png]]  # the original bytes, through the image log
    row = padded.input_ids[0].tolist()
    assert row[: len(traj.prompt_ids)] == traj.prompt_ids


async def test_parked_image_trajectory_resumes_from_the_buffer_with_every_token(
    vlm_engine, processor, hf_vlm, tmp_path
):
    png = encode_png(_image((40, 160, 220)))
    (tmp_path / "img.png").write_bytes(png)
    store = ImageStore()
    ctx = _ctx(processor, vlm_engine, store)
    data = _row(str(tmp_path / "img.png"), "mm-1")
    version0 = vlm_engine.policy_version

    task = asyncio.create_task(SingleTurnAgentLoop(ctx).run(data))

    async def streamed(n: int) -> None:
        while not (data.request_id and vlm_engine.num_streamed_tokens(data.request_id) >= n):
            await asyncio.sleep(0.005)

    await asyncio.wait_for(streamed(3), 120)
    parked = await park_then_sync(ctx, task, vlm_engine, version0 + 1)
    assert parked.status is TrajectoryStatus.PARTIAL and 3 <= len(parked.response_ids) < 300
    assert parked.image_refs == [data.images[0].sha256] and parked.num_image_tokens == [4]

    buffer = _buffer(tmp_path)
    buffer.append([parked], images=image_blobs(store, parked))

    fetched: list[str] = []

    async def from_buffer(shas: list[str]) -> list[bytes]:  # what BufferActor.get_images serves
        fetched.extend(shas)
        return [buffer.get_image(s) for s in shas]

    fresh = ImageStore()  # a restarted worker: it never saw the image
    restored = AgentData.from_json(parked.agent_data_json)
    assert restored.state is AgentState.GENERATING and restored.images == data.images
    final = await SingleTurnAgentLoop(_ctx(processor, vlm_engine, fresh, from_buffer)).run(restored)

    assert fetched == parked.image_refs and fresh.get(fetched[0]) == png
    assert final.status is TrajectoryStatus.FINISHED and final.num_interrupts == 1
    k = len(parked.response_ids)
    assert final.response_ids[:k] == parked.response_ids and len(final.response_ids) > k  # nothing lost
    assert final.policy_versions == [version0] * k + [version0 + 1] * (len(final.response_ids) - k)
    restored.check_aligned(image_token_id=processor.image_token_id)
    assert final.image_refs == parked.image_refs and final.num_image_tokens == [4]
    # Both sides of the interruption were sampled with this image in front of the same positions.
    ref = _hf_reference(processor, png)
    assert final.prompt_ids == ref.input_ids
    hf = hf_logprobs(hf_vlm, ref.input_ids, ref.vision_inputs, final.response_ids)
    assert max_diff(final.behavior_logprobs[k:], hf[k:]) < LOGPROB_ATOL
    assert max_diff(final.behavior_logprobs, hf) < LOGPROB_ATOL

    buffer.append([final], images=image_blobs(fresh, final))  # supersedes the partial row
    padded = buffer.sample(served_version=version0 + 1, learner_step=1).to_padded()
    assert padded.images == [[png]]
