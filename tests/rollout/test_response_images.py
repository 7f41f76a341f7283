"""Images in tool and interaction responses through `ToolAgentLoop` (docs/multimodal.md, "Images in your own data").

Fake-engine tests (the tiny VLM's processor renders, `FakeEngine` checks that every request's
placeholder runs match its images): a tool image and an interaction image join `AgentData.images`
after the prompt image, in placeholder order, with ids equal to the HF processor's own expansion; each
generate sends all images so far; the snapshot stays JSON-lossless; images that cannot be shown
(text-only policy, corrupt bytes, over the image limit) become error observations; a park after the
tool image resumes in a fresh worker that fetches both images by hash; a crash replay of the tool
journal admits no image twice and keeps call order.

The real-engine test runs the project's `VLLMEngine` on the tiny VLM (one engine for the module): a
tool returns an image mid-trajectory, the trajectory parks mid-turn after it and resumes from the
buffer; every sampled log-prob, after the tool image included, equals the HF forward on both images.
"""

from __future__ import annotations

import asyncio
import base64

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.models.images import decode_image, encode_png
from streamrl.models.multimodal import image_run_lengths
from streamrl.rollout.agent_loop import AgentContext, ToolAgentLoop
from streamrl.rollout.images import ImageStore
from streamrl.rollout.interactions.base import BaseInteraction, num_replies
from streamrl.rollout.types import AgentData, AgentState, FinishReason, TrajectoryStatus
from streamrl.tools import ToolRegistry
from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.types import ToolCallStatus
from tests.rollout.test_agent_loop import turn_script
from tests.rollout.vlm_context import vlm_context

pytestmark = pytest.mark.timeout(120)

SNAP = '<tool_call>\n{"name": "snap", "arguments": {}}\n</tool_call>'
BOTH = '<tool_call>\n{"name": "slow_snap", "arguments": {}}\n</tool_call>\n' + SNAP
PLAIN = "I see it."
ANSWER = "The answer is \\boxed{84}."


def _image(rgb):
    from PIL import Image

    img = Image.new("RGB", (56, 56), rgb)
    img.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (0, 0, 28, 28))  # not a flat image
    return img


def _png(rgb) -> bytes:
    return encode_png(_image(rgb))


P, T, E = _png((220, 40, 40)), _png((40, 220, 40)), _png((40, 40, 220))  # prompt, tool, environment (interaction)


class SnapTool(BaseTool):
    """Returns `images` (any accepted source) with a text; `world` records each execution."""

    def __init__(self, images: list, *, name: str = "snap", delay_s: float = 0.0, world: list | None = None) -> None:
        schema = {
            "function": {
                "name": name,
                "description": "Take a picture.",
                "parameters": {"type": "object", "properties": {}},
            }
        }
        super().__init__(tool_schema=schema)
        self.images, self.delay_s, self.world = images, delay_s, world if world is not None else []

    async def execute(self, instance_id: str, parameters: dict) -> ToolExecution:
        self.world.append(self.name)
        await asyncio.sleep(self.delay_s)
        return ToolExecution(text=f"picture from {self.name}", images=list(self.images))


class IdempotentSnapTool(SnapTool):
    idempotent = True


class PictureInteraction(BaseInteraction):
    """First reply: text + `config["image"]`; second: stop with score 1."""

    async def generate_response(self, instance_id, messages, **kwargs):
        if num_replies(messages) == 0:
            return (
                False,
                [{"type": "text", "text": "look at this:"}, {"type": "image", "image": self.config["image"]}],
                0.0,
                {},
            )
        return True, "done", 1.0, {}


def _ctx(processor, engine, store, tools=(), *, fetch=None, max_images=None, image=None, **cfg) -> AgentContext:
    interactions = {"picture": PictureInteraction({"name": "picture", "image": image})} if image is not None else {}
    return vlm_context(
        processor,
        engine,
        store,
        tools=ToolRegistry(tools) if tools else None,
        fetch_images=fetch,
        max_images=max_images,
        interactions=interactions,
        **cfg,
    )


def _data(prompt_png: bytes | None, tid: str = "r/0", interaction: bool = False) -> AgentData:
    content: list[dict] = [{"type": "text", "text": "What is 12 times 7?"}]
    if prompt_png is not None:
        content.insert(0, {"type": "image", "image": base64.b64encode(prompt_png).decode()})
    return AgentData(
        trajectory_id=tid,
        group_id="r",
        messages=[{"role": "user", "content": content}],
        ground_truth="84",
        interaction_name="picture" if interaction else None,
    )


