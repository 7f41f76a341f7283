"""Synthetic inputs for the report viewer's image tests: a character-level tokenizer folder (text-only
or VLM-like, with Idefics3's image tokens), run directories with samples.jsonl, and a buffer directory
holding images, built through the buffer's own append path. Fast and offline (no model build)."""

from __future__ import annotations

import json
import string
from pathlib import Path

from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.rollout.types import Trajectory

STARTED_AT = 1_700_000_000.0
IMAGE_SPECIALS = ["<fake_token_around_image>", "<global-img>", "<image>"]
CALL_TEXT = '<tool_call>\n{"name": "look", "arguments": {"what": "a & b"}}\n</tool_call><|im_end|>'
OBS_TEXT = "\n<|im_start|>user\n<tool_response>\nseen <3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ANSWER_TEXT = "It is \\boxed{red}.<|im_end|>"


def write_model_folder(path: Path, *, vlm: bool) -> Path:
    """tokenizer.json (one token per printable character + specials) and config.json; a VLM folder
    adds Idefics3's image tokens, a `vision_config` and `image_token_id` like the tiny-vlm build."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
    )

    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(string.printable)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t in ["<|im_start|>", "<|im_end|>", *(IMAGE_SPECIALS if vlm else [])]]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"model_type": "llama", "vocab_size": tok.get_vocab_size()}
    if vlm:
        config = {
            "model_type": "idefics3",
            "image_token_id": tok.token_to_id("<image>"),
            "vision_config": {"hidden_size": 64},
            "text_config": config,
        }
    (path / "config.json").write_text(json.dumps(config))
    return path


def encode(model_path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_path / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def image_text(num_tokens: int) -> str:
    return f"<fake_token_around_image><global-img>{'<image>' * num_tokens}<fake_token_around_image>"


def trajectory(
    model_path: Path,
    tid: str,
    *,
    prompt: str,
    call: str = CALL_TEXT,
    obs: str = OBS_TEXT,
    answer: str = ANSWER_TEXT,
    versions: tuple[int, int] = (0, 1),
    **fields,
) -> Trajectory:
    """Tool call interrupted halfway (version change), an observation, a final answer."""
    call_ids, obs_ids, answer_ids = (encode(model_path, t) for t in (call, obs, answer))
    half = len(call_ids) // 2
    mask = [1] * len(call_ids) + [0] * len(obs_ids) + [1] * len(answer_ids)
    pv = (
        [versions[0]] * half
        + [versions[1]] * (len(call_ids) - half)
        + [-1] * len(obs_ids)
        + [versions[1]] * len(answer_ids)
    )
    return Trajectory(
        trajectory_id=tid,
        group_id=fields.pop("group_id", "g1"),
        sample_index=fields.pop("sample_index", 0),
        agent_name="tool_agent",
        prompt_ids=encode(model_path, prompt),
        response_ids=call_ids + obs_ids + answer_ids,
        response_mask=mask,
        behavior_logprobs=[-0.25 if m else 0.0 for m in mask],
        policy_versions=pv,
        reward=1.0,
        num_turns=3,
        num_tool_calls=1,
        num_interrupts=1,
        **fields,
    )


def write_run(run_dir: Path, model_path: Path, samples: list[Trajectory], *, config: dict | None = None) -> Path:
    """run_info.json + samples.jsonl only (no metrics or timeline: the figures stay empty, so the
    page does not depend on matplotlib's SVG output)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).write_info(
        RunInfo(run_name="images", model_path=str(model_path), mode="async", config=config or {}, started_at=STARTED_AT)
    )
    with open(run_dir / "samples.jsonl", "w") as f:
        f.writelines(
            json.dumps({**traj.to_dict(), "learner_step": step}) + "\n" for step, traj in enumerate(samples, start=1)
        )
    return run_dir


def text_only_run(root: Path) -> Path:
    """The fixed text-only input whose page `data/report_text_only.html` was rendered from."""
    model = write_model_folder(root / "model", vlm=False)
    samples = [
        trajectory(
            model,
            f"t{i}",
            prompt=f"<|im_start|>user\nWhat colour is thing {i}?<|im_end|>\n<|im_start|>assistant\n",
            sample_index=i,
            versions=(i, i + 1),
        )
        for i in range(3)
    ]
    return write_run(root / "run", model, samples)
