"""Example function tools: plain functions that `configs/tools/functions.yaml` registers as tools.

They show what `FunctionTool` (tools/function.py) reads from a function: the type hints become the
argument schema, the docstring's first paragraph the tool description, its `Args:` section the
argument descriptions. One is sync (run in a worker thread), one async (awaited on the event loop),
one takes an Enum and a bound keyword argument the model never sees. Errors are raised as usual
Python exceptions; the tool turns them into `Error: ...` observations.
"""

from __future__ import annotations

import asyncio
import math
from enum import StrEnum
from typing import Literal

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau, "golden_ratio": (1 + 5**0.5) / 2}


def word_count(text: str) -> int:
    """Count the words of a text (runs of characters between whitespace).

    Args:
        text: The text whose words are counted.
    """
    return len(text.split())


async def lookup_constant(name: Literal["pi", "e", "tau", "golden_ratio"], digits: int = 6) -> str:
    """Look up a mathematical constant.

    Args:
        name: Which constant.
        digits: Digits after the decimal point, 0 to 15.
    """
    if not 0 <= digits <= 15:
        raise ValueError(f"digits must be between 0 and 15, got {digits}")
    await asyncio.sleep(0)  # stands in for a real asynchronous lookup
    return f"{CONSTANTS[name]:.{digits}f}"


class LengthUnit(StrEnum):
    METER = "m"
    KILOMETER = "km"
    MILE = "mi"
    FOOT = "ft"


_METERS: dict[LengthUnit, float] = {
    LengthUnit.METER: 1.0,
    LengthUnit.KILOMETER: 1000.0,
    LengthUnit.MILE: 1609.344,
    LengthUnit.FOOT: 0.3048,
}


def convert_length(value: float, from_unit: LengthUnit, to_unit: LengthUnit, precision: int = 6) -> float:
    """Convert a length between units.

    Args:
        value: The length in `from_unit`.
        from_unit: The unit of `value`.
        to_unit: The unit of the result.
        precision: Digits the result is rounded to; bound in the tool config, not chosen by the model.
    """
    return round(value * _METERS[from_unit] / _METERS[to_unit], precision)