def _hf_ids(processor, ids: list[int], pngs: list[bytes]) -> list[int]:
    """The HF processor's own expansion of the same sequence: collapse each placeholder run back to
    one `<image>`, decode to text and let the processor expand it with the decoded images."""
    from streamrl.models.multimodal import collapse_image_tokens

    text = processor.tokenizer.decode(collapse_image_tokens(processor, ids))
    out = processor(text=[text], images=[[decode_image(b) for b in pngs]], add_special_tokens=False)
    return list(out["input_ids"][0])


def _sent(engine) -> list[list[bytes]]:
    return [[i.data for i in images] for _, images in engine.images_seen]


async def test_tool_and_interaction_images_join_the_trajectory_in_placeholder_order(processor, tmp_path):
    (tmp_path / "tool.png").write_bytes(T)
    data_url = "data:image/png;base64," + base64.b64encode(E).decode()
    script, _ = turn_script(processor.tokenizer, [SNAP, PLAIN, ANSWER])
    engine = FakeEngine(script=script, image_token_id=processor.image_token_id)
    store = ImageStore()
    tool = SnapTool([str(tmp_path / "tool.png")])
    data = _data(P, interaction=True)
    traj = await ToolAgentLoop(_ctx(processor, engine, store, [tool], image=data_url)).run(data)

    traj.validate()
    assert traj.status is TrajectoryStatus.FINISHED and traj.finish_reason is FinishReason.INTERACTION_DONE
    shas = [store.put(b).sha256 for b in (P, T, E)]
    assert [r.sha256 for r in data.images] == traj.image_refs == shas  # prompt, tool, environment (interaction)
    assert traj.num_image_tokens == [processor.image_seq_len] * 3
    assert _sent(engine) == [[P], [P, T], [P, T, E]]  # every generate sends all images so far
    all_ids = traj.prompt_ids + traj.response_ids
    assert all_ids == _hf_ids(processor, all_ids, [P, T, E])
    runs = image_run_lengths(traj.response_ids, processor.image_token_id)
    first = traj.response_ids.index(processor.image_token_id)
    assert runs == [4, 4] and traj.response_mask[first] == 0 and traj.behavior_logprobs[first] == 0.0
    assert all(m == 0 for t, m in zip(traj.response_ids, traj.response_mask) if t == processor.image_token_id)
    # Messages hold only refs; the tool's record names its image; the snapshot is lossless.
    tool_msg = next(m for m in data.messages if m["role"] == "tool")
    assert tool_msg["content"] == [
        {"type": "image", "image_ref": shas[1]},
        {"type": "text", "text": "picture from snap"},
    ]
    assert data.messages[-2]["content"] == [
        {"type": "text", "text": "look at this:"},
        {"type": "image", "image_ref": shas[2]},
    ]
    assert data.tool_journal[0].result.images == [data.images[1]]
    assert AgentData.from_json(data.to_json()) == data


def test_function_tools_and_verl_responses_return_images():
    from types import SimpleNamespace

    from streamrl.tools.executor import coerce_execution
    from streamrl.tools.function import to_execution

    parts = [{"type": "text", "text": "a"}, {"type": "image", "image": "x"}, {"type": "text", "text": "b"}]
    assert to_execution(parts) == ToolExecution(text="a\nb", images=["x"])
    assert to_execution([{"type": "text", "text": "a"}]).text == '[{"type": "text", "text": "a"}]'  # no image: JSON
    verl = (SimpleNamespace(text="t", image=[b"png"]), 0.5, {})
    assert coerce_execution(verl) == ToolExecution(text="t", reward=0.5, images=[b"png"])


async def test_executor_admits_all_sources_or_none():
    from streamrl.tools.types import ToolCall

    store = ImageStore()
    ok = SnapTool([T, _image((1, 2, 3)), "data:image/png;base64," + base64.b64encode(E).decode()])
    bad = SnapTool([E, T[:80]], name="bad")  # the second is a truncated PNG: header fine, pixels not
    registry = ToolRegistry([ok, bad])
    [good, broken] = await registry.execute_calls(
        [ToolCall(call_id="a", name="snap"), ToolCall(call_id="b", name="bad")],
        {},
        timeout_s=5,
        max_parallel=2,
        images=store,
    )
    assert [r.sha256 for r in good.images] == [
        store.put(T).sha256,
        store.put(encode_png(_image((1, 2, 3)))).sha256,
        store.put(E).sha256,
    ] and not good.is_error
    assert broken.is_error and broken.images == [] and "unreadable image (#2 of 2)" in broken.text
    assert broken.text.endswith("picture from bad") and registry.num_errors == 1


