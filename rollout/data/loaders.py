"""Prompt datasets: load prompt files into `PromptRecord`s, and generate the arithmetic task.

`load_prompts` reads .parquet / .jsonl / .json in our flat layout (`messages`, `tools_kwargs`,
`ground_truth`) or verl's, unchanged: `data_source`, `prompt` (the messages), `ability`,
`reward_model` {`style`, `ground_truth`}, `agent_name`, and `extra_info` with `tools_kwargs`
({tool: {"create_kwargs": {...}}}) and `interaction_kwargs`. verl's reward functions are called with
`data_source` and the whole `extra_info`, so a `PromptRecord` keeps them next to the fields we use.
Rows may come as parquet decodes them (struct columns unified across rows, absent keys null) or as
pandas / HF datasets hand them over (numpy arrays for lists, numpy scalars, NaN for absent columns):
both are normalised to plain Python first. The group id is the row's `group_id` / `id` / `uid`
column, else a stable hash of the messages (repeated prompts get `-dupN` suffixes so GRPO groups never
mix). Bad rows raise a ValueError naming the file, the row and the field.

A message's content is a string or a list of content parts (`{"type": "text", "text": ...}`,
`{"type": "image", "image": SOURCE}`, the form `agent_loop/image_prompt.py` admits). verl's multimodal
rows (`RLHFDataset`, e.g. geo3k) add an `images` column and mark each image's place in the string
contents with `<image>`, one per image in order; such a message becomes parts as verl's
`_build_messages` makes them (empty text segments dropped), each image part carrying its entry of
`images` as a source the loop reads (`data_images.py`). Messages without a placeholder keep their
string content (a string and one text part render the same). The `videos` column is refused.

`make_arithmetic_dataset` generates word problems whose answers need multi-digit arithmetic (the
calculator tool's task); `make_tool_sft_transcripts` turns those prompts into gold tool-using chats
for a short SFT warm-up of a model that has never seen our tool format.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamrl.rollout.data.images import with_images
from streamrl.rollout.rewards import answers_match
from streamrl.rollout.types import PromptRecord
from streamrl.tools.calculator import evaluate_expression, format_number

_ROLES = {"system", "user", "assistant", "tool"}
_ID_COLUMNS = ("group_id", "id", "uid")


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {n} is not valid JSON: {exc.msg}") from None
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json prompt file must hold a list of rows")
        return data
    raise ValueError(f"{path}: unsupported prompt file type {suffix!r} (use .parquet, .jsonl or .json)")


def _to_python(value: Any) -> Any:
    """numpy arrays -> lists and numpy scalars -> Python scalars, recursively (what pandas and HF
    datasets hand over for parquet list columns), so the rest of the loader sees plain JSON types."""
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _to_python(value.tolist())  # an object array's tolist() still holds arrays
    return value


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row in plain Python; a float NaN column (pandas' "absent" in a mixed frame) becomes None."""
    row = _to_python(row)
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def _drop_none(value: Any) -> Any:
    """Parquet unifies struct fields across rows and fills absent keys with null; drop them again."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _maybe_json(value: Any, where: str, field: str) -> Any:
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: field {field!r} is a string that is not valid JSON") from None
    return value


def _messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    field = "messages" if row.get("messages") is not None else "prompt"
    value = _maybe_json(row.get(field), where, field)
    if value is None:
        raise ValueError(f"{where}: missing field 'messages' (or verl's 'prompt')")
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {field!r} must be a non-empty list of chat messages")
    messages = []
    for j, message in enumerate(_drop_none(value)):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ValueError(f"{where}: {field}[{j}] needs a 'role' in {sorted(_ROLES)}, got {message!r:.80}")
        content = message.get("content")
        if not _is_content(content) and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise ValueError(f"{where}: {field}[{j}] has no string 'content' (nor a list of text / image parts)")
        messages.append(message)
    return messages


def _is_content(content: Any) -> bool:
    """A string, or content parts (imported only then: the image module pulls in the engine types)."""
    if isinstance(content, str):
        return True
    from streamrl.models.images import is_content_parts

    return bool(content) and is_content_parts(content)


def _nested(row: dict[str, Any], where: str, outer: str, inner: str) -> Any:
    container = _maybe_json(row.get(outer), where, outer)
    return container.get(inner) if isinstance(container, dict) else None


def _object(value: Any, where: str, name: str) -> dict[str, Any]:
    """An optional JSON-object field ({} when absent), struct nulls dropped."""
    value = _drop_none(_maybe_json(value, where, name))
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: field {name!r} must be an object, got {type(value).__name__}")
    return value


def _text(value: Any, where: str, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _metadata(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The verl-layout metadata fields of a `PromptRecord`."""
    extra_info = _object(row.get("extra_info"), where, "extra_info")
    interaction = row.get("interaction_kwargs")
    if interaction is None:
        interaction = extra_info.get("interaction_kwargs")
    reward_model = _object(row.get("reward_model"), where, "reward_model")
    return {
        "data_source": _text(row.get("data_source"), where, "data_source"),
        "ability": _text(row.get("ability"), where, "ability"),
        "reward_style": _text(reward_model.get("style"), where, "reward_model.style"),
        "extra_info": extra_info,
        "interaction_kwargs": _object(interaction, where, "interaction_kwargs"),
    }


