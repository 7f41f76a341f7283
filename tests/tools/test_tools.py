"""Tools: calculator safety and formatting, sleep tool, the executor's fault boundary, YAML loading."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from streamrl.tools import (
    CalculatorTool,
    ToolRegistry,
    evaluate_expression,
    format_number,
    load_tool_config,
)
from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.calculator import CalculatorConfig, CalculatorError
from streamrl.tools.schema import OpenAIFunctionToolSchema
from streamrl.tools.types import ToolCall, ToolCallStatus, ToolJournalEntry, ToolResult
from streamrl.workloads.tools.sleep_tool import SleepTool

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tools"


# -- calculator --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("37 + 5 * 12", "97"),
        ("(37 + 5) * 12", "504"),
        ("10 / 4", "2.5"),
        ("10 / 5", "2"),  # integral float results print without ".0"
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ^ 10", "1024"),  # models write ^ for powers
        ("6 × 7 ÷ 2 − 1", "20"),
        ("--3", "3"),
        ("+4", "4"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333"),
        ("2 ** -2", "0.25"),
        ("12345678901234567890 * 10", "123456789012345678900"),
        ("  12 * 3 = ", "36"),
    ],
)
def test_calculator_evaluates_and_formats(expression, expected):
    assert format_number(evaluate_expression(expression)) == expected


@pytest.mark.parametrize(
    ("expression", "needle"),
    [
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("x + 1", "names are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 << 10", "operator LShift is not allowed"),
        ("1,000 + 1", "commas are not allowed"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 101", "digits"),
        ("2 ** 100000", "too large"),
        ("(10 ** 60) * (10 ** 60)", "more than 100 digits"),
        ("1e308 * 10", "not a finite number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "could not parse"),
        ("", "empty expression"),
        ("1+" * 150 + "1", "longer than 200"),
        ("1j * 2", "only numbers are allowed"),
    ],
)
def test_calculator_rejects_unsafe_or_invalid(expression, needle):
    with pytest.raises(CalculatorError, match=None) as info:
        evaluate_expression(expression)
    assert needle in str(info.value), str(info.value)


def test_calculator_node_limit_and_config_bounds():
    with pytest.raises(CalculatorError, match="too complex"):
        evaluate_expression("+".join(["1"] * 200), CalculatorConfig(max_expression_chars=1000))
    with pytest.raises(CalculatorError, match="longer than 10"):
        evaluate_expression("1 + 2 + 3 + 4", CalculatorConfig(max_expression_chars=10))


async def test_calculator_tool_execute_returns_text_results():
    tool = CalculatorTool()
    iid = await tool.create()
    ok = await tool.execute(iid, {"expression": "3 * 4"})
    assert ok == ToolExecution(text="12", reward=0.0, metrics={"calculator/error": 0.0})
    bad = await tool.execute(iid, {"expression": "os.system"})
    assert bad.text.startswith("Error: attribute access") and bad.metrics["calculator/error"] == 1.0
    assert (await tool.execute(iid, {"expression": 5})).text == "5"
    assert (await tool.execute(iid, {})).text.startswith("Error: expression must be a string")
    await tool.release(iid)
    assert tool.num_instances == 0


# -- sleep tool --------------------------------------------------------------------------------------


async def test_sleep_tool_echoes_after_latency_with_seeded_jitter():
    tool = SleepTool(config={"latency_s": 0.05, "jitter_s": 0.02, "seed": 3})
    start = time.perf_counter()
    out = await tool.execute("i", {"text": "hello"})
    assert out.text == "hello"
    assert 0.03 <= out.metrics["sleep/latency_s"] <= 0.07
    assert time.perf_counter() - start >= out.metrics["sleep/latency_s"] * 0.9
    replay = SleepTool(config={"latency_s": 0.05, "jitter_s": 0.02, "seed": 3})
    assert replay.next_latency_s() == out.metrics["sleep/latency_s"]  # same seed, same latencies
    other = SleepTool(config={"latency_s": 0.05, "jitter_s": 0.02, "seed": 4})
    assert [other.next_latency_s() for _ in range(3)] != [replay.next_latency_s() for _ in range(3)]
    assert SleepTool(config={"latency_s": 0.0, "jitter_s": 1.0}).next_latency_s() >= 0.0  # clipped at zero
    with pytest.raises(ValueError, match="latency_s"):
        SleepTool(config={"latency_s": -1})


# -- executor ----------------------------------------------------------------------------------------


class _Raising(BaseTool):
    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"function": {"name": "boom"}})

    async def execute(self, instance_id, parameters):
        raise RuntimeError("kaput")


class _VerlStyle(BaseTool):
    """Returns verl's (response, reward, metrics) tuple and a per-instance reward."""

    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"function": {"name": "verlish"}})

    async def execute(self, instance_id, parameters):
        return "fine", 0.5, {"n": 2, "ignored": "text"}

    async def calc_reward(self, instance_id):
        return 0.25