@pytest.mark.parametrize("case", ["text_only", "corrupt", "over_limit"])
async def test_unshowable_tool_images_become_error_observations(processor, case):
    script, _ = turn_script(processor.tokenizer, [SNAP, ANSWER])
    engine = FakeEngine(script=script, image_token_id=processor.image_token_id)
    store = ImageStore()
    image, prompt, max_images, needle = {
        "text_only": (T, None, None, "the policy reads text only"),
        "corrupt": (b"\x89PNG not really", P, None, "unreadable image (#1 of 1)"),
        "over_limit": (T, P, 1, "already holds 1 of at most 1 images"),
    }[case]
    ctx = _ctx(processor, engine, store, [SnapTool([image])], max_images=max_images)
    if case == "text_only":
        ctx.processor = ctx.images = None
    data = _data(prompt)
    traj = await ToolAgentLoop(ctx).run(data)

    traj.validate()
    assert traj.status is TrajectoryStatus.FINISHED and traj.num_tool_errors == 1
    [result] = data.tool_results
    assert result.is_error and result.images == [] and result.text.startswith("Error: ") and needle in result.text
    assert result.text.endswith("picture from snap")  # the tool's own text is kept after the reason
    assert next(m for m in data.messages if m["role"] == "tool")["content"] == result.text  # plain text content
    assert processor.image_token_id not in traj.response_ids
    assert traj.image_refs == ([] if prompt is None else [store.put(P).sha256])
    data.check_aligned(image_token_id=processor.image_token_id)


@pytest.mark.parametrize("case", ["text_only", "corrupt", "over_limit"])
async def test_unshowable_interaction_images_become_error_observations(processor, case):
    script, _ = turn_script(processor.tokenizer, [PLAIN, ANSWER])
    engine = FakeEngine(script=script, image_token_id=processor.image_token_id)
    image, max_images, needle = {
        "text_only": (E, None, "the policy reads text only"),
        "corrupt": ("not base64 and not a file", None, "unreadable image (#1 of 1)"),
        "over_limit": (E, 1, "already holds 1 of at most 1 images"),
    }[case]
    ctx = _ctx(processor, engine, ImageStore(), max_images=max_images, image=image)
    if case == "text_only":
        ctx.processor = ctx.images = None
    data = _data(None if case == "text_only" else P, interaction=True)
    traj = await ToolAgentLoop(ctx).run(data)

    assert traj.status is TrajectoryStatus.FINISHED and traj.finish_reason is FinishReason.INTERACTION_DONE
    reply = data.messages[2]
    assert reply["role"] == "user" and reply["content"].startswith("Error: ") and needle in reply["content"]
    assert reply["content"].endswith("look at this:")
    assert processor.image_token_id not in traj.response_ids and len(data.images) == (0 if case == "text_only" else 1)


async def test_prompt_over_the_image_limit_is_refused_before_any_generate(processor):
    engine = FakeEngine(image_token_id=processor.image_token_id)
    with pytest.raises(ValueError, match="has 1 images; max_images=0"):
        await ToolAgentLoop(_ctx(processor, engine, ImageStore(), max_images=0)).run(_data(P))
    assert engine.requests_seen == []


