"""Images in the report's trajectory viewer: one chip per image with its thumbnail from the run's
buffer image log (written through `ReplayBuffer.append`), observation images inside their observation
span, missing images and ref/run mismatches rendered cleanly, and a text-only run's page unchanged."""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

import pytest
from PIL import Image

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.buffer.types import ImageBlob
from streamrl.models.images import encode_png
from streamrl.observability.report import write_report
from streamrl.observability.report_tokens import ImageTokens, image_spans
from streamrl.rollout.images import ImageStore
from tests.observability.report_images_helpers import (
    OBS_TEXT,
    encode,
    image_text,
    text_only_run,
    trajectory,
    write_model_folder,
    write_run,
)

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).with_name("data") / "report_text_only.html"
CHIP_RE = re.compile(
    r'<span class="imgchip( missing)?" title="([^"]*)">'
    r'(?:<img src="data:image/png;base64,([^"]+)" alt="">)?([^<]*)</span>'
)


def _blob(color: tuple[int, int, int], size: tuple[int, int]) -> ImageBlob:
    data = encode_png(Image.new("RGB", size, color))
    return ImageBlob.from_ref(ImageStore().put(data), data)


RED = _blob((255, 0, 0), (200, 100))  # thumbnail capped to 128×64
GREEN = _blob((0, 255, 0), (20, 30))  # small: never enlarged
BLUE = _blob((0, 0, 255), (64, 64))
LOST = _blob((9, 9, 9), (8, 8))  # referenced by a sample, never written to the buffer


def _prompt(*images: tuple[ImageBlob, int]) -> str:
    return (
        "<|im_start|>user\n"
        + "".join(image_text(n) for _, n in images)
        + "What colour?<|im_end|>\n<|im_start|>assistant\n"
    )


def _obs_with_image(num_tokens: int) -> str:
    return OBS_TEXT.replace("seen <3", "seen <3 " + image_text(num_tokens))


def _image_run(tmp_path: Path, **report_kw) -> tuple[str, dict[str, list]]:
    """Four samples: a prompt image + an observation image; two adjacent prompt images; a prompt image
    whose bytes never reached the buffer; a row with one placeholder run but two image_refs."""
    model = write_model_folder(tmp_path / "model", vlm=True)
    with_obs = trajectory(
        model,
        "t-obs",
        prompt=_prompt((RED, 4)),
        obs=_obs_with_image(3),
        image_refs=[RED.sha256, GREEN.sha256],
        num_image_tokens=[4, 3],
    )
    adjacent = trajectory(
        model,
        "t-two",
        prompt=_prompt((GREEN, 4), (BLUE, 2)),
        sample_index=1,
        image_refs=[GREEN.sha256, BLUE.sha256],
        num_image_tokens=[4, 2],
    )
    lost = trajectory(
        model, "t-lost", prompt=_prompt((LOST, 4)), group_id="g2", image_refs=[LOST.sha256], num_image_tokens=[4]
    )
    bad = trajectory(
        model,
        "t-bad",
        prompt=_prompt((BLUE, 4)),
        group_id="g3",
        image_refs=[BLUE.sha256, RED.sha256],
        num_image_tokens=[4, 4],
    )
    run = tmp_path / "run"
    buf = ReplayBuffer(BufferConfig(root_dir=str(run / "buffer"), batch_size=2, group_size=2))
    buf.append([with_obs, adjacent], images=[RED, GREEN, BLUE])  # the buffer's own write path
    buf.close()
    write_run(run, model, [with_obs, adjacent, lost, bad])
    page = write_report(run, **report_kw).read_text()
    sections = re.split(r'<details class="traj"', page)[1:]
    by_tid = {re.search(r"<summary>(\S+)", s).group(1): CHIP_RE.findall(s) for s in sections}
    return page, by_tid


def _decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


