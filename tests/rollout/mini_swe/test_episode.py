"""mini-swe-agent, unchanged, through the gateway: its commands fix the repository in the sandbox and the
hidden tests score it.

The real harness (mini-swe-agent 2.4.6 and litellm in their own venv, built once under $STREAMRL_CACHE)
runs its `DefaultAgent` and text-based litellm model against the real gateway server, whose engine is
scripted: assistant turn k is `turns[k]`. The episode is the gateway command the preparation phase makes,
run by `run_command` as the gateway loop runs it. What must hold:

- a right fix (read the file, edit it with sed, submit) passes every hidden test: reward 1.0; the
  session holds one record of the three calls (each continues the last: no fork);
- a wrong fix scores below 1.0 (the scoring can fail), and the untouched repository scores its baseline;
- a reply without an action block ends the episode at once (max_consecutive_format_errors = 1): one
  call, no fork, the repository's baseline score;
- with mini's tool-calling model class and its own `mini.yaml`, unchanged, the same fix made by tool
  calls (parsed by the gateway's tool parser) scores 1.0 in one unforked record;
- a command cannot write the reward, read the session key, or write outside its repository copy;
- the session's budget running out (the gateway's 400) ends the episode at once, and it is scored.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from streamrl.rollout.gateway.command import run_command
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.loop import sample_of
from streamrl.rollout.mini_swe.config import MiniSweConfig
from streamrl.rollout.mini_swe.prepare import episode_command, prepare_mini_swe, resolve_config
from streamrl.rollout.types import AgentData, AgentState

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
CONFIG = ["mini_textbased.yaml", "mini_compact.yaml"]


def action(command: str, thought: str = "THOUGHT: next step.") -> str:
    return f"{thought}\n\n```mswea_bash_command\n{command}\n```"


SUBMIT = action("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "THOUGHT: fixed.")
RIGHT_FIX = [action("cat calc.py"), action("sed -i '3s/a - b/a + b/' calc.py"), SUBMIT]  # add() only
TOOL_FIX = [  # hermes tool calls of mini's one tool, `bash`
    f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>'
    for command in ("cat calc.py", "sed -i '3s/a - b/a + b/' calc.py", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
]
WRONG_FIX = [action("cat calc.py"), action("sed -i 's/a - b/a + b/' calc.py"), SUBMIT]  # breaks sub() too


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[MiniSweConfig, GatewayConfig]:
    """The preparation phase, as `streamrl train` runs it (the venv is built once and cached)."""
    cfg = MiniSweConfig(tasks=str(REPO / "workloads" / "swe_tasks"), config=CONFIG)
    return prepare_mini_swe(cfg, GatewayConfig(timeout_s=300), tmp_path_factory.mktemp("run"))


async def play(gw, gateway: GatewayConfig, task_id: str) -> tuple[float | None, dict[str, float]]:
    """One sample of `task_id` through the gateway command, as the gateway loop plays it: its reward
    and the metrics it reported (how the agent ended)."""
    data = AgentData(
        trajectory_id=f"train-{task_id}@e0/0",
        group_id=f"train-{task_id}@e0",
        agent_name="gateway",
        messages=[{"role": "user", "content": "(the harness sends its own prompt)"}],
    )
    session = await gw.open_session(data)
    data.state = AgentState.INTERACTING
    reported = []
    reward = await run_command(
        gateway, gw.server.base_url(session), session.token, sample_of(data, data.messages), reported.append
    )
    session.finish()  # the program ended: its last answer joins the record, as in the gateway loop
    (metrics,) = reported
    return reward, metrics


async def test_a_right_fix_passes_the_hidden_tests_in_one_unforked_record(prepared, make_gateway):
    _, gateway = prepared
    gw, turn_ids = await make_gateway(RIGHT_FIX)
    assert await play(gw, gateway, "calc_add") == (1.0, {"exit_submitted": 1.0, "model_calls": 3.0})
    state = gw.session.state
    assert (state.num_calls, state.num_forks) == (3, 0)
    record = gw.session.data
    sampled = [t for t, m in zip(record.response_ids, record.response_mask) if m]
    assert sampled == [t for turn in turn_ids for t in turn]  # the trained tokens are the engine's, all of them


async def test_a_wrong_fix_and_no_fix_score_below_one(prepared, make_gateway):
    _, gateway = prepared
    wrong, _ = await play((await make_gateway(WRONG_FIX))[0], gateway, "calc_add")
    untouched, _ = await play((await make_gateway([SUBMIT]))[0], gateway, "calc_add")
    assert wrong == 0.75  # add() fixed, sub() broken: 3 of 4 hidden tests
    assert untouched == 0.5  # the bug left in: 2 of 4


async def test_a_format_error_ends_the_episode_without_a_fork(prepared, make_gateway):
    _, gateway = prepared
    gw, _ = await make_gateway(["I think the bug is in calc.py."])  # no action block
    assert await play(gw, gateway, "calc_add") == (0.5, {"exit_repeatedformaterror": 1.0, "model_calls": 1.0})
    assert (gw.session.state.num_calls, gw.session.state.num_forks) == (1, 0)


async def test_a_command_cannot_write_the_reward_or_leave_its_repository(
    prepared, make_gateway, tiny_tokenizer, tmp_path
):
    _, gateway = prepared
    outside, left = tmp_path / "outside", Path(f"/tmp/streamrl-left-{os.getpid()}")
    outside.mkdir()
    escape = (
        'echo 1.0 > "$STREAMRL_REWARD_FILE"; echo "key=$OPENAI_API_KEY" > leak.txt; '
        f"echo x > {outside}/pwned; echo x > {left}; ls /work > listing.txt 2>&1; "
        "sed -i '3s/a - b/a + b/' calc.py && git diff --stat > diff.txt"
    )
    gw, _ = await make_gateway([action(escape), action("cat leak.txt listing.txt diff.txt"), SUBMIT])
    assert (await play(gw, gateway, "calc_add"))[0] == 1.0  # the hidden tests' score, not the 1.0 it wrote
    assert not (outside / "pwned").exists() and not left.exists()  # the sandbox's /tmp is its own
    seen = tiny_tokenizer.decode(gw.session.data.response_ids)  # the observations are on the record
    assert "key=\n" in seen and gw.session.token not in seen  # no session key in the sandbox
    assert "cannot access '/work'" in seen  # no checkout, no trainer's files there
    assert "1 file changed" in seen  # the copy is a git repository, and the edit persisted


async def test_the_tool_calling_model_class_with_minis_own_config(prepared, make_gateway):
    cfg, gateway = prepared
    tools = cfg.model_copy(update={"config": resolve_config(["mini.yaml"]), "model_class": "litellm"})
    gateway = gateway.model_copy(update={"command": episode_command(tools, "policy")})
    gw, _ = await make_gateway(TOOL_FIX)
    gw.ctx.cfg.prompt_length = 4096  # mini.yaml unchanged: about 2,500 tokens of the tiny model's vocabulary
    assert await play(gw, gateway, "calc_add") == (1.0, {"exit_submitted": 1.0, "model_calls": 3.0})
    assert (gw.session.state.num_calls, gw.session.state.num_forks) == (3, 0)


async def test_the_end_of_the_sessions_budget_ends_the_episode_at_once(prepared, make_gateway):
    """The gateway's budget 400 is worded as OpenAI words a context overflow, so litellm raises its
    ContextWindowExceededError, which mini never retries: with 3 attempts per call allowed, the
    rejected call reaches the gateway once (a plain 400 would be sent 3 times, 4-60 s apart)."""
    cfg, gateway = prepared
    retrying = cfg.model_copy(update={"model_attempts": 3})
    gateway = gateway.model_copy(update={"command": episode_command(retrying, "policy")})
    gw, turn_ids = await make_gateway(RIGHT_FIX)
    gw.ctx.cfg.response_length = len(turn_ids[0]) + 20  # the first answer fits, its observation does not
    started = time.monotonic()
    reward, ended = await play(gw, gateway, "calc_add")
    assert reward == 0.5  # scored as the agent left the repository
    assert ended == {"exit_contextwindowexceedederror": 1.0, "model_calls": 2.0}  # mini counts the refused call
    assert (gw.server.num_requests, gw.server.num_errors) == (2, 1)  # the answer, then one rejection
    assert time.monotonic() - started < 30
    assert (gw.session.state.num_calls, gw.session.state.num_forks) == (1, 0)


def test_streamrl_rollout_prepares_the_harness_beside_its_output(prepared, tiny_model_path, tmp_path, monkeypatch):
    """`streamrl rollout` on a harness config prepares it as `streamrl train` does (here into a folder
    beside its output, `r/` for `r.jsonl`): the train tasks' prompts are the records it plays, and the
    gateway runs the harness's episode program. The agent loops themselves are `run_rollouts`, whose
    real engine path `test_eval_cli.py` and the end-to-end runs cover; here it only records its input."""
    import streamrl.streaming.eval as eval_module
    from streamrl.rollout.mini_swe.tasks import load_tasks, prompt_rows
    from streamrl.streaming.cli import main

    seen = {}

    async def record_input(cfg, records, *, group_size):
        seen.update(cfg=cfg, records=records, group_size=group_size)
        return []

    monkeypatch.setattr(eval_module, "run_rollouts", record_input)
    monkeypatch.chdir(REPO)  # the config's task folder is relative to the repository, as in `streamrl train`
    out = tmp_path / "r.jsonl"
    argv = ["rollout", "--config", "configs/mini_swe_tiny.toml", "--num-prompts", "2", "--out", str(out)]
    assert main([*argv, f"model={tiny_model_path}"]) == 0
    cfg = seen["cfg"]
    assert cfg.data.source == str(tmp_path / "r" / "mini_swe" / "train.jsonl")
    assert cfg.rollout.agent.mini_swe.prepared.python == prepared[0].prepared.python  # the cached venv
    assert cfg.rollout.agent.gateway.command == episode_command(cfg.rollout.agent.mini_swe, "policy")
    train_rows = prompt_rows(load_tasks(REPO / "workloads" / "swe_tasks"), "train")
    assert [(r.group_id, r.messages) for r in seen["records"]] == [(t["id"], t["messages"]) for t in train_rows[:2]]
    assert seen["group_size"] == 1
    assert out.exists()