async def test_parked_after_a_tool_image_resumes_in_a_fresh_worker_with_every_token(processor):
    script, turns = turn_script(processor.tokenizer, [SNAP, ANSWER * 3])
    engine = FakeEngine(script=script, token_delay_s=0.005, image_token_id=processor.image_token_id)
    src = ImageStore()
    ctx = _ctx(processor, engine, src, [SnapTool([T])])
    data = _data(P)
    task = asyncio.create_task(ToolAgentLoop(ctx).run(data))
    while len(engine.images_seen) < 2:  # the turn after the tool's image has started
        assert not task.done(), task.result()
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    ctx.cancel.set()
    parked = await asyncio.wait_for(task, 10)
    assert parked.status is TrajectoryStatus.PARTIAL and parked.image_refs == [r.sha256 for r in data.images]
    k = len(parked.response_ids)
    restored = AgentData.from_json(parked.agent_data_json)
    assert restored.state is AgentState.GENERATING and len(restored.images) == 2
    assert k > restored.turn_start  # some tokens of the turn after the image were streamed

    fetched: list[list[str]] = []

    async def fetch(shas: list[str]) -> list[bytes]:  # the buffer's get_images
        fetched.append(list(shas))
        return [src.get(s) for s in shas]

    final = await ToolAgentLoop(_ctx(processor, engine, ImageStore(), [SnapTool([T])], fetch=fetch)).run(restored)
    assert final.status is TrajectoryStatus.FINISHED and final.num_interrupts == 1
    assert fetched == [parked.image_refs]  # both images, once, in order
    assert final.response_ids[:k] == parked.response_ids and final.response_ids[-len(turns[1]) :] == turns[1]
    assert final.image_refs == parked.image_refs and final.num_image_tokens == [4, 4]
    assert _sent(engine) == [[P], [P, T], [P, T]] and final.num_tool_calls == 1  # the tool ran once


async def test_crash_replay_admits_no_image_twice_and_keeps_call_order(processor):
    script, _ = turn_script(processor.tokenizer, [BOTH, ANSWER])
    engine = FakeEngine(script=script, image_token_id=processor.image_token_id)
    world: list[str] = []
    store = ImageStore()

    def tools():  # the slow tool is called first but finishes last: images still follow call order
        return [IdempotentSnapTool([E], name="slow_snap", delay_s=0.1, world=world), SnapTool([T], world=world)]

    ctx = _ctx(processor, engine, store, tools())
    snapshots: list[str] = []

    async def snapshot(data: AgentData) -> None:
        snapshots.append(data.to_json())

    ctx.snapshot = snapshot
    full = await ToolAgentLoop(ctx).run(_data(P))
    shas = {name: store.put(b).sha256 for name, b in (("P", P), ("T", T), ("E", E))}
    assert full.image_refs == [shas["P"], shas["E"], shas["T"]] and world == ["slow_snap", "snap"]

    # The worker died while both calls ran: resume from the durable snapshot (both calls INTENT) in a
    # fresh process. The idempotent call runs again, the other is answered "interrupted", no image twice.
    crashed = AgentData.from_json(snapshots[0])
    assert crashed.state is AgentState.PROCESSING_TOOLS and [r.sha256 for r in crashed.images] == [shas["P"]]

    async def fetch(shas_: list[str]) -> list[bytes]:
        return [store.get(s) for s in shas_]

    resumed = await ToolAgentLoop(_ctx(processor, engine, ImageStore(), tools(), fetch=fetch)).run(crashed)
    assert resumed.status is TrajectoryStatus.FINISHED and world == ["slow_snap", "snap", "slow_snap"]
    assert [e.status for e in crashed.tool_journal] == [ToolCallStatus.DONE, ToolCallStatus.INTERRUPTED]
    assert resumed.image_refs == [shas["P"], shas["E"]] and resumed.num_image_tokens == [4, 4]
    assert [r.sha256 for r in crashed.images] == resumed.image_refs
    crashed.check_aligned(image_token_id=processor.image_token_id)


class FirstTurnCalls:
    """A parser stub for the random-weight model, which never writes a tool call itself: its first
    turn calls `snap`, later turns call nothing. Shared by the worker that parks and the one that resumes."""

    def __init__(self) -> None:
        self.num_parsed = 0

    def parse(self, text: str):
        from streamrl.rollout.parsers.base import ParsedTurn
        from streamrl.tools.types import ToolCall

        self.num_parsed += 1
        calls = [ToolCall(call_id="c", name="snap", arguments={})] if self.num_parsed == 1 else []
        return ParsedTurn(content=text, tool_calls=calls)


