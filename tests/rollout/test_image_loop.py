"""Image prompts through the agent loop on `FakeEngine` (no model run; the tiny VLM's processor renders):
admission of a prompt row's image (path, data URL, base64), the expanded ids, the images sent on every
generate, the row's image columns, and a resume in a worker whose store lacks the bytes."""

from __future__ import annotations

import asyncio
import base64

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.models.images import encode_png
from streamrl.rollout.agent_loop import AgentContext, SingleTurnAgentLoop
from streamrl.rollout.agent_loop.image_prompt import load_image_source
from streamrl.rollout.images import ImageStore
from streamrl.rollout.types import AgentData, AgentState, TrajectoryStatus
from tests.rollout.vlm_context import vlm_context

pytestmark = pytest.mark.timeout(120)


def _image(rgb=(40, 160, 220)):
    from PIL import Image

    img = Image.new("RGB", (56, 56), rgb)
    img.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (0, 0, 28, 28))
    return img


def _script(processor, prompt_len: list[int]):
    """Continue a fixed text answer from wherever the prompt stops (a resumed prompt included)."""
    target = processor.tokenizer.encode(" a blue square with a red corner " * 4, add_special_tokens=False)

    def script(prompt_ids: list[int]) -> list[int]:
        return target[len(prompt_ids) - prompt_len[0] :]

    return script, target


def _ctx(processor, engine, store: ImageStore | None, fetch=None) -> AgentContext:
    return vlm_context(
        processor, engine, store, fetch_images=fetch, prompt_length=256, response_length=200, max_tokens_per_turn=200
    )


def _data(source, tid: str = "g/0") -> AgentData:
    content = [{"type": "image", "image": source}, {"type": "text", "text": "what is this?"}]
    return AgentData(
        trajectory_id=tid, group_id="g", agent_name="single_turn_agent", messages=[{"role": "user", "content": content}]
    )


def test_image_sources_path_data_url_base64(tmp_path):
    png = encode_png(_image())
    (tmp_path / "a.png").write_bytes(png)
    b64 = base64.b64encode(png).decode()
    assert load_image_source(str(tmp_path / "a.png")) == png
    assert load_image_source(f"data:image/png;base64,{b64}") == png
    assert load_image_source(b64) == png
    with pytest.raises(ValueError, match="neither an existing file nor base64"):
        load_image_source(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="must be base64"):
        load_image_source("data:image/png,rawbytes")
    with pytest.raises(ValueError, match="path or base64"):
        load_image_source(png)  # raw bytes do not survive AgentData's JSON


async def test_image_prompt_becomes_expanded_ids_images_and_row_columns(processor, tmp_path):
    from streamrl.models.multimodal import render_image_chat

    img = _image()
    png = encode_png(img)
    (tmp_path / "a.png").write_bytes(png)
    expected = render_image_chat(
        processor,
        [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what is this?"}]}],
    )
    prompt_len = [len(expected.input_ids)]
    script, target = _script(processor, prompt_len)
    engine = FakeEngine(script=script, image_token_id=processor.image_token_id)
    store = ImageStore()
    data = _data(str(tmp_path / "a.png"))
    traj = await SingleTurnAgentLoop(_ctx(processor, engine, store)).run(data)

    assert traj.status is TrajectoryStatus.FINISHED
    assert traj.prompt_ids == expected.input_ids  # same ids as the processor rule (placeholders expanded)
    assert traj.response_ids == target
    assert traj.image_refs == [data.images[0].sha256] and store.get(traj.image_refs[0]) == png
    assert traj.num_image_tokens == expected.num_image_tokens == [processor.image_seq_len]
    assert data.messages[0]["content"][0] == {"type": "image", "image_ref": traj.image_refs[0]}  # no path kept
    [(_, sent)] = engine.images_seen
    assert [i.data for i in sent] == [png]
    # A base64 source of the same bytes is the same image (content addressed).
    again = await SingleTurnAgentLoop(_ctx(processor, FakeEngine(script=script), store)).run(
        _data(base64.b64encode(png).decode(), "g/1")
    )
    assert again.image_refs == traj.image_refs and again.prompt_ids == traj.prompt_ids


async def test_resume_in_a_fresh_worker_fetches_the_images_and_sends_them_again(processor):
    from streamrl.models.multimodal import render_image_chat

    img = _image((200, 30, 90))
    png = encode_png(img)
    src = ImageStore()
    chat = render_image_chat(
        processor,
        [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what is this?"}]}],
    )
    script, target = _script(processor, [len(chat.input_ids)])
    engine = FakeEngine(script=script, token_delay_s=0.005, image_token_id=processor.image_token_id)
    ctx = _ctx(processor, engine, src)
    data = _data("data:image/png;base64," + base64.b64encode(png).decode())
    task = asyncio.create_task(SingleTurnAgentLoop(ctx).run(data))
    await asyncio.sleep(0.1)
    ctx.cancel.set()
    parked = await asyncio.wait_for(task, 10)
    assert parked.status is TrajectoryStatus.PARTIAL and parked.image_refs == [data.images[0].sha256]
    k = len(parked.response_ids)
    assert 0 < k < len(target)

    fetched: list[list[str]] = []

    async def fetch(shas: list[str]) -> list[bytes]:  # the buffer's get_images
        fetched.append(list(shas))
        return [src.get(s) for s in shas]

    fresh = ImageStore()
    restored = AgentData.from_json(parked.agent_data_json)
    assert restored.state is AgentState.GENERATING
    final = await SingleTurnAgentLoop(_ctx(processor, engine, fresh, fetch)).run(restored)
    assert final.status is TrajectoryStatus.FINISHED and final.num_interrupts == 1
    assert fetched == [[parked.image_refs[0]]] and fresh.get(parked.image_refs[0]) == png
    assert final.response_ids == target and final.response_ids[:k] == parked.response_ids
    assert [[i.data for i in imgs] for _, imgs in engine.images_seen] == [[png], [png]]
    assert final.image_refs == parked.image_refs and final.num_image_tokens == [processor.image_seq_len]

    # Without an image source the missing bytes are an error, never a generate without its image.
    with pytest.raises(KeyError, match="not in the worker's store"):
        await SingleTurnAgentLoop(_ctx(processor, engine, ImageStore())).run(
            AgentData.from_json(parked.agent_data_json)
        )


async def test_image_prompt_needs_a_vlm_policy(processor):
    ctx = _ctx(processor, FakeEngine(), None)
    ctx.processor = None
    png = encode_png(_image())
    with pytest.raises(ValueError, match="not a VLM"):
        await SingleTurnAgentLoop(ctx).run(_data(base64.b64encode(png).decode()))
