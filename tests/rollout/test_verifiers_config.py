"""`[rollout.agent.verifiers]`: the config's rules, the runner's row addressing, and its refusals.

Fast: no venv, no engine. The runner script is run with this interpreter against stand-in `verifiers`
packages (a folder first on its import path) where a refusal is all that is checked; the real package
is exercised in tests/rollout/gateway/test_verifiers_runner.py and tests/streaming/test_verifiers_train.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.rollout.data import load_records
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.verifiers import runner
from streamrl.rollout.verifiers.config import PreparedVerifiers, VerifiersConfig
from streamrl.rollout.verifiers.prepare import RUNNER, prepare_environment, runner_command
from streamrl.streaming.config import StreamRLConfig, load_config

VF = ["rollout.agent.verifiers.environment=vf_arith_tools", "rollout.agent.default_agent=gateway"]


def test_a_verifiers_run_reads_the_environments_dataset():
    cfg = load_config(None, [*VF, "data.source=verifiers"])
    assert cfg.rollout.agent.verifiers is not None
    assert cfg.rollout.agent.verifiers.requirements == ["verifiers==0.3.1"]
    with pytest.raises(ValueError, match='set data.source = "verifiers"'):
        load_config(None, VF)
    with pytest.raises(ValueError, match=r"configure the environment in \[rollout.agent.verifiers\]"):
        load_config(None, ["data.source=verifiers"])
    with pytest.raises(ValueError, match="leave rollout.agent.gateway.program / command unset"):
        load_config(None, [*VF, "data.source=verifiers", "rollout.agent.gateway.program=m:run"])


def test_bad_verifiers_settings_are_one_clear_error():
    with pytest.raises(ValueError, match="requirement specifiers only"):
        VerifiersConfig(environment="e", requirements=["--index-url=http://x"])
    with pytest.raises(ValueError, match="must hold JSON values"):
        VerifiersConfig(environment="e", args={"f": object()})
    with pytest.raises(ValueError, match="group_rewards"):
        VerifiersConfig(environment="e", group_rewards="mean")  # type: ignore[arg-type]


def test_the_venv_key_is_the_requirement_set():
    a = VerifiersConfig(environment="e", requirements=["verifiers==0.3.1", "numpy"])
    b = VerifiersConfig(environment="other", requirements=[" numpy", "verifiers==0.3.1"])
    c = VerifiersConfig(environment="e", requirements=["verifiers==0.3.0", "numpy"])
    assert a.requirements_key == b.requirements_key != c.requirements_key


def test_an_unprepared_source_names_the_preparation():
    with pytest.raises(ValueError, match="preparation phase of `streamrl train`"):
        load_records("verifiers", 4, 0)


def test_prepare_refuses_a_gateway_program_before_building_anything(tmp_path):
    vcfg = VerifiersConfig(environment="e")
    with pytest.raises(ValueError, match="leave rollout.agent.gateway.program / command unset"):
        prepare_environment(vcfg, GatewayConfig(command=["agent"]), tmp_path)
    assert not (tmp_path / "verifiers").exists()


def test_a_prepared_config_trains_on_the_dumped_splits_through_the_runner(tmp_path):
    cfg = load_config(None, [*VF, "data.source=verifiers", "eval.source=verifiers", "eval.num_prompts=2"])
    prepared = PreparedVerifiers(python="/venv/bin/python", train_file=str(tmp_path / "t.jsonl"), eval_file="e.jsonl")
    gateway = GatewayConfig(timeout_s=7, command=runner_command(prepared.python, {"environment": "e"}))
    ready = cfg.with_verifiers(prepared, gateway)
    assert (ready.data.source, ready.eval.source) == (prepared.train_file, "e.jsonl")
    assert ready.rollout.agent.gateway == gateway and ready.rollout.agent.gateway.command[:3] == [
        "/venv/bin/python",
        "-I",
        RUNNER,
    ]
    assert ready.rollout.agent.verifiers is not None and ready.rollout.agent.verifiers.prepared == prepared
    # the saved config validates as it is (a resume reloads it)
    assert StreamRLConfig.model_validate(ready.model_dump(mode="json")) == ready
    with pytest.raises(ValueError, match="has no eval dataset"):
        cfg.with_verifiers(prepared.model_copy(update={"eval_file": None}), gateway)


@pytest.mark.parametrize(
    ("group_id", "row"),
    [("train-12@e3", ("train", 12)), ("eval/eval-0@e0", ("eval", 0)), ("train-7@e10", ("train", 7))],
)
def test_a_group_id_names_its_dataset_row(group_id, row):
    assert runner.example_of(group_id) == row


@pytest.mark.parametrize("group_id", ["abc@e0", "test-3@e0", "train-x@e0", "train-3"])
def test_a_group_id_of_no_row_is_refused(group_id):
    with pytest.raises(runner.RunnerError, match="names no dataset row"):
        runner.example_of(group_id)


def test_a_dataset_row_becomes_a_prompt_record():
    row = {
        "example_id": 4,
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "answer": 9,
    }
    line = runner.prompt_row(row, "train", "vf_env")
    assert line == {
        "id": "train-4",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "ground_truth": "9",
        "data_source": "verifiers:vf_env",
    }
    with pytest.raises(runner.RunnerError, match="only text prompts"):
        runner.prompt_row({**row, "prompt": [{"role": "user", "content": [{"type": "image"}]}]}, "train", "e")


def _run_runner(tmp_path: Path, package: str, environment: str = "env") -> subprocess.CompletedProcess:
    (tmp_path / "verifiers").mkdir()
    (tmp_path / "verifiers" / "__init__.py").write_text(package)
    spec = {"environment": environment, "paths": [str(tmp_path)]}
    return subprocess.run(
        [sys.executable, "-I", RUNNER, "dump", json.dumps(spec), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_runner_refuses_a_verifiers_without_the_classic_api(tmp_path):
    done = _run_runner(tmp_path, '__version__ = "0.4.0"\n')  # 0.4's root: the stack lives in verifiers.v1
    assert done.returncode == 2
    assert "verifiers 0.4.0 has no Environment, SingleTurnEnv" in done.stderr
    assert "pin verifiers<0.4" in done.stderr


GROUP_REWARD_VF = """
class Rubric:
    def __init__(self, funcs):
        self.funcs = funcs
    def _is_group_func(self, f):
        return "completions" in f.__code__.co_varnames
class Environment:
    requires_group_rollouts = True
    def __init__(self):
        def rank_in_group(completions): return [0.0] * len(completions)
        self.rubric = Rubric([rank_in_group])
SingleTurnEnv = MultiTurnEnv = ToolEnv = StatefulToolEnv = Environment
def load_environment(env_id, **args):
    return Environment()
"""


def test_the_runner_refuses_group_rewards_unless_scored_as_singletons(tmp_path):
    done = _run_runner(tmp_path, GROUP_REWARD_VF)
    assert done.returncode == 2
    assert "group-level reward functions (rank_in_group)" in done.stderr
    assert 'group_rewards = "singleton"' in done.stderr
