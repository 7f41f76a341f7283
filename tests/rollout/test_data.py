"""Prompt loading (flat and verl layouts, parquet/jsonl/json), the arithmetic task and SFT transcripts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.models.template import CHAT_TEMPLATE
from streamrl.rollout.data.loaders import (
    ARITHMETIC_SYSTEM_PROMPT,
    expression_for,
    load_prompts,
    make_arithmetic_dataset,
    make_tool_sft_transcripts,
    messages_hash,
)
from streamrl.rollout.parsers import get_parser
from streamrl.rollout.rewards import RewardInput, math_answer
from streamrl.tools import evaluate_expression, format_number

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_flat_jsonl_with_ids_and_defaults(tmp_path):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "id": 7,
                "messages": MSGS,
                "ground_truth": 4,
                "agent_name": "single_turn",
                "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "4"}}},
            },
            {"id": "b", "messages": [{"role": "user", "content": "hi"}], "ground_truth": 2.0},
        ],
    )
    first, second = load_prompts(path)
    assert (first.group_id, first.agent_name, first.ground_truth, first.data_index) == ("7", "single_turn", "4", 0)
    assert first.messages == MSGS and first.tools_kwargs == {"calculator": {"create_kwargs": {"ground_truth": "4"}}}
    assert (second.group_id, second.agent_name, second.ground_truth, second.tools_kwargs) == (
        "b",
        None,  # none named: the run's rollout.agent.default_agent
        "2",
        {},
    )


def test_verl_parquet_layout(tmp_path):
    rows = [
        {
            "data_source": "gsm8k",
            "prompt": MSGS,
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "4"}}}},
            "agent_name": "tool_agent",
        },
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": "What is 3+3?"}],
            "reward_model": {"style": "rule", "ground_truth": "6"},
            "extra_info": {"index": 1, "tools_kwargs": {"sleep": {"create_kwargs": {"x": 1}}}},
            "agent_name": "tool_agent",
        },
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    first, second = load_prompts(path)
    assert first.messages == MSGS and first.ground_truth == "4"
    # Parquet unified the struct columns (calculator/sleep keys in every row, null where absent): dropped again.
    assert first.tools_kwargs == {"calculator": {"create_kwargs": {"ground_truth": "4"}}}
    assert second.tools_kwargs == {"sleep": {"create_kwargs": {"x": 1}}}
    assert first.group_id == messages_hash(MSGS) and len(first.group_id) == 16
    assert second.ground_truth == "6" and second.data_index == 1


def test_json_file_with_string_encoded_columns(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": json.dumps(MSGS), "extra_info": json.dumps({"tools_kwargs": {}})}]))
    (record,) = load_prompts(path)
    assert record.messages == MSGS and record.tools_kwargs == {} and record.ground_truth is None


def test_hash_group_ids_are_stable_and_duplicates_get_suffixes(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"messages": MSGS}] * 3 + [{"messages": MSGS[1:]}])
    ids = [r.group_id for r in load_prompts(path)]
    h = messages_hash(MSGS)
    assert ids[:3] == [h, f"{h}-dup1", f"{h}-dup2"] and ids[3] == messages_hash(MSGS[1:])
    assert [r.group_id for r in load_prompts(path)] == ids


def test_plain_string_prompt_becomes_a_user_message(tmp_path):
    (record,) = load_prompts(_write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2+2?"}]))
    assert record.messages == [{"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([{"messages": MSGS}, {"ground_truth": "1"}], "row 1: missing field 'messages' (or verl's 'prompt')"),
        ([{"messages": []}], "row 0: field 'messages' must be a non-empty list"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], "row 0: messages[0] needs a 'role'"),
        ([{"messages": [{"role": "user"}]}], "messages[0] has no string 'content'"),
        ([{"messages": "[not json"}], "field 'messages' is a string that is not valid JSON"),
        ([{"messages": MSGS, "tools_kwargs": [1]}], "field 'tools_kwargs' must be an object"),
        ([{"messages": MSGS, "agent_name": 3}], "field 'agent_name' must be a string"),
        ([{"id": 1, "messages": MSGS}, {"id": 1, "messages": MSGS}], "row 1: duplicate id '1'"),
        (["just a string"], "row 0: a row must be an object"),
    ],
)
def test_bad_rows_raise_value_errors_naming_row_and_field(tmp_path, rows, needle):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    assert needle in str(info.value) and "bad.jsonl" in str(info.value), str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported prompt file type"):
        load_prompts(tmp_path / "p.csv")
    (tmp_path / "p.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_prompts(tmp_path / "p.jsonl")
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(ValueError, match="list of rows"):
        load_prompts(tmp_path / "p.json")


# -- arithmetic task ---------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_arithmetic_dataset_is_deterministic_and_correct(difficulty):
    records = make_arithmetic_dataset(50, seed=11, difficulty=difficulty)
    assert records == make_arithmetic_dataset(50, seed=11, difficulty=difficulty)
    assert records != make_arithmetic_dataset(50, seed=12, difficulty=difficulty)
    assert len({r.group_id for r in records}) == 50 and records[3].group_id == f"arith-{difficulty}-11-3"
    for record in records:
        system, user = record.messages
        assert system == {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
        assert "calculator" in system["content"] and "\\boxed{" in system["content"]
        # The ground truth is what the calculator gives for the question's own expression.
        answer = evaluate_expression(expression_for(user["content"]))
        assert format_number(answer) == record.ground_truth and int(record.ground_truth) > 0


def test_arithmetic_difficulty_scales_the_numbers():
    def biggest(difficulty):
        return max(int(r.ground_truth) for r in make_arithmetic_dataset(100, seed=0, difficulty=difficulty))

    assert biggest("easy") < biggest("medium") < biggest("hard")
    with pytest.raises(ValueError, match="difficulty"):
        make_arithmetic_dataset(1, 0, difficulty="insane")
    with pytest.raises(ValueError, match="non-negative"):
        make_arithmetic_dataset(-1, 0)


def _render(messages, tools=None):
    """Our chat template rendered the way transformers does (sandboxed jinja, trim/lstrip, tojson),
    without importing transformers (keeps this file fast)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=False)