def test_each_image_is_one_chip_with_a_capped_thumbnail(tmp_path):
    page, chips = _image_run(tmp_path)
    (red, green), (green2, blue) = chips["t-obs"], chips["t-two"]
    assert [c[3] for c in (red, green, green2, blue)] == [
        "[image 200×100, 4 tokens]",
        "[image 20×30, 3 tokens]",
        "[image 20×30, 4 tokens]",
        "[image 64×64, 2 tokens]",
    ]
    assert not any(c[0] for c in (red, green, green2, blue))  # none marked missing
    for chip, size, colour in (
        (red, (128, 64), (255, 0, 0)),
        (green, (20, 30), (0, 255, 0)),
        (blue, (64, 64), (0, 0, 255)),
    ):
        thumb = _decode(chip[2])
        assert thumb.size == size  # longest side capped at 128, small images kept as they are
        assert thumb.getpixel((thumb.width // 2, thumb.height // 2)) == colour
    # placeholders (and their wrapper tokens) are not shown as text anywhere, prompts included
    assert "&lt;image&gt;" not in page and "&lt;global-img&gt;" not in page and "fake_token_around_image" not in page
    assert ".imgchip {" in page and "Each image is one chip" in page


def test_observation_image_sits_inside_its_observation_span(tmp_path):
    page, _ = _image_run(tmp_path)
    section = page.split("<summary>t-obs")[1].split('<details class="traj"')[0]
    tokens = section.split('<div class="tokens">')[1]
    obs = re.findall(
        r'<span class="tok obs" title="observation \(mask 0\) #(\d+)–#(\d+)">(.*?)</span>(?=<span class="(?:tok|vchg))',
        tokens,
        re.DOTALL,
    )
    assert len(obs) == 1  # one observation span, the chip inside it
    first, last, inner = obs[0]
    assert "seen &lt;3 " in inner and "[image 20×30, 3 tokens]" in inner and "&lt;/tool_response&gt;" in inner
    model = tmp_path / "model"
    assert int(last) - int(first) + 1 == len(encode(model, _obs_with_image(3)))  # the span still covers every obs token
    prompt = section.split('<div class="prompt">')[1].split("</div>")[0]
    assert "[image 200×100, 4 tokens]" in prompt and "What colour?" in prompt
    # mask / version colouring unchanged: sampled tokens keep their version classes and the change marker
    assert (
        '<span class="vchg">v0→v1</span>' in tokens
        and 'class="tok v0 call"' in tokens
        and 'class="tok v1 special"' in tokens
    )
    # the call / observation table shows the chip label, not <image>×N
    assert "<pre>seen &lt;3 [image 20×30, 3 tokens]</pre>" in section


def test_missing_image_and_mismatched_refs_render_cleanly(tmp_path):
    page, chips = _image_run(tmp_path)
    [(missing, title, src, label)] = chips["t-lost"]
    assert missing and not src and label == "[missing image, 4 tokens]" and LOST.sha256 in html.unescape(title)
    [(missing, title, src, label)] = chips["t-bad"]  # 1 run, 2 refs: no lookup, flagged
    assert missing and not src and label == "[missing image, 4 tokens]"
    problems = page.split('<div class="problems">')[1].split("</div>")[0]
    assert "1 image(s) referenced by sampled trajectories are not in the buffer&#39;s image log" in problems
    assert "trajectory t-bad: 1 image placeholder runs but 2 image_refs" in problems
    assert "t-obs" not in problems and "t-two" not in problems


def test_thumbnail_budget_leaves_a_clear_note(tmp_path):
    page, chips = _image_run(tmp_path, max_image_bytes=1)
    shown = [c for row in chips.values() for c in row if not c[0]]
    assert len(shown) == 4 and not any(c[2] for c in shown)  # chips stay, thumbnails go
    assert "4 images not shown: the report&#39;s thumbnail budget" in page
    page, chips = _image_run(tmp_path / "small", max_image_px=16)
    assert max(_decode(chips["t-obs"][0][2]).size) == 16


def test_text_only_run_page_is_unchanged(tmp_path):
    """The page of a fixed text-only run equals the one the viewer rendered before images existed
    (data/report_text_only.html, generated once from the code at git HEAD with the same helpers)."""
    run = text_only_run(tmp_path)
    page = write_report(run).read_text().replace(str(tmp_path), "ROOT")
    assert page == FIXTURE.read_text()


def test_image_spans_take_wrappers_and_split_them_between_adjacent_images():
    tokens = ImageTokens(image_token_id=9, wrapper_ids=frozenset({7, 8}))
    ids = [1, 7, 8, 9, 9, 7, 7, 8, 9, 7, 2, 9, 3]  # two adjacent images, then a bare run
    assert image_spans(ids, tokens) == [(1, 5, 2), (5, 10, 1), (11, 12, 1)]
    assert image_spans([1, 2, 3], tokens) == []


def test_image_refs_with_a_text_model_are_a_problem_not_a_crash(tmp_path):
    vlm = write_model_folder(tmp_path / "vlm", vlm=True)  # ids with image tokens ...
    row = trajectory(vlm, "t-img", prompt=_prompt((RED, 4)), image_refs=[RED.sha256], num_image_tokens=[4])
    run = write_run(
        tmp_path / "run", write_model_folder(tmp_path / "text", vlm=False), [row]
    )  # ... decoded by a text model
    page = write_report(run).read_text()
    assert "1 sampled trajectories reference images but model" in page and "imgchip" not in page
