"""The learner on a vision-language model (docs/multimodal.md, "How an image travels"), on the tiny Idefics3 VLM.

`PolicyModel` runs the full multimodal model (vision tower + connector + text decoder) and scores
tokens exactly as the plain HF model does; pixels reach the forward from image bytes through
`TrainBatch.from_padded`, stay with their row through micro-batching, and a GRPO train step sends
gradients into the vision tower. The vLLM check repeats tests/rollout/test_tiny_vlm.py's contract
through `PolicyModel`.
"""

from __future__ import annotations

import gc
import io
import math

import pytest
import torch

from tests.learner.helpers import padded_batch

pytestmark = pytest.mark.timeout(180)

# PolicyModel and HF run the same fp32 ops (the head chunked or not), so they agree far below this.
HF_ATOL = 1e-5
VLLM_ATOL = 1e-4  # as tests/rollout/test_tiny_vlm.py


def _image(rgb: tuple[int, int, int], size: tuple[int, int] = (56, 56)):
    from PIL import Image

    img = Image.new("RGB", size, rgb)
    img.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (0, 0, size[0] // 2, size[1] // 2))  # not flat
    return img


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _chat(imgs, text: str = "what is this?") -> list[dict]:
    parts = [{"type": "image", "image": img} for img in imgs]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm_path():
    from streamrl.models.tiny_vlm import resolve_tiny_vlm

    return resolve_tiny_vlm()


@pytest.fixture(scope="module")
def processor(vlm_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_path)


@pytest.fixture(scope="module")
def policy(vlm_path):
    from streamrl.learner.model import PolicyModel, load_lm

    lm = load_lm(vlm_path, torch.device("cpu"))
    return PolicyModel(lm, with_value_head=False).eval()


def _policy_logprobs(policy, ids: list[int], images, *, chunk: int = 0) -> torch.Tensor:
    policy.logits_chunk_tokens = chunk
    try:
        with torch.no_grad():
            out = policy(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), images=images)
    finally:
        policy.logits_chunk_tokens = 0
    return out.logp[0]


def test_policy_logprobs_equal_hf_and_depend_on_the_pixels(vlm_path, processor, policy):
    from transformers import AutoModelForImageTextToText

    from streamrl.learner.vision import image_vision_inputs
    from streamrl.models.multimodal import render_image_chat

    hf = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32).eval()
    img = _image((220, 40, 40))
    chat = render_image_chat(processor, _chat([img]))
    response = processor.tokenizer.encode(" a red square with a cyan corner", add_special_tokens=False)
    ids = chat.input_ids + response
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), **chat.vision_inputs).logits[0].float()
    hf_logp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    row = image_vision_inputs(processor, [_png(img)])  # from PNG bytes, as the learner gets them
    assert row.num_images == 1
    assert torch.equal(row.pixel_values, chat.vision_inputs["pixel_values"][0])
    for chunk in (0, 7):  # one [B, T, V] head, and the chunked head
        logp = _policy_logprobs(policy, ids, [row], chunk=chunk)
        assert logp[0] == 0.0
        diff = (logp[1:] - hf_logp).abs().max().item()
        assert diff < HF_ATOL, (chunk, diff)

    # The pixels are really used: another image, or none, moves the response log-probs far more.
    n = len(chat.input_ids)
    other = image_vision_inputs(processor, [_png(_image((10, 200, 90)))])
    moved = (_policy_logprobs(policy, ids, [other])[n:] - hf_logp[n - 1 :]).abs().max().item()
    assert moved > 1e-3, moved
    no_pixels = (_policy_logprobs(policy, ids, [None])[n:] - hf_logp[n - 1 :]).abs().max().item()
    assert no_pixels > 1e-3, no_pixels


def _image_batch(processor, *, seed: int = 0):
    """Four rows of two GRPO groups: two images / one image / no image / one (wide) image; prompts
    and responses of different lengths so token-budget packing reorders and splits them."""
    from streamrl.models.multimodal import render_image_chat

    g = torch.Generator().manual_seed(seed)
    row_images = [
        [_image((200, 30, 30)), _image((30, 30, 200))],
        [_image((30, 200, 30))],
        [],
        [_image((120, 120, 20), size=(56, 28))],
    ]
    seqs, behav = [], []
    for b, imgs in enumerate(row_images):
        prompt = render_image_chat(processor, _chat(imgs, "describe" + " it" * b)).input_ids
        resp = torch.randint(10, 600, (4 + 2 * b,), generator=g).tolist()  # text ids (vocab 644)
        seqs.append((prompt, resp, [1] * len(resp)))
        behav.append((-7.0 - torch.rand(len(resp), generator=g)).tolist())
    pb = padded_batch(seqs, rewards=[1.0, 0.0, 0.0, 1.0], group_index=[0, 0, 1, 1], behavior_logprobs=behav)
    pb.images = [[_png(img) for img in imgs] for imgs in row_images]
    return pb


def _engine(vlm_path, **kw):
    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.engine import TrainingEngine

    base = dict(model=str(vlm_path), device="cpu", lr=1e-3, micro_batch_tokens=4096, seed=0, algo="grpo")
    base.update(kw)
    return TrainingEngine(LearnerConfig(**base))


