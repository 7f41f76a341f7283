"""A safe arithmetic calculator tool (the tool of our math-with-tools tasks).

Expressions are parsed with `ast` and evaluated by walking a whitelist of nodes: numeric literals,
`+ - * / // % **`, unary `+ -` and parentheses (which only exist as tree structure). Names, calls,
attributes, subscripts, comparisons, strings, ... are rejected, so nothing the model writes can reach
`eval` or Python objects. Bounds keep every call cheap: expression length, node count, exponent size
and the number of digits of every intermediate result (checked *before* computing a power, so
`9**9**9` is refused instead of computed). `^` is read as power and `×`/`÷`/`−` as their ASCII
operators, because models write them. Errors are returned as text the model can act on.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import random
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.core import syntax
from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.schema import OpenAIFunctionToolSchema

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REPLACEMENTS = {"×": "*", "÷": "/", "−": "-", "^": "**"}
_MAX_NODES = 256


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message is shown to the model."""


class CalculatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_expression_chars: int = Field(200, gt=0, le=10_000)
    max_result_digits: int = Field(100, gt=0, le=4000)  # below Python's int->str limit (4300)
    max_exponent: int = Field(10_000, gt=0)
    # A simulated service latency per call, for benchmarks (0 = answer at once): log-normal with this
    # median and, when set, this 99th percentile (a long tail, as remote tools have).
    latency_s: float = Field(0.0, ge=0.0, le=600.0)
    latency_p99_s: float | None = Field(None, gt=0.0, le=3600.0)
    seed: int | None = None

    @model_validator(mode="after")
    def _check_tail(self) -> CalculatorConfig:
        if self.latency_p99_s is not None and self.latency_p99_s < self.latency_s:
            raise ValueError(f"latency_p99_s={self.latency_p99_s} is below the median latency_s={self.latency_s}")
        return self

    def latency_sigma(self) -> float:
        """The log-normal's sigma: p99 = median * exp(2.326 sigma)."""
        if self.latency_p99_s is None or self.latency_s == 0:
            return 0.0
        return math.log(self.latency_p99_s / self.latency_s) / 2.326


def _check_size(value: Number, max_digits: int) -> Number:
    if isinstance(value, int):
        # bit_length avoids the quadratic int->str conversion; 3.33 bits per decimal digit.
        if value.bit_length() > max_digits * 3.33:
            raise CalculatorError(f"result has more than {max_digits} digits")
    elif not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


class _Evaluator:
    def __init__(self, config: CalculatorConfig) -> None:
        self.config = config

    def eval(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {node.value!r:.40}")
            return _check_size(node.value, self.config.max_result_digits)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result is too large") from None
            if isinstance(value, complex):
                raise CalculatorError("result is not a real number (negative base with fractional exponent)")
            return _check_size(value, self.config.max_result_digits)
        raise CalculatorError(_describe_forbidden(node))

    def _check_power(self, base: Number, exponent: Number) -> None:
        if abs(exponent) > self.config.max_exponent:
            raise CalculatorError(f"exponent {exponent} is too large (limit {self.config.max_exponent})")
        if abs(base) > 1 and exponent > 0:
            digits = exponent * math.log10(abs(base))
            if digits > self.config.max_result_digits:
                raise CalculatorError(
                    f"result would have about {digits:.0f} digits (limit {self.config.max_result_digits})"
                )


def _describe_forbidden(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"names are not allowed ('{node.id}'); use only numbers and + - * / // % ** ( )"
    if isinstance(node, ast.Call):
        return "function calls are not allowed; use only numbers and + - * / // % ** ( )"
    if isinstance(node, ast.Attribute):
        return "attribute access is not allowed; use only numbers and + - * / // % ** ( )"
    if isinstance(node, ast.Tuple):
        return "commas are not allowed; write numbers without thousands separators, one expression per call"
    if isinstance(node, ast.BinOp):
        return f"operator {type(node.op).__name__} is not allowed; use + - * / // % **"
    return f"{type(node).__name__} is not allowed; use only numbers and + - * / // % ** ( )"


def evaluate_expression(expression: object, config: CalculatorConfig | None = None) -> Number:
    """Evaluate a whitelisted arithmetic expression; raises `CalculatorError` with a readable reason."""
    config = config or CalculatorConfig()
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > config.max_expression_chars:
        raise CalculatorError(f"expression is longer than {config.max_expression_chars} characters")
    for old, new in _REPLACEMENTS.items():
        text = text.replace(old, new)
    try:
        tree = syntax.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise CalculatorError(f"could not parse {expression!r:.80}: {getattr(exc, 'msg', exc)}") from None
    if sum(1 for _ in ast.walk(tree)) > _MAX_NODES:
        raise CalculatorError("expression is too complex; split it into smaller steps")
    return _Evaluator(config).eval(tree)


def format_number(value: Number) -> str:
    """Integers (and integral floats) without ".0"; other floats with 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.12g}"


ConfigT = TypeVar("ConfigT", bound=CalculatorConfig)  # a subclass's config model (the ledger's adds a path)


class CalculatorTool(BaseTool, Generic[ConfigT]):
    config_model = CalculatorConfig
    config: ConfigT
    idempotent = True  # a pure function of its arguments

    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.one_string_argument(
            "calculator",
            "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "expression",
            "e.g. 37 + 5 * 12 - (8 / 2)",
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rng = random.Random(self.config.seed)

    def next_latency_s(self) -> float:
        cfg = self.config
        if cfg.latency_s == 0:
            return 0.0
        return cfg.latency_s * math.exp(cfg.latency_sigma() * self._rng.gauss(0.0, 1.0))

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        if (latency_s := self.next_latency_s()) > 0:
            await asyncio.sleep(latency_s)
        expression = parameters.get("expression")
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = str(expression)
        try:
            result = format_number(evaluate_expression(expression, self.config))
        except CalculatorError as exc:
            return ToolExecution(text=f"Error: {exc}", metrics={"calculator/error": 1.0})
        return ToolExecution(text=result, metrics={"calculator/error": 0.0})