def _call(i: int, name: str, **arguments) -> ToolCall:
    return ToolCall(call_id=f"call_{i}", name=name, arguments=arguments)


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry([CalculatorTool(), SleepTool(config={"latency_s": 0.3}), _Raising(), _VerlStyle()])


@pytest.mark.timeout(10)
async def test_execute_calls_fault_boundary(registry):
    ids = await registry.create_instances({})
    assert set(ids) == {"calculator", "sleep", "boom", "verlish"}
    calls = [
        _call(0, "calculator", expression="6 * 7"),
        _call(1, "sleep", text="slow"),  # 0.3 s > timeout
        _call(2, "boom"),
        _call(3, "nope"),
        _call(4, "calculator"),
        ToolCall(call_id="call_5", name="", error="tool call is not valid JSON"),
        _call(6, "verlish"),
        _call(7, "calculator", expression="1 / 0"),
    ]
    start = time.perf_counter()
    results = await registry.execute_calls(calls, ids, timeout_s=0.1, max_parallel=8)
    assert time.perf_counter() - start < 0.3  # concurrent, and the sleep was cut at the timeout
    assert [r.call_id for r in results] == [c.call_id for c in calls]
    texts = [r.text for r in results]
    assert texts[0] == "42" and not results[0].is_error
    assert texts[1] == "Error: tool 'sleep' timed out after 0.1 s" and results[1].latency_s >= 0.09
    assert texts[2] == "Error: tool 'boom' failed: RuntimeError: kaput"
    assert texts[3].startswith("Error: unknown tool 'nope'; available tools: boom, calculator, sleep, verlish")
    assert "missing required argument(s) 'expression'" in texts[4]
    assert texts[5] == "Error: tool call is not valid JSON"
    assert (texts[6], results[6].reward, results[6].is_error) == ("fine", 0.5, False)
    assert texts[7] == "Error: division by zero" and results[7].is_error
    assert [r.is_error for r in results] == [False, True, True, True, True, True, False, True]
    m = registry.metrics()
    assert (registry.num_calls, registry.num_errors, registry.num_timeouts, registry.num_parse_errors) == (8, 6, 1, 1)
    assert (m["rollout/tools/num_validation_errors"], m["rollout/tools/num_exceptions"]) == (2.0, 1.0)
    assert await registry.tool_rewards(ids) == {"calculator": 0.0, "sleep": 0.0, "boom": 0.0, "verlish": 0.25}
    await registry.release_instances(ids)
    assert all(t.num_instances == 0 for t in registry.tools.values())


@pytest.mark.timeout(10)
async def test_execute_calls_parallel_limit_answers_the_rest_with_errors(registry):
    ids: dict[str, str] = {}  # instances are created lazily and recorded for release
    calls = [_call(i, "calculator", expression=f"{i} + 1") for i in range(5)]
    results = await registry.execute_calls(calls, ids, timeout_s=1.0, max_parallel=2)
    assert [r.text for r in results[:2]] == ["1", "2"]
    assert all("too many tool calls in one turn (limit 2)" in r.text and r.is_error for r in results[2:])
    assert registry.num_rejected == 3 and set(ids) == {"calculator"}
    await registry.release_instances(ids)


@pytest.mark.timeout(10)
async def test_execute_calls_runs_concurrently():
    registry = ToolRegistry([SleepTool(config={"latency_s": 0.2})])
    ids = await registry.create_instances()
    start = time.perf_counter()
    results = await registry.execute_calls(
        [_call(i, "sleep", text=str(i)) for i in range(4)], ids, timeout_s=2, max_parallel=4
    )
    assert time.perf_counter() - start < 0.6
    assert [r.text for r in results] == ["0", "1", "2", "3"]