@pytest.mark.vllm
@pytest.mark.timeout(600)
async def test_real_engine_tool_image_parked_and_resumed_from_the_buffer(vlm_engine, processor, hf_vlm, tmp_path):
    from streamrl.buffer.config import BufferConfig
    from streamrl.buffer.store import ReplayBuffer
    from streamrl.models.multimodal import image_vision_inputs
    from streamrl.streaming.actors.worker import image_blobs
    from tests.rollout.test_multimodal_engine import hf_logprobs, max_diff
    from tests.rollout.test_multimodal_loop import park_then_sync

    (tmp_path / "tool.png").write_bytes(T)
    parser, store = FirstTurnCalls(), ImageStore()
    # A fixed sampling seed: the random-weight model's turns are then the same on every run (an eos in
    # the first tokens after the tool image would leave nothing to interrupt).
    limits = dict(
        max_images=2, response_length=300, max_tokens_per_turn=40, max_assistant_turns=2, sampling={"seed": 1}
    )
    ctx = _ctx(processor, vlm_engine, store, [SnapTool([str(tmp_path / "tool.png")])], **limits)
    ctx.parser = parser
    data = _data(P, "mm-tool")
    version0 = vlm_engine.policy_version
    task = asyncio.create_task(ToolAgentLoop(ctx).run(data))

    async def second_turn_streamed(n: int) -> None:
        first = ""
        while len(data.images) < 2:  # the tool's image is in: the turn after it starts next
            first = data.request_id  # the first turn's request (the second one's once the image is in)
            await poll()
        while not (data.request_id not in ("", first) and vlm_engine.num_streamed_tokens(data.request_id) >= n):
            await poll()

    async def poll() -> None:
        if task.done():
            raise AssertionError(f"the trajectory ended before the interruption: {task.result().response_mask}")
        await asyncio.sleep(0.001)

    await asyncio.wait_for(second_turn_streamed(3), 180)
    parked = await park_then_sync(ctx, task, vlm_engine, version0 + 1)
    shas = [store.put(P).sha256, store.put(T).sha256]
    assert parked.status is TrajectoryStatus.PARTIAL and parked.image_refs == shas and parked.num_image_tokens == [4, 4]
    turn2 = AgentData.from_json(parked.agent_data_json).turn_start  # where the turn after the tool image began
    assert 0 < turn2 < len(parked.response_ids)  # parked mid-turn, with tokens sampled after the image
    buffer = ReplayBuffer(BufferConfig(root_dir=str(tmp_path / "buffer"), batch_size=1, group_size=1))
    buffer.append([parked], images=image_blobs(store, parked))

    async def from_buffer(wanted: list[str]) -> list[bytes]:  # what BufferActor.get_images serves
        return [buffer.get_image(s) for s in wanted]

    fresh = ImageStore()  # a restarted worker: it saw neither image
    resumed_ctx = _ctx(processor, vlm_engine, fresh, [SnapTool([T])], fetch=from_buffer, **limits)
    resumed_ctx.parser = parser
    final = await ToolAgentLoop(resumed_ctx).run(AgentData.from_json(parked.agent_data_json))

    final.validate(max_model_len=512)
    k = len(parked.response_ids)
    assert final.status is TrajectoryStatus.FINISHED and final.finish_reason is FinishReason.MAX_TURNS
    assert final.num_interrupts == 1 and final.num_tool_calls == 1 and len(fresh) == 2
    assert final.response_ids[:k] == parked.response_ids and len(final.response_ids) > k  # nothing lost
    sampled = [v for v in final.policy_versions if v >= 0]
    assert set(sampled[: sum(parked.response_mask)]) == {version0} and set(sampled[sum(parked.response_mask) :]) == {
        version0 + 1
    }
    assert final.image_refs == shas and final.num_image_tokens == [4, 4]
    # Every sampled token (before the tool image, after it, after the interruption) was sampled with
    # both images in front of the same positions as the HF forward on the same pixels.
    vision = image_vision_inputs(processor, [decode_image(P), decode_image(T)])
    hf = hf_logprobs(hf_vlm, final.prompt_ids, vision, final.response_ids)
    mask = final.response_mask
    for positions in (range(turn2, k), range(k, len(mask))):  # after the tool image: before / after the resume
        sampled_here = [i for i in positions if mask[i]]
        assert (
            sampled_here
            and max_diff([final.behavior_logprobs[i] for i in sampled_here], [hf[i] for i in sampled_here]) < 1e-4
        )
    assert (
        max_diff([lp for lp, m in zip(final.behavior_logprobs, mask) if m], [h for h, m in zip(hf, mask) if m]) < 1e-4
    )

    buffer.append([final], images=image_blobs(fresh, final))  # supersedes the partial row
    padded = buffer.sample(served_version=version0 + 1, learner_step=1).to_padded()
    assert padded.images == [[P, T]]  # both images' bytes, in placeholder order, through the image log