def _ground_truth(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def messages_hash(messages: list[dict[str, Any]]) -> str:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha1(canonical.encode()).hexdigest()[:16]


def _record(row: Any, index: int, source: str) -> tuple[PromptRecord, bool]:
    """(record, whether its group_id came from an id column)."""
    where = f"{source} row {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object, got {type(row).__name__}")
    row = _plain_row(row)
    messages = with_images(_messages(row, where), row, where)
    metadata = _metadata(row, where)
    tools_kwargs = row.get("tools_kwargs")
    if tools_kwargs is None:
        tools_kwargs = metadata["extra_info"].get("tools_kwargs")
    tools_kwargs = _drop_none(_maybe_json(tools_kwargs, where, "tools_kwargs")) or {}
    if not isinstance(tools_kwargs, dict):
        raise ValueError(f"{where}: field 'tools_kwargs' must be an object, got {type(tools_kwargs).__name__}")
    truth = row.get("ground_truth")
    if truth is None:
        truth = _nested(row, where, "reward_model", "ground_truth")
    agent_name = row.get("agent_name") or None  # None (or NaN, absent): the run's default_agent
    if agent_name is not None and not isinstance(agent_name, str):
        raise ValueError(f"{where}: field 'agent_name' must be a string")
    id_value = next((row[c] for c in _ID_COLUMNS if row.get(c) is not None), None)
    group_id = str(id_value) if id_value is not None else messages_hash(messages)
    record = PromptRecord(
        group_id=group_id,
        messages=messages,
        agent_name=agent_name,
        tools_kwargs=tools_kwargs,
        ground_truth=_ground_truth(truth),
        raw_ground_truth=_drop_none(truth),
        data_index=index,
        **metadata,
    )
    return record, id_value is not None


def load_prompts(path: str | Path) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    return records_from_rows(_read_rows(path), str(path))


def records_from_rows(rows: Sequence[Any], source: str = "<rows>") -> list[PromptRecord]:
    """Parse rows already in memory exactly as `load_prompts` parses a file's rows (also rows of
    `pandas.read_parquet(...).to_dict("records")` or an HF dataset, numpy values and all)."""
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    for index, row in enumerate(rows):
        record, explicit = _record(row, index, source)
        if record.group_id in seen:
            if explicit:
                raise ValueError(
                    f"{source} row {index}: duplicate id {record.group_id!r} (first at row {seen[record.group_id]})"
                )
            base, n = record.group_id, 1
            while f"{base}-dup{n}" in seen:
                n += 1
            record.group_id = f"{base}-dup{n}"
        seen[record.group_id] = index
        records.append(record)
    return records


# ---------------------------------------------------------------------------------------------------
# Generated arithmetic word problems
# ---------------------------------------------------------------------------------------------------

Difficulty = Literal["easy", "medium", "hard"]

