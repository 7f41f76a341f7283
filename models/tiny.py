"""A tiny Qwen2 causal LM + byte-level BPE tokenizer, built locally in about a second.

Used by fast tests and CI: real transformers + real vLLM code paths with no hub access. Head size is
32 (vLLM's CPU attention needs 32..512). The tokenizer is trained on a synthetic corpus of our chat
template, tool calls and arithmetic so tool-calling text encodes into few tokens; byte-level
pre-tokenization means any text still encodes.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from streamrl.models.template import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TAG_TOKENS

logger = logging.getLogger(__name__)

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
TINY_VOCAB = 600


def _corpus(seed: int, num_lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    words = (
        "the a of to and is what how many apples has bob alice total sum each buys gives left "
        "answer compute calculator result tool call number please use first then equals minus plus "
        "times divided by final you are helpful assistant user system tools function name arguments"
    ).split()
    lines: list[str] = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}})
        lines.append(" ".join(rng.choice(words) for _ in range(12)))
        lines.append(f"<|im_start|>user\nWhat is {a} {op} {b}?<|im_end|>\n<|im_start|>assistant\n")
        lines.append(f"<tool_call>\n{call}\n</tool_call><|im_end|>")
        lines.append(f"<tool_response>\n{a + b}\n</tool_response> The answer is \\boxed{{{a + b}}}.")
    return lines


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a HF folder (config, safetensors, tokenizer with our chat template) to `out_dir`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens(list(TOOL_TAG_TOKENS))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)

    torch.manual_seed(seed)
    # a dict: the config dataclass takes keys its typed fields do not list (torch_dtype, head_dim)
    fields: dict[str, Any] = dict(
        vocab_size=len(hf_tok),
        bos_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        torch_dtype="float32",
        **TINY_CONFIG,
    )
    config = Qwen2Config(**fields)
    return save_built(Qwen2ForCausalLM(config), out, hf_tok.eos_token_id, "tiny model")


def save_built(model: Any, out: Path, eos_token_id: int, label: str) -> Path:
    """Save a freshly built (random-weight) model in float32 into `out`, generation ending at its eos."""
    import torch

    model = model.to(torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    logger.info("built %s (%d params) at %s", label, sum(p.numel() for p in model.parameters()), out)
    return out
