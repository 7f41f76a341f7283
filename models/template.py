"""Our ChatML/Hermes tool-calling chat template and its special tokens."""

from __future__ import annotations

from importlib import resources

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain added tokens (decoded as text, so tool parsers see them in the completion).
TOOL_TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHAT_TEMPLATE = resources.files("streamrl.models").joinpath("chatml_tools.jinja").read_text()
