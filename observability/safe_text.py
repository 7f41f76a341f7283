"""Model and tool text made safe for a terminal: control characters shown, never interpreted.

Text a model wrote, or a tool returned, reaches the console through `streamrl rollout` (the
trajectory view) and `-v` log lines. With its ESC sequences intact it can drive the terminal: clear
the screen (CSI 2J), retitle the window or set the clipboard (OSC 52), hide what follows. rich drops
BEL but keeps ESC. `safe_text` escapes every C0 and C1 control character except newline and tab
(`\\x1b` is shown as the four characters `\\x1b`); `SafeText` is a rich `Text` whose `append` does the
same; `SafeFormatter` escapes each formatted log line.
"""

from __future__ import annotations

import logging
import re
from typing import Any

# C0 controls but \t and \n, DEL, C1 controls (0x80-0x9f: a lone 0x9b is CSI on some terminals).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def safe_text(text: str) -> str:
    """`text` with its control characters (except \\n and \\t) escaped as `\\xNN`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class SafeFormatter(logging.Formatter):
    """A formatter whose output lines carry no terminal control sequences."""

    def format(self, record: logging.LogRecord) -> str:
        return safe_text(super().format(record))


def __getattr__(name: str) -> Any:
    if name == "SafeText":  # built on first use: importing this module does not import rich
        return _safe_text_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CLASS: list[type] = []


def _safe_text_class() -> type:
    if not _CLASS:
        from rich.text import Text

        class SafeText(Text):
            """A rich `Text` whose appended strings have their control characters escaped."""

            def append(self, text: Any, style: Any = None) -> Text:
                return super().append(safe_text(text) if isinstance(text, str) else text, style)

        _CLASS.append(SafeText)
    return _CLASS[0]
