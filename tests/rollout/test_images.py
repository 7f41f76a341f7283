"""Images in agent state and at the engine seam, without a model: `ImageRef` / `AgentData.images`
(JSON round-trip, placeholder-run invariant), the content-addressed `ImageStore`, and `images`
passing through `FakeEngine`, `ServerManager`, `RayEngineClient` and `EngineActor` unchanged."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from streamrl.engines import EngineConfig, FakeEngine, ImageInput, SamplingParams
from streamrl.models.images import ImageRef, decode_image, encode_png
from streamrl.models.multimodal import count_image_runs
from streamrl.rollout.images import ImageStore
from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.types import AgentData

pytestmark = pytest.mark.timeout(60)

IMG = 900  # the image placeholder token of these tests
WRAP = 901  # a wrapper token between runs (Idefics3's <fake_token_around_image>)


def png(rgb: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> bytes:
    from PIL import Image

    return encode_png(Image.new("RGB", size, rgb))


def test_image_ref_validates_its_fields():
    ImageRef(sha256="a" * 64, width=1, height=1)
    for bad in ({"sha256": "A" * 64}, {"sha256": "ab"}, {"width": 0}):
        with pytest.raises(ValueError):
            ImageRef(**{"sha256": "a" * 64, "width": 1, "height": 1, **bad})


def test_agent_data_with_images_round_trips_json():
    store = ImageStore()
    refs = [store.put(png((255, 0, 0))), store.put(png((0, 0, 255), (6, 8)))]
    data = AgentData(
        trajectory_id="t",
        group_id="g",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "image_ref": refs[0].sha256}, {"type": "text", "text": "hi"}],
            }
        ],
        prompt_ids=[1, WRAP, IMG, IMG, WRAP, 2],
        images=refs,
    )
    data.append_observation([WRAP, IMG, IMG, WRAP])
    data.append_sampled([5, 6], [-0.5, -0.25], [3, 3])
    back = AgentData.from_json(data.to_json())
    assert back == data
    assert back.images[1] == ImageRef(sha256=refs[1].sha256, width=6, height=8, mime="image/png")
    back.check_aligned(image_token_id=IMG)

    old = json.loads(data.to_json())
    del old["images"]  # a snapshot written before images existed
    assert AgentData.from_json(json.dumps(old)).images == []

    old["response_logprobs"] = old.pop("behavior_logprobs")  # a snapshot written before the rename
    assert AgentData.from_json(json.dumps(old)).behavior_logprobs == [0.0] * 4 + [-0.5, -0.25]


def test_trajectory_row_carries_image_refs_and_placeholder_counts():
    """An image trajectory's row names its images (placeholder order) and each run's length; without
    the model's image token it is refused (never a silent text row); a misaligned finished or partial
    row raises; a failed one is written without image columns; a text trajectory converts as before."""
    from streamrl.models.multimodal import image_run_lengths
    from streamrl.rollout.types import TrajectoryStatus

    store = ImageStore()
    red, green = store.put(png((255, 0, 0))), store.put(png((0, 255, 0)))
    data = AgentData(
        trajectory_id="t",
        group_id="g",
        prompt_ids=[1, WRAP, IMG, IMG, WRAP, 2],
        response_ids=[3, WRAP, IMG, IMG, IMG, WRAP],
        response_mask=[1, 0, 0, 0, 0, 0],
        behavior_logprobs=[-0.5, 0, 0, 0, 0, 0],
        policy_versions=[0, -1, -1, -1, -1, -1],
        images=[red, green],
    )
    row = data.to_trajectory(TrajectoryStatus.FINISHED, image_token_id=IMG)
    assert (row.image_refs, row.num_image_tokens) == ([red.sha256, green.sha256], [2, 3])
    assert image_run_lengths([IMG, 1, IMG, IMG, IMG], IMG) == [1, 3] and image_run_lengths([1, 2], IMG) == []
    with pytest.raises(ValueError, match="carries 2 images"):
        data.to_trajectory(TrajectoryStatus.FINISHED)
    data.images = [red]
    with pytest.raises(AssertionError, match="2 image placeholder runs"):
        data.to_trajectory(TrajectoryStatus.PARTIAL, image_token_id=IMG)
    failed = data.to_trajectory(TrajectoryStatus.FAILED, image_token_id=IMG)
    assert (failed.image_refs, failed.num_image_tokens) == ([], [])
    text = AgentData(trajectory_id="t", group_id="g", prompt_ids=[1, 2])
    row = text.to_trajectory(TrajectoryStatus.FINISHED, image_token_id=IMG)
    assert (row.image_refs, row.num_image_tokens) == ([], [])


def test_check_aligned_counts_placeholder_runs():
    ids = [1, WRAP, IMG, IMG, WRAP, WRAP, IMG, IMG, WRAP, 2]  # two adjacent images: two runs
    assert count_image_runs(ids, IMG) == 2
    assert count_image_runs([IMG, IMG, 3, IMG], IMG) == 2
    ref = ImageRef(sha256="b" * 64, width=4, height=4)
    data = AgentData(trajectory_id="t", group_id="g", prompt_ids=ids, images=[ref, ref])
    data.check_aligned(image_token_id=IMG)
    data.check_aligned()  # a text-only model: no image token, nothing to count
    data.images = [ref]
    with pytest.raises(AssertionError, match="2 image placeholder runs .* but 1 images"):
        data.check_aligned(image_token_id=IMG)
    # An observation bringing a third image must bring its reference too.
    data.images = [ref, ref]
    data.append_observation([WRAP, IMG, IMG, WRAP])
    with pytest.raises(AssertionError, match="3 image placeholder runs"):
        data.check_aligned(image_token_id=IMG)
    text = AgentData(trajectory_id="t", group_id="g", prompt_ids=[1, 2, 3])
    text.append_sampled([4], [-1.0], [0])
    text.check_aligned(image_token_id=IMG)


def test_image_store_is_content_addressed(tmp_path):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    assert png((255, 0, 0)) == red  # deterministic encoding: same pixels, same hash
    store = ImageStore(tmp_path / "images")
    ref = store.put(red)
    assert store.put(red) == ref and len(store) == 1
    assert (ref.width, ref.height, ref.mime) == (8, 6, "image/png")
    blue_ref = store.put(blue)
    assert blue_ref.sha256 != ref.sha256
    assert [i.data for i in store.inputs([blue_ref, ref, blue_ref])] == [blue, red, blue]
    assert decode_image(store.get(ref.sha256)).getpixel((0, 0)) == (255, 0, 0)

    other = ImageStore(tmp_path / "images")  # another process opening the same directory
    assert ref.sha256 in other and len(other) == 0
    assert other.get(ref.sha256) == red
    with pytest.raises(KeyError):
        ImageStore().get(ref.sha256)  # memory only: nothing there
    (tmp_path / "images" / blue_ref.sha256[:2] / blue_ref.sha256).write_bytes(red)
    with pytest.raises(ValueError, match="does not hash"):
        ImageStore(tmp_path / "images").get(blue_ref.sha256)
    with pytest.raises(ValueError, match="not an image"):
        store.put(b"not a png")


def test_image_input_checks_its_hash_and_pickles():
    image = ImageInput.from_bytes(png((1, 2, 3)))
    image.check()
    assert pickle.loads(pickle.dumps(image)) == image  # it travels in Ray calls
    with pytest.raises(ValueError, match="not to their reference"):
        ImageInput(sha256=image.sha256, data=png((3, 2, 1))).check()


async def test_fake_engine_records_and_checks_images():
    engine = FakeEngine(script=[[7, 8, 9]], image_token_id=IMG)
    images = [ImageInput.from_bytes(png((9, 9, 9)))]
    out = await engine.generate("r0", [1, WRAP, IMG, IMG, WRAP], SamplingParams(max_tokens=3), images=images)
    assert out.token_ids == [7, 8, 9] and out.num_prompt_tokens == 5
    await engine.generate("r1", [1, 2], SamplingParams(max_tokens=3))
    assert engine.images_seen == [("r0", images), ("r1", [])]
    with pytest.raises(ValueError, match="1 image placeholder runs for 0 images"):
        await engine.generate("r2", [1, IMG], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="0 image placeholder runs for 1 images"):
        await engine.generate("r3", [1, 2], SamplingParams(max_tokens=3), images=images)
    with pytest.raises(ValueError, match="not to their reference"):
        bad = [ImageInput(sha256=images[0].sha256, data=png((0, 0, 0)))]
        await engine.generate("r4", [1, IMG], SamplingParams(max_tokens=3), images=bad)
    assert [r for r, _ in engine.images_seen] == ["r0", "r1"]  # rejected requests never ran


async def test_server_manager_passes_images_through():
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    manager = ServerManager(engines)
    images = [ImageInput.from_bytes(png((4, 5, 6))), ImageInput.from_bytes(png((6, 5, 4)))]
    _, engine_id = await manager.generate("traj", "r0", [1, IMG, 2, IMG], SamplingParams(max_tokens=2), images=images)
    await manager.generate("traj", "r1", [1, 2], SamplingParams(max_tokens=2))
    assert manager.engine(engine_id).images_seen == [("r0", images), ("r1", [])]


class _StubRemote:
    """`actor.method.remote(...)` of a Ray actor handle: an awaitable of the actor method's result."""

    def __init__(self, method):
        self._method = method

    def remote(self, *args, **kwargs):
        return asyncio.ensure_future(self._method(*args, **kwargs))


class _StubActor:
    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        return _StubRemote(getattr(self._actor, name))


async def test_ray_client_and_actor_pass_images_through():
    from streamrl.streaming.actors.engine import EngineActor, RayEngineClient

    cfg = EngineConfig(device="cpu", call_timeout_s=10.0, startup_timeout_s=10.0)
    actor = EngineActor(cfg, "ray-0")
    fake = FakeEngine("ray-0", script=[[3, 4]], image_token_id=IMG)
    fake.device = "cpu"
    actor._engine = fake  # the actor's engine, without building vLLM
    actor._starting = asyncio.get_running_loop().create_future()
    actor._starting.set_result(None)
    client = RayEngineClient(_StubActor(actor), "ray-0", cfg=cfg)
    images = [ImageInput.from_bytes(png((7, 7, 7)))]
    sent = pickle.loads(pickle.dumps(images))  # what a Ray call delivers
    out = await client.generate("r0", [1, IMG], SamplingParams(max_tokens=2), images=sent)
    assert out.token_ids == [3, 4]
    await client.generate("r1", [1, 2], SamplingParams(max_tokens=2))
    assert fake.images_seen == [("r0", images), ("r1", [])]
