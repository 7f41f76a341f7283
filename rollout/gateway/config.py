"""The gateway's configuration (`rollout.agent.gateway`): where it listens, what it accepts, and which user
program the `gateway` agent loop runs per sample.

Pure data (pydantic, no web framework imported): `rollout/config.py` embeds it in `AgentConfig`, and a
run's config file spells it under `[rollout.agent.gateway]`. Nothing here survives a crash or needs to:
the config is re-read from the run's config on resume.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # --- the server (one per rollout worker process, shared by its gateway loops) ---
    host: str = "127.0.0.1"  # loopback by default: the agent runs next to the worker
    port: int = Field(0, ge=0, le=65535)  # 0: an ephemeral port, chosen at start
    # Refused when set: every session has its own random bearer token (`Session.token`), because one
    # token for the whole server would let a sample's program use its siblings' sessions.
    api_key: str | None = None
    model_name: str = "policy"  # what `GET /v1/models` lists; requests may name any model
    max_request_bytes: int = Field(4 * 1024 * 1024, gt=0)  # larger bodies get 413
    max_choices: int = Field(8, gt=0)  # the largest `n` a request may ask for
    # False: the run's `rollout.agent.sampling` applies and a request's temperature / top_p / top_k are
    # ignored, so behaviour log-probs are those of the distribution the learner corrects against.
    honor_request_sampling: bool = False

    # --- the user program (exactly one of `program` and `command`) ---
    # `package.module:function`, an async (or sync) `run(base_url, api_key, sample) -> reward | None`.
    program: str | None = None
    # A command line run per sample with STREAMRL_BASE_URL / OPENAI_BASE_URL / OPENAI_API_KEY /
    # ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY / STREAMRL_SAMPLE (JSON, without the ground truth) in its
    # environment; its reward is the number it writes to the file named by STREAMRL_REWARD_FILE, else
    # the reward function's (`command.py`: a bare number on the last stdout line, the old way, warns).
    command: list[str] | None = None
    # Worker environment variables a command also gets. Its environment is otherwise minimal (PATH,
    # HOME, TMPDIR, locale, its session; `command.py`): everything in it reaches the model's tools.
    env_passthrough: list[str] = Field(default_factory=list)
    # Bytes of a command's stdout and of its stderr kept (the first and last halves; the rest is counted
    # and dropped): its stderr's end goes into a failure's message.
    max_output_bytes: int = Field(64 * 1024, ge=1024)
    # Sync `program`s running at once in a worker process (daemon threads of their own; one past its
    # timeout holds its thread until it returns, and later ones wait for a free one).
    max_sync_programs: int = Field(32, gt=0)
    timeout_s: float = Field(600.0, gt=0)  # a program still running after this fails its trajectory
    # Make every answered call durable (`AgentContext.append_journal`, one record in the buffer's journal
    # log) before its response is sent. Off: retries are still answered from the journal within this process.
    durable_journal: bool = True

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        if self.program is not None and self.command is not None:
            raise ValueError("rollout.agent.gateway: set `program` or `command`, not both")
        if self.api_key is not None:
            raise ValueError(
                "rollout.agent.gateway.api_key cannot be set: each session gets its own random bearer token, "
                "passed to its program (the `api_key` argument, or OPENAI_API_KEY for a command)"
            )
        if bad := [name for name in self.env_passthrough if not name or "=" in name or "\0" in name]:
            raise ValueError(f"rollout.agent.gateway.env_passthrough: not variable names: {bad}")
        if self.command is not None and not self.command:
            raise ValueError("rollout.agent.gateway.command must name a program")
        return self


def check_command_sources(
    section: str,
    source: str,
    reads: str,
    train_file: str | None,
    gateway: GatewayConfig | None,
    data_source: str,
) -> None:
    """The rules of a configured section that runs as the gateway's command and supplies the prompt
    stream (`[rollout.agent.verifiers]`, `[rollout.agent.mini_swe]`): the gateway has no program of its
    own, and `data.source` is `source` until the preparation phase has written `reads` to `train_file`,
    then that file. (`source` named while the section is absent is its own check's error.)"""
    if train_file is None and gateway is not None and (gateway.program is not None or gateway.command is not None):
        raise ValueError(
            f"[rollout.agent.{section}] runs as the gateway's command: leave rollout.agent.gateway.program / "
            "command unset"
        )
    if train_file is None and data_source != source:
        raise ValueError(
            f'[rollout.agent.{section}] trains on {reads}: set data.source = "{source}" (got {data_source!r})'
        )
    if train_file is not None and data_source != train_file:
        raise ValueError(f"data.source {data_source!r} is not the prepared train split of {reads} ({train_file!r})")