def test_grpo_step_on_image_rows_trains_the_vision_tower(vlm_path, processor, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    engine = _engine(vlm_path, gradient_checkpointing=True, logits_chunk_tokens=16, micro_batch_tokens=64)
    assert engine.processor is not None and engine.policy.is_vision
    vision = engine.policy.lm.model.vision_model
    before = {k: v.detach().clone() for k, v in vision.named_parameters()}
    metrics = engine.train_step(_image_batch(processor))
    assert math.isfinite(metrics["learner/loss"]) and metrics["learner/grad_norm"] > 0
    assert engine.policy_version == 1
    for name, param in vision.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert not torch.equal(param.detach(), before[name]), name
    connector = engine.policy.lm.model.connector.modality_projection.proj.weight
    assert connector.grad is not None and connector.grad.abs().sum() > 0

    # the HF export carries the image processor, so vLLM (and HF) can load it as a VLM again
    out = engine.save_hf(tmp_path / "hf")
    assert AutoProcessor.from_pretrained(out).image_seq_len == processor.image_seq_len
    reloaded = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    key = "model.vision_model.embeddings.patch_embedding.weight"
    assert torch.equal(reloaded.state_dict()[key], engine.policy.lm.state_dict()[key])


def test_micro_batches_keep_each_row_with_its_pixels(vlm_path, processor):
    from streamrl.learner.model import pack_by_tokens
    from streamrl.learner.types import TrainBatch
    from streamrl.learner.vision import RowImages

    batch = _image_batch(processor, seed=1)
    whole = _engine(vlm_path)
    split = _engine(vlm_path, micro_batch_tokens=100)
    # reordered (longest first), a 2-image row packed with a 1-image row, the text row on its own
    assert pack_by_tokens(batch.seq_lens.tolist(), 100) == [[3], [0, 1], [2]]

    ref = whole.compute_logprobs(batch)
    got = split.compute_logprobs(batch)
    assert (got - ref).abs().max().item() < HF_ATOL

    # Not vacuous: pixels attached to the wrong row (rows 1 and 3 swapped, row 0's two images in
    # the other order) move exactly those rows, so a packing that mixed rows up would be caught.
    tb = TrainBatch.from_padded(batch, processor=processor)
    assert [r.num_images if r else 0 for r in tb.images] == [2, 1, 0, 1]
    first = tb.images[0]
    reversed_first = RowImages(
        num_images=2, pixel_values=first.pixel_values.flip(0), pixel_attention_mask=first.pixel_attention_mask.flip(0)
    )
    tb.images = [reversed_first, tb.images[3], None, tb.images[1]]
    moved = (split.compute_logprobs(tb) - ref).abs().amax(dim=1)
    assert (moved[[0, 1, 3]] > 1e-3).all() and moved[2] < HF_ATOL, moved


def test_image_rows_are_checked_against_their_placeholders(processor):
    from streamrl.learner.types import TrainBatch

    batch = _image_batch(processor)
    swapped = list(batch.images)
    swapped[0], swapped[1] = swapped[1], swapped[0]  # 1 image where the ids hold 2 placeholder runs
    batch.images = swapped
    with pytest.raises(ValueError, match="row 0: 8 image tokens"):
        TrainBatch.from_padded(batch, processor=processor)
    batch.images = None  # placeholders with no pixels at all
    with pytest.raises(ValueError, match="image tokens in input_ids"):
        TrainBatch.from_padded(batch, processor=processor)
    batch.images = _image_batch(processor).images
    with pytest.raises(ValueError, match="no image processor"):  # a text-only learner gets images
        TrainBatch.from_padded(batch)

    text = padded_batch([([5, 6, 7], [8, 9], [1, 1])], rewards=[1.0], group_index=[0])
    assert TrainBatch.from_padded(text, processor=processor).images is None  # no cost for text rows


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_policy_logprobs_match_vllm(vlm_path, processor, policy):
    """The step-4 contract: vLLM's sampled-token log-probs on an image prompt == PolicyModel's."""
    from tests.fixtures.vllm import skip_without_vllm, tiny_vlm_llm

    skip_without_vllm()
    from vllm import SamplingParams

    from streamrl.learner.vision import image_vision_inputs
    from streamrl.models.multimodal import render_image_chat

    img = _image((220, 40, 40))
    chat = render_image_chat(processor, _chat([img]))
    llm = tiny_vlm_llm(vlm_path, max_images=1)
    try:
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=0, ignore_eos=True)
        (out,) = llm.generate(chat.vllm_prompt(), params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    vllm_lps = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)])
    ids = list(out.prompt_token_ids) + tokens
    assert ids[: len(chat.input_ids)] == chat.input_ids
    logp = _policy_logprobs(policy, ids, [image_vision_inputs(processor, [_png(img)])], chunk=5)
    diff = (logp[len(chat.input_ids) :] - vllm_lps).abs().max().item()
    assert diff < VLLM_ATOL, diff