async def test_execute_calls_propagates_cancellation():
    registry = ToolRegistry([SleepTool(config={"latency_s": 5})])
    task = asyncio.create_task(registry.execute_calls([_call(0, "sleep", text="x")], {}, timeout_s=10, max_parallel=1))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class _Replaying(CalculatorTool):
    """Records what `restore` was given."""

    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"function": {"name": "replaying"}})

    async def restore(self, instance_id, journal, **kwargs):
        self.restored = [(e.call_id, e.result.text) for e in journal]
        return await super().restore(instance_id, journal, **kwargs)


async def test_sessions_live_until_closed_and_restore_from_completed_calls():
    replaying = _Replaying()
    registry = ToolRegistry([CalculatorTool(), replaying])
    journal = [
        ToolJournalEntry(
            call_id="a",
            name="replaying",
            status=ToolCallStatus.DONE,
            result=ToolResult(call_id="a", name="replaying", text="1"),
        ),
        ToolJournalEntry(call_id="b", name="replaying"),  # in doubt: not replayed
    ]
    kwargs = {"calculator": {"create_kwargs": {"ground_truth": "7"}}}
    ids = await registry.open_session("traj-1", kwargs, journal)
    assert ids == {"calculator": "traj-1", "replaying": "traj-1"} and replaying.restored == [("a", "1")]
    assert registry.get("calculator").instance_state("traj-1") == {"ground_truth": "7"}
    assert await registry.open_session("traj-1", kwargs, []) is ids  # parked here: the live instances
    assert registry.num_sessions == 1
    await registry.close_session("traj-1")
    await registry.close_session("traj-1")  # idempotent
    assert registry.num_sessions == 0 and all(t.num_instances == 0 for t in registry.tools.values())
    assert CalculatorTool.idempotent and not _Raising.idempotent


def test_check_calls_splits_runnable_calls_from_error_results(registry):
    calls = [_call(0, "calculator", expression="1"), _call(1, "nope"), _call(2, "calculator", expression="2")]
    plan = registry.check_calls(calls, max_parallel=2)
    assert isinstance(plan[0], ToolCall) and plan[0].error is None
    assert isinstance(plan[1], ToolResult) and plan[1].text.startswith("Error: unknown tool 'nope'")
    assert isinstance(plan[2], ToolResult) and "too many tool calls" in plan[2].text
    lost = registry.interrupted(calls[0])
    assert lost.is_error and "interrupted" in lost.text and registry.metrics()["rollout/tools/num_interrupted"] == 1.0


async def test_registry_rejects_bad_construction_and_kwargs(caplog):
    with pytest.raises(ValueError, match="unique"):
        ToolRegistry([CalculatorTool(), CalculatorTool()])
    registry = ToolRegistry([CalculatorTool()], max_result_chars=4)
    for _ in range(2):  # kwargs of a tool not configured are ignored (as in verl), with one warning
        assert set(await registry.create_instances({"search": {"create_kwargs": {"k": 1}}})) == {"calculator"}
    assert [r.getMessage() for r in caplog.records].count(
        "tools_kwargs names tool 'search', which is not configured (tools: ['calculator']): its kwargs are ignored"
    ) == 1
    ids = await registry.create_instances({"calculator": {"create_kwargs": {"ground_truth": "7"}}})
    assert registry.get("calculator").instance_state(ids["calculator"]) == {"ground_truth": "7"}
    (long,) = await registry.execute_calls(
        [_call(0, "calculator", expression="10**9")], ids, timeout_s=1, max_parallel=1
    )
    assert long.text == "1000\n[truncated: 10 characters]"
    with pytest.raises(ValueError, match="positive"):
        await registry.execute_calls([], ids, timeout_s=0, max_parallel=1)


# -- YAML loading ------------------------------------------------------------------------------------


def test_load_shipped_configs_in_both_formats():
    ours = load_tool_config(CONFIGS / "calculator.yaml")
    verl = load_tool_config(CONFIGS / "verl_format_example.yaml")
    assert ours.names == verl.names == ["calculator"]
    assert ours.schemas() == verl.schemas()
    sleep = load_tool_config(CONFIGS / "sleep.yaml")
    assert sleep.names == ["sleep", "calculator"]
    assert sleep.get("sleep").config.latency_s == 0.5


