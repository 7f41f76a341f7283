"""Hostile callbacks for the chaos bench's `hostile` scenarios: reward functions and tools that return
NaN or inf, hang, print terminal escapes or hand back a decompression bomb. Configs name them by
import path (`rollout.agent.reward_fn = "bench.hostile:mixed_reward"`, a tool YAML entry
`function: bench.hostile:calculator`), so a real run meets them where user code would be.

Which trajectory meets which hostility is a pure function of its text (a CRC bucket), so one run
mixes them while most trajectories still score normally and training goes on: `mixed_reward` and
`calculator` must not fail so many trajectories that `trainer.max_failed_fraction` stops the run;
`nan_reward` fails every one (the all-fail scenario, which must stop with a clear error).
"""

from __future__ import annotations

import functools
import logging
import time
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl.rollout.rewards import RewardInput

logger = logging.getLogger(__name__)

# Seconds a hanging callback sleeps: far past the timeouts the scenarios set (2 s), yet finite, so
# the threads it holds (a reward pool of 4, a tool's slots) come back and the run can go on.
HANG_S = 20.0
# An OSC 52 (set the clipboard), a screen clear and a window retitle: what a tool's output could do
# to the operator's terminal if logs or the console printed it raw.
ESCAPES = "\x1b]52;c;aG9zdGlsZQ==\x07\x1b[2J\x1b]0;pwned\x07"
ESCAPE_MARKER = "\x1b]52;c;aG9zdGlsZQ=="  # searched raw (must be absent) and escaped (\\x1b]52;...)
REWARD_BUCKETS = {0: "nan", 1: "inf", 2: "hang"}  # crc32(text) % 10 -> hostility; other buckets score
TOOL_BUCKETS = {0: "hang", 1: "escapes", 2: "escapes"}  # crc32(expression) % 6 -> hostility


def bucket(text: str, modulo: int) -> int:
    return zlib.crc32(text.encode()) % modulo


def reward_hostility(inp: RewardInput) -> str | None:
    """What `mixed_reward` does to this trajectory: "nan", "inf", "hang", or None (a normal score)."""
    return REWARD_BUCKETS.get(bucket(inp.response_text, 10))


def mixed_reward(inp: RewardInput) -> float:
    """`math_answer`, except NaN, inf or a hang for three tenths of the trajectories (by text)."""
    from streamrl.rollout.rewards import math_answer

    hostility = reward_hostility(inp)
    if hostility is not None:  # counted by the bench (a hang also fails the calls queued behind it)
        logger.warning("hostile reward: %s", hostility)
    if hostility == "nan":
        return float("nan")
    if hostility == "inf":
        return float("inf")
    if hostility == "hang":
        time.sleep(HANG_S)
    return math_answer(inp)


def nan_reward(inp: RewardInput) -> float:
    """NaN for every trajectory: every one fails, and the run must stop (streaming/failures.py)."""
    return float("nan")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "3 * (4 + 5)".
    """
    from streamrl.tools.calculator import CalculatorError, evaluate_expression

    hostility = TOOL_BUCKETS.get(bucket(expression, 6))
    if hostility == "hang":
        logger.warning("hostile calculator: hanging %g s on %r", HANG_S, expression)  # counted by the bench
        time.sleep(HANG_S)
    try:
        result = str(evaluate_expression(expression))
    except CalculatorError as e:
        result = f"Error: {e}"
    if hostility == "escapes":
        logger.warning("hostile calculator output: %s", ESCAPES + result)  # through the log handlers too
        return ESCAPES + result
    return result


@functools.cache
def bomb_png(side: int = 6_000) -> bytes:
    """A valid PNG of ~100 KB that decodes to `side` x `side` black RGB pixels (108 MB at 6k: 36
    megapixels, over the image cap, `models.multimodal.DEFAULT_MAX_IMAGE_PIXELS`, under PIL's own limit
    of ~89, so the cap is what refuses it)."""
    import struct

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + b"\x00" * (side * 3)  # filter byte + black RGB row
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def image_bomb(form: str) -> list[dict]:
    """A tool that answers with a decompression bomb: a small PNG of 36 megapixels.

    Args:
        form: how the image is handed back: "bytes", "data_url" or "path" (a file).
    """
    import base64
    import tempfile

    data = bomb_png()
    if form == "data_url":
        source: bytes | str = "data:image/png;base64," + base64.b64encode(data).decode()
    elif form == "path":
        with tempfile.NamedTemporaryFile("wb", suffix=".png", delete=False) as f:
            f.write(data)
        source = f.name
    else:
        source = data
    return [{"type": "text", "text": f"the picture ({form})"}, {"type": "image", "image": source}]
