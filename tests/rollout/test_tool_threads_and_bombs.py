"""Two ways a tool could take the worker down, and what stops each:

- hung sync function tools could exhaust the event loop's default thread pool, after which every
  function tool would time out and tool-image admission (same pool) would wait forever: function tools
  run in bounded threads of their own, and admission has its own threads and a timeout;
- decompression bombs: a ~12 KB PNG declaring 10000 x 10000 pixels costs 400 MB on every decode;
  every decode site refuses more than `max_pixels`, read from the header.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import pytest
from PIL import Image

from streamrl.models.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageTooLarge,
    decode_image,
    describe_image,
    encode_png,
    read_response_image,
)
from streamrl.rollout.data.images import with_images
from streamrl.rollout.images import ImageStore
from streamrl.tools import ToolRegistry
from streamrl.tools.function import FunctionTool
from streamrl.tools.slots import Slots
from streamrl.tools.types import ToolCall

RELEASE = threading.Event()  # set at the end of a test: the hung functions return


def hang() -> str:
    """Never answers (until the test releases it)."""
    RELEASE.wait(60)
    return "late"


def healthy() -> str:
    """Answers at once."""
    return "fine"


def picture() -> list[dict]:
    """An image and a caption."""
    png = encode_png(Image.new("RGB", (4, 4), (255, 0, 0)))
    return [{"type": "image", "image": base64.b64encode(png).decode()}, {"type": "text", "text": "red"}]


@pytest.fixture
def release_hung():
    RELEASE.clear()
    yield
    RELEASE.set()


async def test_hung_sync_tools_block_neither_a_healthy_tool_nor_image_admission(release_hung):
    loop = asyncio.get_running_loop()
    default_pool = min(32, (__import__("os").cpu_count() or 1) + 4)  # the loop's default executor
    registry = ToolRegistry(
        [FunctionTool(hang, max_threads=default_pool + 2), FunctionTool(healthy), FunctionTool(picture)]
    )
    hung = [ToolCall(call_id=f"h{i}", name="hang", arguments={}) for i in range(default_pool + 2)]
    results = await registry.run_calls(hung, {}, timeout_s=0.3)
    assert all(r.is_error and "timed out" in r.text for r in results)

    start = time.perf_counter()
    calls = [
        ToolCall(call_id="ok", name="healthy", arguments={}),
        ToolCall(call_id="img", name="picture", arguments={}),
    ]
    ok, img = await asyncio.wait_for(registry.run_calls(calls, {}, timeout_s=5, images=ImageStore()), 10)
    assert ok.text == "fine" and not ok.is_error
    assert img.text == "red" and len(img.images) == 1 and not img.is_error
    assert time.perf_counter() - start < 5
    # the loop's own default pool is untouched by the hung tools
    assert await asyncio.wait_for(loop.run_in_executor(None, healthy), 5) == "fine"
    assert registry.tools["hang"].threads.num_abandoned == default_pool + 2  # still stuck in their threads


async def test_a_tools_threads_are_bounded_and_slots_come_back(release_hung):
    tool = FunctionTool(hang, max_threads=2)
    registry = ToolRegistry([tool])
    calls = [ToolCall(call_id=f"h{i}", name="hang", arguments={}) for i in range(4)]
    await registry.run_calls(calls, {}, timeout_s=0.2)
    assert tool.threads.slots.num_held == 2  # the two that started; the others gave up waiting
    RELEASE.set()
    deadline = time.monotonic() + 5
    while tool.threads.slots.num_held:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert tool.threads.num_abandoned == 0


async def test_slots_hand_over_in_order_and_survive_cancelled_waiters():
    slots = Slots(1)
    await slots.acquire()
    first = asyncio.ensure_future(slots.acquire())
    second = asyncio.ensure_future(slots.acquire())
    await asyncio.sleep(0)
    first.cancel()
    slots.release()
    await asyncio.wait_for(second, 1)
    assert slots.num_held == 1
    slots.release()
    assert slots.num_held == 0


# -- decompression bombs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A PNG of 10000 x 10000 one-bit pixels: ~12 KB on disk, 300 MB as the RGB the processors take."""
    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, format="PNG", optimize=True)
    assert len(buf.getvalue()) < 64_000
    return buf.getvalue()


def test_every_decode_site_refuses_a_bomb_from_its_header(bomb):
    assert DEFAULT_MAX_IMAGE_PIXELS < 10_000 * 10_000
    for decode in (describe_image, decode_image, read_response_image, ImageStore().put):
        with pytest.raises(ImageTooLarge, match="10000 x 10000"):
            decode(bomb)
    with pytest.raises(ImageTooLarge):  # an in-process PIL image is measured too
        read_response_image(Image.new("1", (10_000, 10_000)))
    small = encode_png(Image.new("RGB", (64, 64)))
    with pytest.raises(ImageTooLarge):  # the cap is configurable, per store or per call
        ImageStore(max_pixels=1000).put(small)
    assert describe_image(small, max_pixels=64 * 64).width == 64


def test_pils_own_bomb_warning_is_an_error(bomb, monkeypatch):
    """A decode with the cap raised past PIL's threshold still refuses: the warning is an error."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50_000_000)  # 10000 x 10000 is between 1x and 2x of it
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"Image size \(\d+ pixels\) exceeds limit")  # as at import
        with pytest.raises(ImageTooLarge, match="decompression bomb"):
            describe_image(bomb, max_pixels=10**9)


async def test_a_tool_returning_a_bomb_gets_an_error_observation(bomb):
    def returns_bomb() -> list[dict]:
        """Returns a decompression bomb."""
        return [{"type": "image", "image": base64.b64encode(bomb).decode()}, {"type": "text", "text": "look"}]

    registry = ToolRegistry([FunctionTool(returns_bomb)])
    store = ImageStore()
    [result] = await registry.run_calls(
        [ToolCall(call_id="b", name="returns_bomb", arguments={})], {}, timeout_s=10, images=store
    )
    assert result.is_error and "over the limit" in result.text and result.images == [] and len(store) == 0


def test_a_dataset_row_holding_a_bomb_fails_at_load_naming_it(bomb):
    row = {"images": [{"bytes": bomb}]}
    with pytest.raises(ValueError, match=r"row 3: images\[0\].*over the limit"):
        with_images([{"role": "user", "content": "<image>what is it?"}], row, "row 3")