ARITHMETIC_SYSTEM_PROMPT = (
    "You are a careful math assistant. Use the calculator tool for every arithmetic step: call it "
    "with an expression such as 37 + 5 * 12. When you have the result, state the final answer as "
    "\\boxed{NUMBER}."
)

# Ranges of the "big" (quantities) and "small" (counts, prices, multipliers) numbers per difficulty.
_RANGES: dict[str, dict[str, tuple[int, int]]] = {
    "easy": {"big": (10, 99), "small": (2, 9)},
    "medium": {"big": (100, 999), "small": (3, 30)},
    "hard": {"big": (1000, 9999), "small": (11, 99)},
}
_NAMES = ("Alice", "Ben", "Carla", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam")


@dataclass(frozen=True, slots=True)
class _Template:
    text: str  # format string with {name} and number slots
    expression: str  # format string over the same number slots; evaluated by the calculator
    slots: dict[str, str]  # slot -> "big" | "small"

    def regex(self) -> re.Pattern[str]:
        """Recovers the slot values from a rendered question (for SFT transcripts)."""
        parts, named = [], set()
        for literal, slot, _, _ in string.Formatter().parse(self.text):
            parts.append(re.escape(literal))
            if slot is None:
                continue
            if slot in named:
                parts.append(f"(?P={slot})")
            else:
                named.add(slot)
                parts.append(r"(?P<name>[A-Z][a-z]+)" if slot == "name" else rf"(?P<{slot}>\d+)")
        return re.compile("".join(parts))


_TEMPLATES = (
    _Template(
        text="{name} has {a} apples. {name} buys {b} bags with {c} apples in each bag, then gives away {d} apples. "
        "How many apples does {name} have now?",
        expression="{a} + {b} * {c} - {d}",
        slots={"a": "big", "b": "small", "c": "big", "d": "big"},
    ),
    _Template(
        text="A bakery bakes {a} trays of {b} cookies every day for {c} days and sells {d} cookies in total. "
        "How many cookies are left?",
        expression="{a} * {b} * {c} - {d}",
        slots={"a": "small", "b": "big", "c": "small", "d": "big"},
    ),
    _Template(
        text="A theater sells {a} adult tickets at {b} dollars each and {c} child tickets at {d} dollars each. "
        "What is the total revenue in dollars?",
        expression="{a} * {b} + {c} * {d}",
        slots={"a": "big", "b": "small", "c": "big", "d": "small"},
    ),
    _Template(
        text="{name} saves {a} dollars every week for {b} weeks and then spends {c} dollars on a bike. {name} splits "
        "the remaining money equally into {d} envelopes. How many dollars go into each envelope?",
        expression="({a} * {b} - {c}) / {d}",
        slots={"a": "big", "b": "small", "c": "big", "d": "small"},
    ),
    _Template(
        text="A warehouse holds {a} boxes. A truck takes away {b} boxes on each of {c} trips, and then {d} pallets "
        "with {e} boxes each are delivered. How many boxes are in the warehouse now?",
        expression="{a} - {b} * {c} + {d} * {e}",
        slots={"a": "big", "b": "big", "c": "small", "d": "small", "e": "big"},
    ),
    _Template(
        text="A train travels at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. "
        "How many kilometers does it travel in total?",
        expression="{a} * {b} + {c} * {d}",
        slots={"a": "big", "b": "small", "c": "big", "d": "small"},
    ),
    _Template(
        text="A school orders {a} boxes of pencils with {b} pencils in each box. The pencils are shared equally "
        "among {c} classes. How many pencils does each class get?",
        expression="{a} * {b} / {c}",
        slots={"a": "big", "b": "small", "c": "small"},
    ),
)


def _sample_problem(rng: random.Random, difficulty: str) -> tuple[str, str, int]:
    """(question, expression, answer) with a positive integer answer."""
    ranges = _RANGES[difficulty]
    template = rng.choice(_TEMPLATES)  # chosen once: retrying only the values keeps templates uniform
    for _ in range(10_000):
        values = {slot: rng.randint(*ranges[kind]) for slot, kind in template.slots.items()}
        expression = template.expression.format(**values)
        answer = evaluate_expression(expression)
        if answer > 0 and float(answer).is_integer():
            question = template.text.format(name=rng.choice(_NAMES), **values)
            return question, expression, int(answer)
    raise AssertionError("arithmetic templates never produced a positive integer answer")


def make_arithmetic_dataset(num_prompts: int, seed: int, *, difficulty: Difficulty = "medium") -> list[PromptRecord]:
    """Deterministic in (num_prompts, seed, difficulty); group ids `arith-<difficulty>-<seed>-<i>`."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be non-negative, got {num_prompts}")
    if difficulty not in _RANGES:
        raise ValueError(f"difficulty must be one of {sorted(_RANGES)}, got {difficulty!r}")
    rng = random.Random(seed)
    records = []
    for i in range(num_prompts):
        question, _, answer = _sample_problem(rng, difficulty)
        records.append(
            PromptRecord(
                group_id=f"arith-{difficulty}-{seed}-{i}",
                messages=[
                    {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT},
                    {"role": "user", "content": question},
                ],
                ground_truth=str(answer),
                data_index=i,
            )
        )
    return records


def expression_for(question: str) -> str:
    """The gold calculator expression of a generated question; ValueError for foreign questions."""
    for template in _TEMPLATES:
        match = template.regex().fullmatch(question.strip())
        if match:
            return template.expression.format(**{k: v for k, v in match.groupdict().items() if k != "name"})
    raise ValueError(f"not a question from make_arithmetic_dataset: {question[:80]!r}")


CODE_INTERPRETER = "code_interpreter"  # tools.code_interpreter's default tool name


def make_tool_sft_transcripts(
    records: Iterable[PromptRecord],
    *,
    tool_name: str = "calculator",
    explain: bool = True,
    tool_fraction: float = 1.0,
    seed: int = 0,
) -> list[list[dict[str, Any]]]:
    """Gold chats: prompt -> assistant calls the tool -> tool result -> assistant `\\boxed{answer}`.

    The calculator gets `{"expression": ...}`; the code interpreter (`tool_name="code_interpreter"`)
    gets `{"code": "print(...)"}` and answers with the printed line. Messages are in OpenAI chat format
    (assistant `tool_calls` with dict arguments, `tool` reply with `tool_call_id`), ready for the chat
    template. The expression is recovered from the question and its result checked against the ground
    truth, so a transcript is never wrong.

    `tool_fraction` < 1 leaves the decision to call the tool to RL: that share of the chats (drawn with
    `seed`) calls the tool, the others answer at once with the same gold `\\boxed{answer}`. The model
    learns both formats, and on problems it cannot compute in its head only the tool pays."""
    rng = random.Random(seed)
    transcripts = []
    for record in records:
        user = next((m for m in reversed(record.messages) if m.get("role") == "user"), None)
        if user is None:
            raise ValueError(f"record {record.group_id}: no user message")
        expression = expression_for(str(user["content"]))
        result = format_number(evaluate_expression(expression))
        if not answers_match(result, record.ground_truth):
            raise ValueError(
                f"record {record.group_id}: {expression} = {result}, but ground truth is {record.ground_truth}"
            )
        if tool_name == CODE_INTERPRETER:
            # what Python prints for it (`72.0` after a division), as the sandbox will answer
            arguments, observation, how = (
                {"code": f"print({expression})"},
                f"{evaluate_expression(expression)}\n",
                "in Python",
            )
        else:
            arguments, observation, how = {"expression": expression}, result, "with the calculator"
        if rng.random() >= tool_fraction:
            transcripts.append(
                [
                    *[dict(m) for m in record.messages],
                    {"role": "assistant", "content": f"The answer is \\boxed{{{result}}}."},
                ]
            )
            continue
        call = {"id": "call_0", "type": "function", "function": {"name": tool_name, "arguments": arguments}}
        preface = f"I will compute {expression} {how}." if explain else ""
        transcripts.append(
            [
                *[dict(m) for m in record.messages],
                {"role": "assistant", "content": preface, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "name": tool_name, "content": observation},
                {"role": "assistant", "content": f"The result is {result}, so the answer is \\boxed{{{result}}}."},
            ]
        )
    return transcripts
