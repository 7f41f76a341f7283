"""Typed entry points to the few `pyarrow.compute` kernels streamrl uses.

pyarrow generates its compute functions (`equal`, `unique`, ...) when `pyarrow.compute` is imported,
so a type checker sees none of them: pyarrow ships no stubs, and `pyarrow-stubs` (20.x, for an older
pyarrow than the one installed) rejects calls that are valid here (`equal` of a ChunkedArray and a
str, `take` of an integer array made from numpy). Import this module in its place (`from
streamrl.buffer import arrow_compute as pc`): each function has the generated kernel's name (`min`,
`max` and `all` shadow the builtins here, as in `pyarrow.compute`) and calls it unchanged.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute

# The generated kernels: untyped, so reached only through the typed functions below.
_kernels: Any = pyarrow.compute

Values = pa.Array | pa.ChunkedArray


def equal(values: Values, value: object) -> Values:
    """Element-wise `values == value`, a boolean array of the same kind."""
    return _kernels.equal(values, value)


def is_in(values: Values, *, value_set: pa.Array) -> Values:
    """Element-wise membership of `values` in `value_set`."""
    return _kernels.is_in(values, value_set=value_set)


def unique(values: Values) -> pa.Array:
    """The distinct values, in order of first appearance."""
    return _kernels.unique(values)


def dictionary_encode(values: Values) -> Values:
    """`values` as a dictionary array (indices into the distinct values, in order of first appearance)."""
    return _kernels.dictionary_encode(values)


def match_substring_regex(values: Values, pattern: str) -> Values:
    """Element-wise: whether the string matches the regular expression `pattern`."""
    return _kernels.match_substring_regex(values, pattern)


def min(values: Values) -> pa.Scalar:
    """The smallest non-null value (a null scalar if there is none)."""
    return _kernels.min(values)


def max(values: Values) -> pa.Scalar:
    """The largest non-null value (a null scalar if there is none)."""
    return _kernels.max(values)


def all(values: Values) -> pa.Scalar:
    """Whether every non-null value is true."""
    return _kernels.all(values)
