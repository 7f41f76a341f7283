"""A short supervised warm-up that teaches a fresh model our tool-call format before RL.

SmolLM2 has never seen `<tool_call>` in our template, so a cold GRPO run would spend its whole budget
discovering the format. The warm-up trains on generated gold transcripts (calculator call -> result ->
boxed answer) with the loss on assistant tokens only, and caches the result under $STREAMRL_CACHE
keyed by model and warm-up settings, so `make run` pays for it once per machine.

`prepare_model` is what `streamrl train` calls: model conversion (`resolve_model`) and the warm-up
run in a child process (`python -m streamrl.streaming.sft`), so the driver never imports torch or holds a
model (it kept 5 GB after an in-process warm-up); a failed child is one error with its exit code and
the last lines of its log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from streamrl.core.atomic import build_once
from streamrl.observability.logs import format_duration
from streamrl.streaming.errors import StreamRLError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
PROGRESS = "[progress]"  # marks the child's lines that the parent shows on the console
PROGRESS_POLL_S = 1.0


def assistant_mask(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask marking assistant-turn tokens.

    Built turn by turn from rendered prefixes, so the mask matches exactly what generation produces
    (the assistant's text and its end-of-turn token, not the `<|im_start|>assistant` header)."""
    ids: list[int] = []
    mask: list[int] = []
    prev_text = ""
    for i, msg in enumerate(messages):
        is_asst = msg["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages[: i + 1], tools=tools, tokenize=False, add_generation_prompt=False
        )
        if is_asst:
            header = tokenizer.apply_chat_template(
                messages[:i], tools=tools, tokenize=False, add_generation_prompt=True
            )
            if header.startswith(prev_text):
                piece = tokenizer.encode(header[len(prev_text) :], add_special_tokens=False)
                ids += piece
                mask += [0] * len(piece)
                prev_text = header
        piece = tokenizer.encode(text[len(prev_text) :], add_special_tokens=False)
        ids += piece
        mask += [1 if is_asst else 0] * len(piece)
        prev_text = text
    return ids, mask


