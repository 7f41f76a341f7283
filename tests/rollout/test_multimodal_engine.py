"""The project's `VLLMEngine` on the tiny VLM: image prompts through the engine seam, and an image
trajectory interrupted (pause ABORT, the interrupt protocol's step 3) and resumed from its JSON state.

Reference: the HF model's forward on the expanded ids + the image's pixels (what the learner will
compute). One engine for the module (~15 s start, ~1.8 GiB RSS with the HF model), shut down at the end.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.base import ImageInput, PauseMode, PromptMismatchError, SamplingParams
from streamrl.rollout.images import ImageStore
from streamrl.rollout.types import AgentData

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LOGPROB_ATOL = 1e-4  # as tests/rollout/test_tiny_vlm.py (observed ~5e-7 fp32)


def _image(rgb: tuple[int, int, int]):
    from PIL import Image

    img = Image.new("RGB", (56, 56), rgb)
    img.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (0, 0, 28, 28))  # not a flat image
    return img


def _chat(img, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


def _png(img) -> bytes:
    from streamrl.models.images import encode_png

    return encode_png(img)


def hf_logprobs(model, input_ids: list[int], vision_inputs, response_ids: list[int]) -> list[float]:
    """log p(response_ids[i] | prefix, image) by one forward pass."""
    import torch

    ids = torch.tensor([input_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, **vision_inputs).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    n = len(input_ids)
    return lps[torch.arange(n - 1, n + len(response_ids) - 1), torch.tensor(response_ids)].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def wait_streamed(engine, request_id: str, num_tokens: int, timeout_s: float = 120.0) -> None:
    async def poll() -> None:
        while engine.num_streamed_tokens(request_id) < num_tokens:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


async def test_engine_generates_from_image_prompt(vlm_engine, processor, hf_vlm):
    from streamrl.models.multimodal import render_image_chat

    img = _image((220, 40, 40))
    chat = render_image_chat(processor, _chat(img))
    store = ImageStore()
    ref = store.put_image(img)
    out = await vlm_engine.generate(
        "img-0", chat.input_ids, SamplingParams(max_tokens=8, temperature=1.0, seed=0), images=store.inputs([ref])
    )
    assert out.num_prompt_tokens == len(chat.input_ids) > len(chat.engine_prompt_ids)
    assert len(out.token_ids) == len(out.logprobs) == len(out.policy_versions) == 8
    # The engine decoded the stored PNG bytes and vLLM ran the vision tower on them: the sampled
    # tokens' logprobs equal the HF forward on the same pixels, and not the forward on another image.
    hf = hf_logprobs(hf_vlm, chat.input_ids, chat.vision_inputs, out.token_ids)
    diff = max_diff(out.logprobs, hf)
    assert diff < LOGPROB_ATOL, (out.logprobs, hf)
    other = render_image_chat(processor, _chat(_image((10, 200, 90))))
    assert max_diff(hf_logprobs(hf_vlm, other.input_ids, other.vision_inputs, out.token_ids), hf) > 10 * max(diff, 1e-6)


async def test_bad_image_requests_fail_loudly(vlm_engine, processor):
    from streamrl.models.multimodal import render_image_chat

    img = _image((30, 30, 200))
    chat = render_image_chat(processor, _chat(img))
    image = ImageInput.from_bytes(_png(img))
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="carries no images"):
        await vlm_engine.generate("bad-0", chat.input_ids, sampling)
    with pytest.raises(ValueError, match="1 image placeholder runs for 2 images"):
        await vlm_engine.generate("bad-1", chat.input_ids, sampling, images=[image, image])
    with pytest.raises(ValueError, match="exceed max_images_per_prompt=2"):
        await vlm_engine.generate("bad-2", chat.input_ids, sampling, images=[image] * 3)
    # A placeholder run one token short: the engine collapses it, vLLM expands it back to full length,
    # so the model would see another prompt than the trajectory stores. It must not pass silently.
    short = list(chat.input_ids)
    del short[short.index(processor.image_token_id)]
    seen = f"the model saw {len(chat.input_ids)} prompt tokens, the caller sent {len(short)}"
    with pytest.raises(PromptMismatchError, match=seen):
        await vlm_engine.generate("bad-3", short, sampling, images=[image])
    assert not vlm_engine.has_request("bad-3")
    out = await vlm_engine.generate("good", chat.input_ids, sampling, images=[image])  # the engine still serves
    assert len(out.token_ids) == 2


async def test_interrupt_and_resume_with_image_keeps_every_token(vlm_engine, processor, hf_vlm):
    """Interrupt protocol on an image trajectory: pause(ABORT) mid-generation keeps the streamed
    tokens; the state goes through JSON (as a `partial` row would); the resume re-submits the expanded
    ids + streamed tokens with the same image (bytes looked up by hash) under the next policy_version."""
    from streamrl.models.multimodal import render_image_chat

    img = _image((40, 160, 220))
    chat = render_image_chat(processor, _chat(img, "describe it"))
    store = ImageStore()
    data = AgentData(trajectory_id="traj-img", group_id="g", prompt_ids=chat.input_ids, images=[store.put_image(img)])
    sampling = SamplingParams(max_tokens=300, temperature=1.0, seed=5)
    version0 = vlm_engine.policy_version

    images = store.inputs(data.images)
    task = asyncio.create_task(vlm_engine.generate("traj-img-a", data.prompt_ids, sampling, images=images))
    await wait_streamed(vlm_engine, "traj-img-a", 3)
    await vlm_engine.pause(PauseMode.ABORT)
    try:
        first = await asyncio.wait_for(task, 60)
        await vlm_engine.set_policy_version(version0 + 1)  # the commit of the interrupt protocol
    finally:
        await vlm_engine.resume()
    assert first.aborted and 3 <= len(first.token_ids) < 300
    assert first.num_prompt_tokens == len(chat.input_ids)
    data.append_sampled(first.token_ids, first.logprobs, first.policy_versions)
    data.check_aligned(image_token_id=processor.image_token_id)

    resumed = AgentData.from_json(data.to_json())  # parked, then picked up (in another worker)
    assert resumed.images == data.images and resumed.response_ids == first.token_ids
    prompt = resumed.prompt_ids + resumed.response_ids
    rest = await vlm_engine.generate(
        "traj-img-b",
        prompt,
        SamplingParams(max_tokens=300 - len(resumed.response_ids), temperature=1.0, seed=6),
        images=store.inputs(resumed.images),
    )
    assert rest.num_prompt_tokens == len(prompt)
    assert rest.finish_reason in ("length", "stop") and len(rest.token_ids) > 0
    resumed.append_sampled(rest.token_ids, rest.logprobs, rest.policy_versions)
    resumed.check_aligned(image_token_id=processor.image_token_id)
    k = len(first.token_ids)
    assert resumed.response_ids[:k] == first.token_ids  # nothing streamed before the pause was lost
    assert resumed.policy_versions == [version0] * k + [version0 + 1] * len(rest.token_ids)

    # Every token of the trajectory, both sides of the interruption, has the logprob the model gives
    # it with this image in front of it: the resumed request saw the same image at the same positions.
    hf = hf_logprobs(hf_vlm, chat.input_ids, chat.vision_inputs, resumed.response_ids)
    assert max_diff(resumed.behavior_logprobs, hf) < LOGPROB_ATOL


async def test_prefix_cache_keys_include_the_image(vlm_engine, processor):
    """A re-prefill with the same image reuses the KV; the same ids with another image must not."""
    from streamrl.models.multimodal import render_image_chat

    text = "a longer question so that the prompt spans several KV blocks " * 3
    chat = render_image_chat(processor, _chat(_image((90, 90, 20)), text))
    same = ImageInput.from_bytes(_png(_image((90, 90, 20))))
    other = ImageInput.from_bytes(_png(_image((20, 90, 90))))
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    await vlm_engine.reset_prefix_cache()
    cold = await vlm_engine.generate("cache-0", chat.input_ids, sampling, images=[same])
    warm = await vlm_engine.generate("cache-1", chat.input_ids, sampling, images=[same])
    swapped = await vlm_engine.generate("cache-2", chat.input_ids, sampling, images=[other])
    image_at = chat.input_ids.index(processor.image_token_id)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens > image_at + 4  # blocks past the image were reused
    assert swapped.num_cached_tokens <= image_at  # nothing from the image on


async def test_weight_change_drops_cached_vision_embeddings(vlm_engine, processor, hf_vlm, vlm_path, tmp_path):
    """vLLM keeps vision-encoder outputs by image hash across requests, unsalted by version: after new
    weights (here only the vision tower and connector change) the same image must be re-encoded.
    Changes the module engine's weights; restores them at the end."""
    import torch
    from transformers import AutoModelForImageTextToText

    from streamrl.models.multimodal import render_image_chat

    img = _image((120, 60, 200))
    chat = render_image_chat(processor, _chat(img))
    image = ImageInput.from_bytes(_png(img))
    sampling = SamplingParams(max_tokens=4, temperature=1.0, seed=11)
    await vlm_engine.generate("enc-0", chat.input_ids, sampling, images=[image])  # encoder output now cached

    new = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype="float32").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in [*new.model.vision_model.parameters(), *new.model.connector.parameters()]:
            p.add_(0.5 * (p.std() if p.numel() > 1 else 1.0) * torch.randn(p.shape, generator=gen))
    new.save_pretrained(tmp_path, safe_serialization=True)
    version = vlm_engine.policy_version
    try:
        await vlm_engine.load_weights_from_path(str(tmp_path), version + 1)
        after = await vlm_engine.generate("enc-1", chat.input_ids, sampling, images=[image])
    finally:
        await vlm_engine.load_weights_from_path(str(vlm_path), version)
    hf_new = hf_logprobs(new, chat.input_ids, chat.vision_inputs, after.token_ids)
    hf_old = hf_logprobs(hf_vlm, chat.input_ids, chat.vision_inputs, after.token_ids)
    diff = max_diff(after.logprobs, hf_new)
    assert diff < LOGPROB_ATOL, (after.logprobs, hf_new)
    assert max_diff(hf_old, hf_new) > 10 * max(diff, 1e-6)  # stale embeddings would have matched hf_old