def test_load_our_format_with_rename_and_custom_class(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "max_result_chars: 100\n"
        "tools:\n"
        "  - class_name: streamrl.workloads.tools.sleep_tool:SleepTool\n"
        "    config: {latency_s: 0.0}\n"
        "  - name: calc2\n"
        "    class_name: streamrl.tools.calculator:CalculatorTool\n"
        "    config: {type: native, max_result_digits: 20}\n"
    )
    registry = load_tool_config(path)
    assert registry.names == ["sleep", "calc2"] and registry.max_result_chars == 100
    assert registry.get("calc2").config.max_result_digits == 20
    assert registry.schemas()[1]["function"]["name"] == "calc2"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"tools": [{"name": "wolfram"}]}, "unknown built-in tool 'wolfram'"),
        ({"tools": [{"config": {}}]}, "needs `name`"),
        (
            {"tools": [{"class_name": "streamrl.workloads.tools.sleep_tool:SleepTool", "config": {"latency": 1}}]},
            "latency",
        ),
        ({"tools": [{"name": "sleep"}]}, "unknown built-in tool 'sleep'"),  # a workload's tool, not the library's
        ({"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool"}]}, "cannot import module"),
        ({"tools": [{"class_name": "streamrl.rollout.types.ToolCall"}]}, "not a subclass"),
        ({"tools": [{"name": "calculator", "config": {"type": "mcp"}}]}, "only 'native'"),
        (
            {
                "tools": [
                    {
                        "class_name": "streamrl.tools.calculator.CalculatorTool",
                        "tool_schema": {"type": "function"},
                    }
                ]
            },
            "function",
        ),
        ({"toolz": []}, "toolz"),
    ],
)
def test_bad_tool_configs_raise_value_errors(data, needle):
    with pytest.raises(ValueError) as info:
        load_tool_config(data)
    assert needle in str(info.value), str(info.value)


def test_schema_requires_declared_required_arguments():
    with pytest.raises(ValueError, match="not declared"):
        OpenAIFunctionToolSchema.model_validate({"function": {"name": "f", "parameters": {"required": ["x"]}}})


# -- a tool with a side effect: the ledger calculator (the chaos suite's I5 probe) -----------------


def _ledger_registry(tmp_path: Path) -> ToolRegistry:
    yaml_path = tmp_path / "tools.yaml"
    yaml_path.write_text(
        "tools:\n  - name: calculator\n    class_name: streamrl.workloads.tools.ledger:LedgerCalculator\n"
        f"    config: {{ledger_path: '{tmp_path / 'ledger.jsonl'}'}}\n"
    )
    return load_tool_config(yaml_path)


def test_ledger_calculator_records_every_execution_under_its_call_id(tmp_path):
    from streamrl.tools.executor import current_call
    from streamrl.workloads.tools.ledger import read_ledger

    reg = _ledger_registry(tmp_path)
    assert not reg.is_idempotent("calculator")  # so the agent loop journals and snapshots its calls
    assert reg.schemas() == load_tool_config("configs/tools/calculator.yaml").schemas()  # the model sees a calculator
    calls = [
        ToolCall(call_id=f"t1_call_{i}", name="calculator", arguments={"expression": f"{i} + 1"}) for i in range(3)
    ]
    results = asyncio.run(reg.run_calls(calls, {"calculator": "traj-a"}, timeout_s=5))
    assert [r.text for r in results] == ["1", "2", "3"]
    lines = read_ledger(tmp_path / "ledger.jsonl")
    assert sorted((x["instance_id"], x["call_id"], x["arguments"]["expression"]) for x in lines) == [
        ("traj-a", "t1_call_0", "0 + 1"),
        ("traj-a", "t1_call_1", "1 + 1"),
        ("traj-a", "t1_call_2", "2 + 1"),
    ]
    assert current_call() is None


def test_on_executed_fires_after_the_side_effect_and_before_the_result(tmp_path):
    from streamrl.workloads.tools.ledger import read_ledger

    reg = _ledger_registry(tmp_path)
    seen = []

    def hook(call):
        seen.append((call.call_id, len(read_ledger(tmp_path / "ledger.jsonl"))))
        raise RuntimeError("process dies here")  # what a kill at `tool.after_run` interrupts

    reg.on_executed = hook
    [result] = asyncio.run(reg.run_calls([_call(0, "calculator", expression="2 * 3")], {}, timeout_s=5))
    assert seen == [("call_0", 1)]  # the effect is on disk when the hook runs
    assert result.is_error and "process dies here" in result.text  # the result never got recorded as "6"
