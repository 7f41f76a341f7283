"""Reward functions: a finished trajectory's text and counters -> one scalar.

A reward function is any `Callable[[RewardInput], float]`. Configs name one by registry name
(`math_answer`) or by import path (`package.module:function`); `get_reward_fn` resolves both. Reward
functions are sync and should be pure (no I/O); the agent loop calls them at trajectory end in a few
threads off its event loop, under `rollout.agent.reward_timeout_s`, and fails a trajectory whose
reward is not a finite number (`rollout/agent_loop/scoring.py`).

verl's reward functions plug in unchanged: a function with verl's signature
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` named by import path is
detected by its parameter names (`solution_str` and `ground_truth`) and adapted by `verl_reward_fn`;
the prefix `verl:` (`verl:my_pkg.mod:compute_score`) asks for the adapter explicitly and fails loudly
if the signature does not fit. It is called with keywords, as verl calls it: `data_source` and
`extra_info` of the dataset row, `ground_truth` as the row stored it, and as `solution_str` the
assistant's text of the whole trajectory (verl decodes the response tokens, which in multi-turn
rollouts also hold tool observations; grading only what the model wrote keeps an answer quoted from a
tool result from counting as the model's). It may return a number or a dict with a "score" entry.

Answer extraction is shared with the math-feedback interaction: the content of the last `\\boxed{}`
(balanced braces), otherwise the last number in the text. Answers compare numerically (fractions,
thousands separators, `\\frac{a}{b}`, trailing units/punctuation tolerated) with a small tolerance,
and as normalized strings when either side is not a number.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl.core.registry import Registry, import_object


@dataclass(kw_only=True, slots=True)
class RewardInput:
    response_text: str  # decoded assistant text of the whole trajectory (no tool / user text)
    final_answer_text: str  # the last assistant message
    ground_truth: str | None
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)  # [num_messages] OpenAI chat format
    # Row metadata of verl's dataset layout (rollout.types.PromptRecord), read by verl's scorers:
    data_source: str | None = None
    raw_ground_truth: Any = None  # the ground truth as the row stored it; None: use `ground_truth`
    extra_info: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[RewardInput], float]

REWARDS: Registry[RewardFn] = Registry("reward function")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


VERL_PREFIX = "verl:"


def get_reward_fn(spec: str) -> RewardFn:
    """A registered name (see `registered_rewards()`), `package.module:function` taking a
    `RewardInput`, or a verl `compute_score` (by signature, or forced with `verl:package.module:fn`)."""
    if (fn := REWARDS.find(spec)) is not None:
        return fn
    path = spec.removeprefix(VERL_PREFIX)
    if ":" not in path and "." not in path:
        raise ValueError(f"unknown reward function {spec!r}; registered: {registered_rewards()} or 'pkg.mod:fn'")
    fn = import_object(path)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    if spec.startswith(VERL_PREFIX) or is_verl_compute_score(fn):
        return verl_reward_fn(fn)
    return fn


def registered_rewards() -> list[str]:
    return REWARDS.names()


# ---------------------------------------------------------------------------------------------------
# Answer extraction and comparison
# ---------------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` that closes (balanced braces), or None.

    One pass pairs every brace on a stack (an opening brace's partner is the first closing one that
    brings its depth back to zero), so the cost is linear in the text: many unclosed `\\boxed{` do
    not make it quadratic, as scanning ahead from each of them would."""
    boxed_opens = {match.end() - 1 for match in _BOXED.finditer(text)}
    if not boxed_opens:
        return None
    stack: list[int] = []
    last: tuple[int, int] | None = None  # (opening, closing) index of the last boxed that closes
    for brace in _BRACE.finditer(text):
        i = brace.start()
        if text[i] == "{":
            stack.append(i)
        elif stack:
            opening = stack.pop()
            if opening in boxed_opens and (last is None or opening > last[0]):
                last = (opening, i)
    return None if last is None else text[last[0] + 1 : last[1]]