async def test_weight_sync_by_learner_names_serves_the_new_vlm(vlm_engine, processor, hf_vlm, vlm_path):
    """The learner's weight sync into a VLM engine: every parameter (vision tower, connector, text
    model, head) sent under the name the learner's HF model has (`named_parameters_for_sync`) over the
    real gloo transport, staged, checksummed and committed through vLLM's Idefics3 loader. The engine
    then serves the new weights: its log-probs on an image prompt equal HF's with the same weights.
    Changes the module engine's weights; restores them at the end (a second sync)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from streamrl.models.multimodal import render_image_chat
    from streamrl.weight_sync import WeightSyncConfig, WeightSyncCoordinator

    new = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype="float32").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * (p.std() if p.numel() > 1 else 1.0) * torch.randn(p.shape, generator=gen))
    assert any("vision" in n for n, _ in new.named_parameters())  # the vision tower is synced too
    img = _image((30, 200, 90))
    chat = render_image_chat(processor, _chat(img, "describe it"))
    image = ImageInput.from_bytes(_png(img))
    sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    coordinator = WeightSyncCoordinator(WeightSyncConfig(), [vlm_engine])
    version = vlm_engine.policy_version
    try:
        result = await coordinator.sync([(n, p.detach()) for n, p in new.named_parameters()], version + 1)
        assert result.ok, result.error
        out = await vlm_engine.generate("sync-vlm", chat.input_ids, sampling, images=[image])
    finally:
        restore = await coordinator.sync([(n, p.detach()) for n, p in hf_vlm.named_parameters()], version + 2)
        await coordinator.close()
    assert restore.ok, restore.error
    assert out.policy_versions == [version + 1] * len(out.token_ids)
    hf_new = hf_logprobs(new, chat.input_ids, chat.vision_inputs, out.token_ids)
    hf_old = hf_logprobs(hf_vlm, chat.input_ids, chat.vision_inputs, out.token_ids)
    diff = max_diff(out.logprobs, hf_new)
    assert diff < LOGPROB_ATOL, (out.logprobs, hf_new)
    assert max_diff(hf_old, hf_new) > 10 * max(diff, 1e-6)  # the old weights would not match
    back = await vlm_engine.generate("sync-vlm-back", chat.input_ids, sampling, images=[image])
    assert (
        max_diff(back.logprobs, hf_logprobs(hf_vlm, chat.input_ids, chat.vision_inputs, back.token_ids)) < LOGPROB_ATOL
    )
