"""Token ids for the conversation pieces the policy did not sample.

Never re-encode the whole conversation: earlier tokens are the engine's and stay as they are. New
messages (tool responses, interaction replies) are rendered by the model's own chat template *behind a
fixed dummy exchange* and only the text after the dummy assistant's end-of-turn token is tokenized.
That strips whatever the template adds implicitly (a default system prompt, tool blocks) and keeps the
separator the template puts after an assistant turn (e.g. "\n" after <|im_end|>), which a plain
"render only the new messages" misses. This generalizes the system-prompt-strip trick of verl's
ToolAgentLoop to templates with any implicit prefix (Qwen2.5, Qwen3, ours).
"""

from __future__ import annotations

from typing import Any

_DUMMY = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]


class ObservationEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token
        if not eos:
            raise ValueError("tokenizer has no eos_token; cannot locate the end of an assistant turn")
        base = self._render(_DUMMY, add_generation_prompt=False)
        end = base.rfind(eos)
        if end < 0:
            raise ValueError(f"chat template does not end assistant turns with eos {eos!r}")
        self._prefix = base[: end + len(eos)]

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools=None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        text = self._render(messages, add_generation_prompt=True, tools=tools or None)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_new_messages(self, messages: list[dict[str, Any]], *, after_eos: bool = True) -> list[int]:
        """Tokens that follow an assistant turn for `messages`, ending with the generation prompt.

        `after_eos=False` means the previous turn did not end with eos (it hit a length limit): the
        eos token is then added first so the sequence stays well-formed for the template.
        """
        full = self._render(_DUMMY + list(messages), add_generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ValueError("chat template renders earlier turns differently when messages are appended")
        suffix = full[len(self._prefix) :]
        if not after_eos:
            suffix = self.tokenizer.eos_token + suffix
        return list(self.tokenizer.encode(suffix, add_special_tokens=False))


def truncate_text(text: str, max_chars: int, side: str) -> str:
    """Cut `text` to `max_chars`, keeping the left, right, or both ends (middle cut)."""
    if len(text) <= max_chars:
        return text
    marker = "...(truncated)..."
    keep = max(max_chars - len(marker), 0)
    if side == "left":
        return text[:keep] + marker
    if side == "right":
        return marker + text[len(text) - keep :]
    if side == "middle":
        head = keep // 2
        return text[:head] + marker + text[len(text) - (keep - head) :]
    raise ValueError(f"unknown truncation side {side!r}; expected left, right or middle")
