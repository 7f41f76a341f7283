"""`rollout.agent.verifiers`: which verifiers environment a run trains on, and what its venv holds.

Pure data. A run file names the environment and its `load_environment` arguments; the preparation
phase (`prepare.py`, before training starts) builds the environment's virtual environment from
`requirements`, dumps its dataset into the run directory and fills `prepared`, which the run's saved
config keeps (a resume reuses it). With this section set, `data.source` (and `eval.source`, when held-out
evaluation runs) must be "verifiers": the environment's train (and eval) split is the prompt stream.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.rollout.gateway.config import GatewayConfig, check_command_sources

SOURCE = "verifiers"  # the data.source / eval.source value that names the environment's dataset
# The last verifiers release with the classic environment API (SingleTurnEnv, ToolEnv, MultiTurnEnv,
# StatefulToolEnv, Rubric); 0.4 keeps only `verifiers.v1`, another API.
DEFAULT_REQUIREMENTS = ("verifiers==0.3.1",)


class PreparedVerifiers(BaseModel):
    """What the preparation phase made (never written in a run file)."""

    model_config = ConfigDict(extra="forbid")

    python: str  # the environment venv's interpreter
    train_file: str  # the train split in streamrl's prompt layout (RUN_DIR/verifiers/train.jsonl)
    eval_file: str | None = None  # the eval split, when the environment has one


class VerifiersConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The environment: a module (import path, or an installed environment package's name, `-` read as
    # `_`) exposing `load_environment(**args)`, loaded by verifiers' own `load_environment`.
    environment: str = Field(min_length=1)
    args: dict[str, Any] = Field(default_factory=dict)  # `load_environment` keyword arguments (JSON values)
    # Folders put first on the environment's import path (relative ones from the working directory):
    # an environment module that is not installed as a package.
    paths: list[str] = Field(default_factory=list)
    # pip requirements of the environment's own venv (verifiers and whatever the environment needs); one
    # venv per distinct set, cached under $STREAMRL_CACHE/verifiers-venvs.
    requirements: list[str] = Field(default_factory=lambda: list(DEFAULT_REQUIREMENTS), min_length=1)
    # A rubric with group-level reward functions: "refuse" it, or score each sample as a "singleton" group
    # (its group functions see one sample). streamrl runs a group's samples independently.
    group_rewards: Literal["refuse", "singleton"] = "refuse"
    # Passed to the environment's rollout as `sampling_args` (max_tokens and the like); the gateway applies
    # the run's temperature / top_p unless rollout.agent.gateway.honor_request_sampling.
    sampling_args: dict[str, Any] = Field(default_factory=dict)
    max_retries: int = Field(2, ge=0)  # the OpenAI client's retries of a call (5xx; the gateway journals answers)
    prepared: PreparedVerifiers | None = None  # set by the preparation phase

    @model_validator(mode="after")
    def _check(self) -> VerifiersConfig:
        for name, value in (("args", self.args), ("sampling_args", self.sampling_args)):
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"rollout.agent.verifiers.{name} must hold JSON values: {exc}") from None
        if any(not r.strip() or r.strip().startswith("-") for r in self.requirements):
            raise ValueError(
                f"rollout.agent.verifiers.requirements: requirement specifiers only, got {self.requirements}"
            )
        return self

    @property
    def requirements_key(self) -> str:
        """The venv's cache key: a hash of the sorted requirement set."""
        canonical = json.dumps(sorted(r.strip() for r in self.requirements))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def spec(self, paths: list[str], model: str) -> dict[str, Any]:
        """What the runner script is told (`runner.py`): JSON, with the import folders made absolute."""
        return {
            "environment": self.environment,
            "args": self.args,
            "paths": paths,
            "group_rewards": self.group_rewards,
            "model": model,
            "sampling_args": self.sampling_args,
            "max_retries": self.max_retries,
        }


def check_sources(
    verifiers: VerifiersConfig | None, gateway: GatewayConfig | None, data_source: str, eval_source: str | None
) -> None:
    """`data.source` / `eval.source` = "verifiers" exactly when an environment is configured (one that
    is prepared already names its dumped files instead), and the gateway has no program of its own."""
    if verifiers is None:
        if SOURCE in (data_source, eval_source):
            raise ValueError(
                f'data.source / eval.source = "{SOURCE}" reads a verifiers environment\'s dataset: configure the '
                "environment in [rollout.agent.verifiers]"
            )
        return
    prepared = verifiers.prepared
    train_file = None if prepared is None else prepared.train_file
    check_command_sources("verifiers", SOURCE, "the environment's own dataset", train_file, gateway, data_source)