def _train(model_path: str, out_dir: Path, cfg: Any, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.rollout.data.loaders import CODE_INTERPRETER, make_arithmetic_dataset, make_tool_sft_transcripts
    from streamrl.tools.config import load_tool_config

    torch.manual_seed(seed)
    tokenizer = cast(
        "PreTrainedTokenizerBase", AutoTokenizer.from_pretrained(model_path)
    )  # transformers types it as possibly None (its backends import conditionally)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tools = load_tool_config(cfg.rollout.agent.tool_config).schemas() if cfg.rollout.agent.tool_config else None
    records = make_arithmetic_dataset(cfg.sft.num_examples, seed + 7919, difficulty=cfg.sft.difficulty)
    names = {t["function"]["name"] for t in tools or []}
    tool_name = CODE_INTERPRETER if CODE_INTERPRETER in names else "calculator"  # what the transcripts call
    transcripts = make_tool_sft_transcripts(
        records, tool_name=tool_name, tool_fraction=cfg.sft.tool_fraction, seed=seed
    )
    examples = [assistant_mask(tokenizer, conv, tools) for conv in transcripts]
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr)
    model.train()
    pad = tokenizer.pad_token_id or 0
    started = time.monotonic()
    for step in range(cfg.sft.num_steps):
        batch = [examples[(step * cfg.sft.batch_size + j) % len(examples)] for j in range(cfg.sft.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor(
            [[t if m else -100 for t, m in zip(ids, mask)] + [-100] * (width - len(ids)) for ids, mask in batch]
        )
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        done, elapsed = step + 1, time.monotonic() - started
        eta = elapsed / done * (cfg.sft.num_steps - done)
        logger.info(
            "%s sft step %d/%d · loss %.4f · %s elapsed · eta %s",
            PROGRESS,
            done,
            cfg.sft.num_steps,
            loss.item(),
            format_duration(elapsed),
            format_duration(eta),
        )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def maybe_warm_up(cfg: Any, model_path: str) -> Path:
    """Return a warmed-up model folder (built once, cached) for `model_path`."""
    from streamrl.models import cache_root
    from streamrl.tools.config import load_tool_config

    # Keyed by what the transcripts render (the tool schemas), not by the tool config's path: a
    # config naming another class under the same schema (workloads.tools.ledger) reuses the warm-up.
    tools = load_tool_config(cfg.rollout.agent.tool_config).schemas() if cfg.rollout.agent.tool_config else None
    key = hashlib.sha256(
        json.dumps([str(model_path), cfg.sft.model_dump(mode="json"), tools, cfg.data.seed], sort_keys=True).encode()
    ).hexdigest()[:12]
    final = cache_root() / "sft" / f"{Path(model_path).name}-{key}"

    def train(tmp: Path) -> None:
        logger.info("%s SFT warm-up of %s (%d steps)", PROGRESS, Path(model_path).name, cfg.sft.num_steps)
        _train(model_path, tmp, cfg, cfg.data.seed)

    warmed = build_once(final, train, rebuild=not cfg.sft.skip_if_cached)
    logger.info("SFT warm-up ready: %s", warmed)
    return warmed


def _prepare_in_process(cfg: Any) -> Path:
    from streamrl.models import resolve_model

    logger.info("%s model %r: converting or building it (cached after the first run)", PROGRESS, cfg.model)
    path = resolve_model(cfg.model)
    path = maybe_warm_up(cfg, str(path)) if cfg.sft.enabled else path
    check_prompt_lengths(cfg, path)
    return path


def check_prompt_lengths(cfg: Any, model_path: str | Path, *, sample: int = 32) -> list[int]:
    """Stop a run whose prompts cannot fit before any actor starts: render the first `sample` prompts
    as the agent loop does (chat template + the tool schemas) and raise when every one is longer than
    `rollout.agent.prompt_length` (every trajectory would fail, group after group, epoch after epoch);
    warn when some are. Returns the lengths."""
    from transformers import AutoTokenizer

    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.data import load_records
    from streamrl.tools.config import load_tool_config

    agent = cfg.rollout.agent
    tools = load_tool_config(agent.tool_config).schemas() if agent.tool_config else None
    records = load_records(cfg.data.source, min(cfg.data.num_prompts, sample), cfg.data.seed, cfg.data.difficulty)[
        :sample
    ]
    encoder = ObservationEncoder(AutoTokenizer.from_pretrained(model_path))
    processor = None
    if cfg.rollout.engine.max_images_per_prompt > 0:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_path)
    lengths = [_prompt_length(encoder, processor, r.messages, tools) for r in records]
    too_long = sum(n > agent.prompt_length for n in lengths)
    if lengths and too_long == len(lengths):
        raise ValueError(
            f"every prompt checked ({len(lengths)}) is longer than rollout.agent.prompt_length={agent.prompt_length}: "
            f"{min(lengths)}-{max(lengths)} tokens with the chat template and the tool schemas; raise "
            "rollout.agent.prompt_length (and rollout.engine.max_model_len with it)"
        )
    if too_long:
        logger.warning(
            "%d of the first %d prompts are longer than rollout.agent.prompt_length=%d (up to %d tokens): "
            "their trajectories will fail",
            too_long,
            len(lengths),
            agent.prompt_length,
            max(lengths),
        )
    return lengths


def _prompt_length(encoder: Any, processor: Any, messages: list[dict], tools: list[dict] | None) -> int:
    """Prompt tokens as the agent loop counts them: an image prompt on a VLM through the loop's own
    admission and expansion (each image is its whole placeholder run, not the template's one token)."""
    from streamrl.rollout.agent_loop.image_prompt import admit_images, encode_image_prompt, has_image_parts

    if processor is None or not has_image_parts(messages):
        return len(encoder.encode_prompt(messages, tools))
    from streamrl.rollout.images import ImageStore

    store = ImageStore()
    admitted, refs = admit_images(messages, store)
    return len(encode_image_prompt(encoder, processor, admitted, [store.get(r.sha256) for r in refs], tools))


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def prepare_model(cfg: Any, *, log_file: str | Path | None = None) -> str:
    """The model folder a run starts from: `cfg.model` built or converted (cached) and, with
    `sft.enabled`, warmed up (cached). Work happens in a child process whose output goes to
    `log_file` (else this process's console); raises StreamRLError if it fails."""
    from streamrl.models import ready_model
    from streamrl.observability.logs import is_verbose

    folder = ready_model(cfg.model)
    if not cfg.sft.enabled and folder is not None:
        return str(folder)  # a folder, or a built-in already in the cache: nothing to build, no child
    work = Path(tempfile.mkdtemp(prefix="streamrl-prepare-"))
    cfg_path, out_path = work / "config.json", work / "model_path"
    cfg_path.write_text(cfg.model_dump_json())
    log = Path(log_file) if log_file is not None and not is_verbose() else None
    cmd = [sys.executable, "-m", "streamrl.streaming.sft", "--config-json", str(cfg_path), "--out", str(out_path)]
    what = "model conversion and SFT warm-up" if cfg.sft.enabled else "model build"
    logger.info("preparing %r (%s, cached after the first run)%s", cfg.model, what, f"; log: {log}" if log else "")
    try:
        rc = _run_child(cmd, log, status=f"preparing the model ({what})")
        if rc != 0:
            killed = (
                " (SIGKILL: most likely out of memory; sft.batch_size sets the warm-up's)"
                if rc == -signal.SIGKILL
                else ""
            )
            tail = f"; last lines of {log}:\n{_tail(log)}" if log is not None else " (its output is above)"
            raise StreamRLError(
                f"preparing the model ({what}) failed in its child process with exit code {rc}{killed}{tail}"
            )
        return out_path.read_text().strip()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_child(cmd: list[str], log: Path | None, *, status: str) -> int:
    """Run `cmd` to completion with its output appended to `log` (None: this console). Meanwhile the
    child's progress lines (marked `PROGRESS`: the conversion, each warm-up step with its ETA) reach
    the console: as the spinner's text on a terminal, else as log lines. Returns the exit code."""
    from streamrl.observability.logs import console

    if log is None:
        return subprocess.run(cmd, check=False).returncode
    log.parent.mkdir(parents=True, exist_ok=True)
    spinner = console().status(status) if console().is_terminal else None
    with open(log, "ab") as out, spinner or nullcontext():
        start = out.tell()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        follow = ProgressFollower(log, start)
        while True:
            try:
                rc = child.wait(timeout=PROGRESS_POLL_S)
            except subprocess.TimeoutExpired:
                rc = None
            for line in follow.new_lines():
                if spinner is not None:
                    spinner.update(f"{status}: {line}")
                else:
                    logger.info("%s", line)
            if rc is not None:
                return rc


class ProgressFollower:
    """Reads a growing log from an offset and returns the text of its new `PROGRESS` lines (a partial
    last line waits for its end)."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset, self._partial = path, offset, b""

    def new_lines(self) -> list[str]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        marker = PROGRESS.encode()
        return [line.split(marker, 1)[1].decode(errors="replace").strip() for line in lines if marker in line]


def main(argv: list[str] | None = None) -> int:
    """Child process of `prepare_model`: convert/build the model, warm it up, write its path to --out."""
    parser = argparse.ArgumentParser(prog="python -m streamrl.streaming.sft")
    parser.add_argument("--config-json", required=True, help="the resolved StreamRLConfig as JSON")
    parser.add_argument("--out", required=True, help="file that receives the prepared model folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from streamrl.streaming.config import StreamRLConfig

    cfg = StreamRLConfig.model_validate_json(Path(args.config_json).read_text())
    path = _prepare_in_process(cfg)
    Path(args.out).write_text(str(path))
    logger.info("model ready: %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