def test_sft_transcripts_are_gold_and_parse_back():
    records = make_arithmetic_dataset(20, seed=5)
    transcripts = make_tool_sft_transcripts(records)
    parser = get_parser("hermes")
    for record, chat in zip(records, transcripts, strict=True):
        assert chat[:2] == record.messages
        assert [m["role"] for m in chat[2:]] == ["assistant", "tool", "assistant"]
        call = chat[2]["tool_calls"][0]
        assert call["function"]["name"] == "calculator" and chat[3]["tool_call_id"] == call["id"]
        assert chat[3]["content"] == record.ground_truth
        final = chat[4]["content"]
        assert (
            math_answer(RewardInput(response_text=final, final_answer_text=final, ground_truth=record.ground_truth))
            == 1.0
        )
        # The assistant turn as the template renders it is exactly what the hermes parser reads back.
        text = _render(chat)
        turn_text = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        turn = parser.parse(turn_text)
        assert turn.num_errors == 0 and turn.content == chat[2]["content"]
        assert turn.tool_calls[0].arguments == call["function"]["arguments"]
        assert f"<tool_response>\n{record.ground_truth}\n</tool_response>" in text


def test_sft_transcripts_reject_foreign_or_wrong_records():
    (record,) = make_arithmetic_dataset(1, seed=0)
    record.ground_truth = str(int(record.ground_truth) + 1)
    with pytest.raises(ValueError, match="but ground truth is"):
        make_tool_sft_transcripts([record])
    record.messages = [{"role": "user", "content": "What is the capital of France?"}]
    with pytest.raises(ValueError, match="not a question from make_arithmetic_dataset"):
        make_tool_sft_transcripts([record])
    plain = make_tool_sft_transcripts(make_arithmetic_dataset(1, seed=0), explain=False)
    assert plain[0][2]["content"] == ""


async def test_code_interpreter_transcripts_show_what_the_real_sandbox_prints():
    """The warm-up teaches the model a cell and an observation; the observation is exactly what the
    real code interpreter answers for that cell (so SFT does not teach a tool that does not exist)."""
    from streamrl.tools.code_interpreter import CodeInterpreterTool

    records = make_arithmetic_dataset(6, seed=11)
    tool = CodeInterpreterTool()
    for record, chat in zip(records, make_tool_sft_transcripts(records, tool_name="code_interpreter"), strict=True):
        call = chat[2]["tool_calls"][0]["function"]
        assert call["name"] == "code_interpreter" and call["arguments"]["code"].startswith("print(")
        instance = await tool.create()
        ran = await tool.execute(instance, call["arguments"])
        await tool.release(instance)
        assert ran.text == chat[3]["content"] and float(ran.text) == float(record.ground_truth)