def extract_answer(text: str) -> str | None:
    """The last boxed answer, else the last number in `text`, else None."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> float | None:
    """A number from an answer string ("1,234", "3/4", "\\frac{3}{4}", "$12.50", "42 apples")."""
    s = _TEXT_WRAPPER.sub(r"\1", text.strip())
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\%", "").replace("%", "").strip()
    s = s.rstrip(".").strip()
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return num / den if num is not None and den not in (None, 0) else None
    if "/" in s:
        num_text, _, den_text = s.partition("/")
        num, den = parse_number(num_text), parse_number(den_text)
        return num / den if num is not None and den not in (None, 0) else None
    compact = s.replace(",", "").replace(" ", "")
    try:
        value = float(compact)
    except ValueError:
        # A number followed by units / words: "42 apples", "12 dollars".
        match = re.match(r"^-?\d[\d,]*(?:\.\d+)?", s)
        if match is None:
            return None
        value = float(match.group().replace(",", ""))
    return value if math.isfinite(value) else None


def _normalize(text: str) -> str:
    return re.sub(r"\s+", "", _TEXT_WRAPPER.sub(r"\1", text)).strip("$.").lower()


def answers_match(
    predicted: str | None, ground_truth: str | None, *, rel_tol: float = 1e-6, abs_tol: float = 1e-6
) -> bool:
    if predicted is None or ground_truth is None:
        return False
    pred_num, gt_num = parse_number(predicted), parse_number(ground_truth)
    if pred_num is not None and gt_num is not None:
        return math.isclose(pred_num, gt_num, rel_tol=rel_tol, abs_tol=abs_tol)
    return _normalize(predicted) == _normalize(ground_truth)


def _graded_text(inp: RewardInput) -> str:
    return inp.final_answer_text if inp.final_answer_text.strip() else inp.response_text


# ---------------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------------


@register_reward("math_answer")
def math_answer(inp: RewardInput) -> float:
    """1.0 if the final answer (boxed, else last number) equals the ground truth, else 0.0."""
    return 1.0 if answers_match(extract_answer(_graded_text(inp)), inp.ground_truth) else 0.0


TOOL_SUCCESS_BONUS = 0.1  # once per trajectory with at least one tool call that did not error
TOOL_ERROR_PENALTY = 0.05  # per erroring call (parse, validation, timeout, tool error) ...
MAX_TOOL_ERROR_PENALTY = 0.2  # ... capped, so a long wrong trajectory is not punished without bound


@register_reward("math_answer_with_tool_bonus")
def math_answer_with_tool_bonus(inp: RewardInput) -> float:
    """`math_answer` plus shaping for tool use, range [-0.2, 1.1].

    +0.1 when at least one tool call succeeded (teaches a model new to the tool format to use it),
    -0.05 per erroring call, at most -0.2 (teaches well-formed calls). The shaping is small next to
    correctness so a correct answer always beats any tool behaviour on a wrong one."""
    reward = math_answer(inp)
    if inp.num_tool_calls > inp.num_tool_errors:
        reward += TOOL_SUCCESS_BONUS
    reward -= min(MAX_TOOL_ERROR_PENALTY, TOOL_ERROR_PENALTY * inp.num_tool_errors)
    return reward


def with_length_penalty(fn: RewardFn, *, max_chars: int, coef: float = 0.5) -> RewardFn:
    """Wrap `fn`: subtract `coef * overshoot / max_chars` (at most `coef`) when the assistant text is
    longer than `max_chars` characters."""
    if max_chars <= 0 or coef < 0:
        raise ValueError(f"max_chars must be positive and coef non-negative, got {max_chars}, {coef}")

    def penalized(inp: RewardInput) -> float:
        overshoot = max(0, len(inp.response_text) - max_chars)
        return fn(inp) - min(coef, coef * overshoot / max_chars)

    penalized.__name__ = f"{getattr(fn, '__name__', 'reward')}_with_length_penalty"
    return penalized


@register_reward("math_answer_length_penalty")
def math_answer_length_penalty(inp: RewardInput) -> float:
    """`math_answer` with a length penalty beyond 4000 characters of assistant text."""
    return _MATH_LENGTH_PENALIZED(inp)


_MATH_LENGTH_PENALIZED = with_length_penalty(math_answer, max_chars=4000, coef=0.5)


# ---------------------------------------------------------------------------------------------------
# verl's compute_score
# ---------------------------------------------------------------------------------------------------

_VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


@dataclass(kw_only=True, slots=True)
class VerlScore:
    """What a verl `compute_score` returned: the score, and the other numeric entries of a dict."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)  # e.g. {"acc": 1.0}; verl logs these


def verl_score(result: Any) -> VerlScore:
    """Read a `compute_score` result: a number (bools and numpy scalars too), or a dict with "score"."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(
                f"compute_score returned a dict without a 'score' entry (keys: {sorted(map(str, result))})"
            )
        extras = {str(k): float(v) for k, v in result.items() if k != "score" and isinstance(v, numbers.Real)}
        result = result["score"]
    if not isinstance(result, numbers.Real):
        raise ValueError(
            f"compute_score returned {type(result).__name__} {result!r:.60}; expected a number or a dict with 'score'"
        )
    if not math.isfinite(result):
        raise ValueError(f"compute_score returned {float(result)}; a reward must be a finite number")
    return VerlScore(score=float(result), extras=extras)


def is_verl_compute_score(fn: Callable[..., Any]) -> bool:
    """True when `fn` takes verl's keyword arguments (`solution_str` and `ground_truth` at least)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "solution_str" in params and "ground_truth" in params


def verl_reward_fn(compute_score: Callable[..., Any]) -> RewardFn:
    """Adapt a verl `compute_score(data_source, solution_str, ground_truth, extra_info)` to a `RewardFn`.

    Only the arguments the function declares are passed (all four when it takes `**kwargs`). The
    returned function gives the score; dict extras are dropped (a `RewardFn` returns one number)."""
    name = getattr(compute_score, "__qualname__", type(compute_score).__name__)
    if not is_verl_compute_score(compute_score):
        raise ValueError(f"{name} does not take verl's compute_score arguments {_VERL_ARGUMENTS}")
    if inspect.iscoroutinefunction(compute_score):
        raise ValueError(
            f"{name} is async; reward functions are called in a thread at trajectory end, so it must be sync"
        )
    params = inspect.signature(compute_score).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    passed = [a for a in _VERL_ARGUMENTS if a in params or takes_any]

    def reward(inp: RewardInput) -> float:
        values = {
            "data_source": inp.data_source,
            "solution_str": inp.response_text,
            "ground_truth": inp.ground_truth if inp.raw_ground_truth is None else inp.raw_ground_truth,
            "extra_info": dict(inp.extra_info),  # a copy: a scorer may write into it
        }
        return verl_score(compute_score(**{a: values[a] for a in passed})).score

    reward.__name__ = f"verl_{getattr(compute_score, '__name__', 'compute_score')}"
    return reward
