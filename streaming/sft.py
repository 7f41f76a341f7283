"""A short supervised warm-up that teaches a fresh model our tool-call format before RL.

SmolLM2 has never seen `<tool_call>` in our template, so a cold GRPO run would spend its whole budget
discovering the format. The warm-up trains on generated gold transcripts (calculator call -> result ->
boxed answer) with the loss on assistant tokens only, and caches the result under $STREAMRL_CACHE
keyed by model and warm-up settings, so `make run` pays for it once per machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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
            header = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
            if header.startswith(prev_text):
                piece = tokenizer.encode(header[len(prev_text):], add_special_tokens=False)
                ids += piece
                mask += [0] * len(piece)
                prev_text = header
        piece = tokenizer.encode(text[len(prev_text):], add_special_tokens=False)
        ids += piece
        mask += [1 if is_asst else 0] * len(piece)
        prev_text = text
    return ids, mask


def _train(model_path: str, out_dir: Path, cfg: Any, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.data import make_arithmetic_dataset, make_tool_sft_transcripts
    from rollout.tools.config import load_tool_config

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tools = load_tool_config(cfg.rollout.agent.tool_config).schemas() if cfg.rollout.agent.tool_config else None
    records = make_arithmetic_dataset(cfg.sft.num_examples, seed + 7919, difficulty=cfg.sft.difficulty)
    examples = [assistant_mask(tokenizer, conv, tools) for conv in make_tool_sft_transcripts(records)]
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr)
    model.train()
    pad = tokenizer.pad_token_id or 0
    for step in range(cfg.sft.num_steps):
        batch = [examples[(step * cfg.sft.batch_size + j) % len(examples)] for j in range(cfg.sft.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)] + [-100] * (width - len(ids)) for ids, mask in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == cfg.sft.num_steps - 1:
            logger.info("sft step %d/%d loss %.4f", step + 1, cfg.sft.num_steps, loss.item())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def maybe_warm_up(cfg: Any, model_path: str) -> Path:
    """Return a warmed-up model folder (built once, cached) for `model_path`."""
    from rollout.models import cache_root

    key = hashlib.sha256(
        json.dumps([str(model_path), cfg.sft.model_dump(mode="json"), cfg.rollout.agent.tool_config, cfg.data.seed]).encode()
    ).hexdigest()[:12]
    final = cache_root() / "sft" / f"{Path(model_path).name}-{key}"
    if cfg.sft.skip_if_cached and (final / "config.json").exists():
        logger.info("using cached SFT warm-up %s", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".sft-", dir=final.parent))
    try:
        logger.info("SFT warm-up of %s (%d steps)", model_path, cfg.sft.num_steps)
        _train(model_path, tmp, cfg, cfg.data.seed)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
