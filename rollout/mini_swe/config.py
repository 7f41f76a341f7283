"""`rollout.agent.mini_swe`: the coding harness a run trains, its tasks, and the sandbox its commands run in.

Pure data. A run file names the task folder, the mini-swe-agent configuration (mini's own `-c` specs:
its bundled YAML files, a path, or `key=value` pairs) and the limits of an episode; the preparation
phase (`prepare.py`, before training starts) builds the harness's venv from `requirements`, writes the
tasks' train and eval prompts into the run directory and fills `prepared`, which the run's saved config
keeps (a resume reuses it). With this section set, `data.source` (and `eval.source`, when held-out
evaluation runs) must be "mini_swe": the tasks' splits are the prompt stream.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.rollout.gateway.config import GatewayConfig, check_command_sources

SOURCE = "mini_swe"  # the data.source / eval.source value that names the tasks' prompts
# The harness and the litellm it calls models through, pinned exactly: litellm changes often, and two of
# its releases (1.82.7, 1.82.8) are excluded by mini-swe-agent itself.
DEFAULT_REQUIREMENTS = ("mini-swe-agent==2.4.6", "litellm==1.110.2")


class PreparedMiniSwe(BaseModel):
    """What the preparation phase made (never written in a run file)."""

    model_config = ConfigDict(extra="forbid")

    python: str  # the harness venv's interpreter
    train_file: str  # the train tasks' prompts (RUN_DIR/mini_swe/train.jsonl)
    eval_file: str | None = None  # the eval tasks' prompts, when there are any


class CommandSandbox(BaseModel):
    """The sandbox each shell command of the harness runs in (`tools/sandbox`): one per command, the
    trajectory's repository copy bound read-write at ./repo, nothing else of the host writable."""

    model_config = ConfigDict(extra="forbid")

    isolation: Literal["auto", "bwrap", "unshare", "none"] = "auto"  # "none" only when chosen explicitly
    timeout_s: float = Field(10.0, gt=0)  # one command's wall clock; mini's environment.timeout is not used
    memory_mb: int = Field(1024, gt=0)  # all of one command's processes together
    cpu_s: int = Field(10, gt=0)
    file_mb: int = Field(16, gt=0)  # the largest file a command may write
    processes: int = Field(32, gt=0)
    max_output_bytes: int = Field(8192, ge=256)  # of a command's output; the middle of longer output is cut
    max_repo_mb: int = Field(64, gt=0)  # the repository past this size ends the episode


class MiniSweConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: str = Field("workloads/swe_tasks", min_length=1)  # a folder of task files (`tasks.py`)
    # mini-swe-agent's configuration, merged in order as its `-c` flag merges them: a bundled file
    # ("mini_textbased.yaml"), a YAML path (relative to the working directory, or to this package:
    # "mini_compact.yaml"), or a `key=value` pair ("agent.step_limit=4"). Its agent and model sections are
    # used; streamrl sets the model name, base URL and key, and the fields below.
    config: list[str] = Field(default_factory=lambda: ["mini_textbased.yaml"], min_length=1)
    # The model class: text-based actions (```mswea_bash_command blocks) or tool calls (the run's
    # tool_parser must read the policy's tool-call format).
    model_class: Literal["litellm_textbased", "litellm"] = "litellm_textbased"
    step_limit: int = Field(8, gt=0)  # model calls of one episode
    # A format error makes mini send its next call without the reply the gateway sampled, which forks the
    # session (the earlier turns are then not trained): 1 ends the episode at the first one instead.
    max_consecutive_format_errors: int = Field(1, ge=0)
    # An episode's wall clock (mini's wall_time_limit_seconds); with the hidden tests it must fit in the
    # gateway's timeout_s, or the trajectory fails instead of being scored.
    wall_time_s: int = Field(240, gt=0)
    # Attempts of one model call (mini's MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT). The gateway's 4xx are
    # final (a budget 400 would otherwise be retried with 4-60 s waits); its 5xx are retried by the
    # OpenAI client under litellm.
    model_attempts: int = Field(1, gt=0)
    sandbox: CommandSandbox = Field(default_factory=CommandSandbox)
    score_timeout_s: float = Field(30.0, gt=0)  # the hidden tests' run
    # pip requirements of the harness's own venv; one venv per distinct set, cached under
    # $STREAMRL_CACHE/mini-swe-venvs.
    requirements: list[str] = Field(default_factory=lambda: list(DEFAULT_REQUIREMENTS), min_length=1)
    prepared: PreparedMiniSwe | None = None  # set by the preparation phase

    @model_validator(mode="after")
    def _check(self) -> MiniSweConfig:
        if any(not r.strip() or r.strip().startswith("-") for r in self.requirements):
            raise ValueError(
                f"rollout.agent.mini_swe.requirements: requirement specifiers only, got {self.requirements}"
            )
        return self

    @property
    def requirements_key(self) -> str:
        """The venv's cache key: a hash of the sorted requirement set."""
        canonical = json.dumps(sorted(r.strip() for r in self.requirements))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def episode_budget_s(self) -> float:
        """The longest an episode may take: the agent's wall clock, its last command, the hidden tests."""
        return self.wall_time_s + self.sandbox.timeout_s + self.score_timeout_s


def check_sources(
    mini_swe: MiniSweConfig | None, gateway: GatewayConfig | None, data_source: str, eval_source: str | None
) -> None:
    """`data.source` / `eval.source` = "mini_swe" exactly when the harness is configured (a prepared run
    names its written files instead), the gateway has no program of its own, and an episode fits in the
    gateway's timeout."""
    if mini_swe is None:
        if SOURCE in (data_source, eval_source):
            raise ValueError(
                f'data.source / eval.source = "{SOURCE}" reads the coding tasks: configure them in '
                "[rollout.agent.mini_swe]"
            )
        return
    prepared = mini_swe.prepared
    train_file = None if prepared is None else prepared.train_file
    check_command_sources("mini_swe", SOURCE, "its tasks", train_file, gateway, data_source)
    timeout_s = (gateway or GatewayConfig()).timeout_s
    if mini_swe.episode_budget_s >= timeout_s:
        raise ValueError(
            f"rollout.agent.mini_swe: an episode may take {mini_swe.episode_budget_s:g} s (wall_time_s + "
            f"sandbox.timeout_s + score_timeout_s), not less than rollout.agent.gateway.timeout_s = {timeout_s:g}: "
            "lower wall_time_s or raise the timeout"
        )


class EpisodeSpec(BaseModel):
    """What the episode program is told (`episode.py`, the gateway's command): the section as prepared,
    its task folder and configuration files made absolute, and the name litellm sends to the gateway."""

    model_config = ConfigDict(extra="forbid")

    mini_swe: MiniSweConfig
    model: str  # litellm's name of the policy: "openai/<gateway model_name>" (its OpenAI-compatible provider)

    @model_validator(mode="after")
    def _check(self) -> EpisodeSpec:
        if self.mini_swe.prepared is None:
            raise ValueError("an episode needs the prepared harness (its venv's python)")
        return self
