"""A verifiers environment through the gateway gives the reward verifiers' own evaluation gives.

The three example environments (`workloads/verifiers_envs/`: a SingleTurnEnv, a ToolEnv, a
StatefulToolEnv) run in their own venv (verifiers 0.3.1, built once under $STREAMRL_CACHE) against the
real gateway server with a scripted engine whose answer depends on the question only: a calculator call
(tool environments), then a boxed answer that is right for some questions and wrong for others. Per eval
example, streamrl's path (the gateway `command` the preparation phase makes, run by `run_command` with
the held-out group id, reward from STREAMRL_REWARD_FILE) must equal verifiers' own
`Environment.evaluate` against a session of the same gateway, and the rewards must differ across
examples (so the comparison can fail). Each sample's session holds one record: the environment's turns
continue it, never rewrite it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

from streamrl.rollout.gateway.command import run_command
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.loop import sample_of
from streamrl.rollout.types import AgentData, AgentState
from streamrl.rollout.verifiers.config import VerifiersConfig
from streamrl.rollout.verifiers.prepare import runner_command
from streamrl.rollout.verifiers.venv import ensure_venv, venv_folder

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
ENVS = str(REPO / "workloads" / "verifiers_envs")
NUM_EXAMPLES = 3
QUESTION = re.compile(r"What is (\d+) \* (\d+) ([+-]) (\d+)\?")
HEADER = "<|im_start|>assistant\n"
RUBRIC_WEIGHTS = {  # each example environment's reward functions and weights (workloads/verifiers_envs/)
    "vf_arith_single": {"correct_answer": 1.0},
    "vf_arith_tools": {"correct_answer": 1.0},
    "vf_arith_stateful": {"correct_answer": 1.0, "answer_from_calculator": 0.5},
}

# verifiers' own evaluation path, in the environment's venv: `evaluate` on the eval split, one rollout per
# example, one at a time, against the session URL; prints {example_id: reward}.
EVALUATE = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[2])
import verifiers as vf
from verifiers.types import ClientConfig
env = vf.load_environment(sys.argv[1], num_eval=int(sys.argv[3]))
client = ClientConfig(api_base_url=sys.argv[4], api_key_var="OPENAI_API_KEY", max_retries=0)
out = asyncio.run(env.evaluate(client, "policy", num_examples=int(sys.argv[3]), max_concurrent=1))
print(json.dumps({o["example_id"]: o["reward"] for o in out["outputs"]}))
"""


@pytest.fixture(scope="module")
def env_python() -> Path:
    requirements = VerifiersConfig(environment="x").requirements
    return ensure_venv(venv_folder(VerifiersConfig(environment="x").requirements_key), requirements, print)


def _script(tokenizer, uses_tools: bool):
    """Engine script: the reply of assistant turn k to the question in the prompt (a session's record
    holds one conversation: verifiers' `evaluate` moving to the next example forks it)."""
    header = tokenizer.encode(HEADER, add_special_tokens=False)

    def reply(question: tuple[str, ...], turn: int) -> str:
        a, b, op, c = question
        expression = f"{a} * {b} {op} {c}"
        value = int(a) * int(b) + (int(c) if op == "+" else -int(c))
        if uses_tools and turn == 0:
            return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        return f"The answer is \\boxed{{{value if int(a) % 2 == 0 else value + 1}}}."  # wrong for odd a

    def script(prompt_ids: list[int]) -> list[int]:
        starts = [i + len(header) for i in range(len(prompt_ids)) if prompt_ids[i : i + len(header)] == header]
        text = tokenizer.decode(prompt_ids[: starts[-1]])
        question = QUESTION.findall(text)[-1]
        target = tokenizer.encode(reply(question, len(starts) - 1), add_special_tokens=False)
        target.append(tokenizer.eos_token_id)
        return target[len(prompt_ids) - starts[-1] :]

    return script


async def _evaluate(python: Path, environment: str, gw) -> dict[int, float]:
    proc = await asyncio.create_subprocess_exec(
        str(python), "-I", "-c", EVALUATE, environment, ENVS, str(NUM_EXAMPLES), gw.base_url,
        env={**os.environ, "OPENAI_API_KEY": gw.api_key},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    return {int(k): v for k, v in json.loads(out.decode().strip().splitlines()[-1]).items()}


async def _streamrl_reward(python: Path, spec: dict, gw, example_id: int) -> tuple[float | None, dict[str, float]]:
    data = AgentData(
        trajectory_id=f"eval/eval-{example_id}@e0/0",
        group_id=f"eval/eval-{example_id}@e0",
        agent_name="gateway",
        messages=[{"role": "user", "content": "(the environment builds its own prompt)"}],
    )
    session = await gw.open_session(data)
    data.state = AgentState.INTERACTING
    cfg = GatewayConfig(command=runner_command(python, spec), timeout_s=300)
    reported: list[dict[str, float]] = []
    sample = sample_of(data, data.messages)
    reward = await run_command(cfg, gw.server.base_url(session), session.token, sample, reported.append)
    (metrics,) = reported
    return reward, metrics


@pytest.mark.parametrize(
    ("environment", "uses_tools"),
    [("vf_arith_single", False), ("vf_arith_tools", True), ("vf_arith_stateful", True)],
)
async def test_the_gateway_reward_is_the_environments_own(
    environment, uses_tools, env_python, make_gateway, tiny_tokenizer, tmp_path
):
    spec = VerifiersConfig(environment=environment, args={"num_eval": NUM_EXAMPLES}).spec([ENVS], model="policy")
    gw = await make_gateway(script=_script(tiny_tokenizer, uses_tools))
    gw.ctx.cfg.response_length = 4000  # verifiers' evaluate plays every example on one session (forks)
    expected = await _evaluate(env_python, environment, gw)
    assert sorted(expected) == list(range(NUM_EXAMPLES))
    got = {}
    for i in range(NUM_EXAMPLES):
        got[i], metrics = await _streamrl_reward(env_python, spec, gw, i)
        # the rubric's parts, reported beside the reward: its weighted sum is the reward
        weights = RUBRIC_WEIGHTS[environment]
        assert set(weights) <= set(metrics), metrics
        assert got[i] == pytest.approx(sum(w * metrics[name] for name, w in weights.items())), metrics
        # the environment's turns are one record: a call, (a tool result, a call), no history rewrite
        assert (gw.session.state.num_calls, gw.session.state.num_forks) == (2 if uses_tools else 1, 0)
    assert got == expected
    assert len(set(got.values())) > 1, f"every example scored the same ({got}): the comparison proves nothing"
    print(environment, got, file=sys.stderr)
