"""The image decoder (`rollout.images`) on random bytes, truncated and bit-flipped PNGs, and random
sources: the image's bytes / `ImageRef`, or a `ValueError` with a message, never another exception."""

from __future__ import annotations

import base64
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.models.images import describe_image, load_image_source, read_response_image


def _png(width: int, height: int, mode: str) -> bytes:
    from PIL import Image

    image = Image.new(mode, (width, height))
    image.putdata(
        [(x * 7 + 3) % 256 if mode == "L" else ((x * 7) % 256, x % 256, 255 - x % 256) for x in range(width * height)]
    )
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PNG = _png(17, 9, "RGB")
GRAY = _png(5, 40, "L")


def _decode(source) -> None:
    try:
        data = read_response_image(source)
    except ValueError as e:
        assert str(e), "a ValueError must say what is wrong"
        return
    ref = describe_image(data)
    assert ref.width > 0 and ref.height > 0


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=5000, derandomize=True)
@given(data=st.binary(max_size=400))
def test_random_bytes_are_an_image_or_a_value_error(data):
    _decode(data)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=5000, derandomize=True)
@given(
    image=st.sampled_from([PNG, GRAY]),
    cut=st.integers(0, 10**5),
    flips=st.lists(st.tuples(st.integers(0, 10**5), st.integers(1, 255)), max_size=3),
)
def test_truncated_or_corrupted_pngs_are_an_image_or_a_value_error(image, cut, flips):
    data = bytearray(image[: cut % (len(image) + 1)])
    for pos, mask in flips:
        if data:
            data[pos % len(data)] ^= mask
    _decode(bytes(data))


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=5000, derandomize=True)
@given(
    source=st.one_of(
        st.text(max_size=60),
        st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode()),
        st.binary(max_size=60).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
        st.integers(),
        st.none(),
    )
)
def test_random_image_sources_are_bytes_or_a_value_error(source):
    try:
        data = load_image_source(source)
    except ValueError as e:
        assert str(e)
        return
    assert isinstance(data, bytes)
    _decode(data)
