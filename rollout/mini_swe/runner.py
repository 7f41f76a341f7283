"""Run mini-swe-agent, unchanged, on one task: its `DefaultAgent` and litellm model against the gateway.

This file is executed as a script by the harness venv's python (`prepare.py` builds the venv), never
imported by streamrl: it uses the standard library and `minisweagent` only. The episode program
(`episode.py`, the trainer's side) starts it with one JSON argument (`SPEC`: `task`, `config`,
`model_class`, `model`, `agent`, `model_attempts`) and serves its shell commands:

    python -I runner.py SPEC

Its stdout is the bridge to the episode: one JSON line per shell command (`{"command", "env"}`), each
answered on stdin with the result (`{"output", "returncode", "exception_info", "stop"}`), and one last
line (`{"done": {...}}`) with the exit status. Everything mini and litellm print goes to stderr (fd 1 is
pointed there before they are imported). The agent's commands run in streamrl's sandbox, on the
trajectory's repository copy, never in this process: the environment class below forwards them.

The model is mini's own class (`litellm_textbased` or `litellm`) with the model name `openai/<name>`
(litellm's OpenAI-compatible provider), `api_base` / `api_key` the session's `OPENAI_BASE_URL` /
`OPENAI_API_KEY`, and cost tracking off (a local model has no price; every call costs 0, so the step
limit, not the cost limit, bounds an episode). Whatever ends the episode (submitted, a limit, a format
error, a gateway error after mini's retries) is reported; the episode scores the repository either way.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any, TextIO


def _quiet_and_offline(attempts: int) -> None:
    """Set before mini and litellm are imported (they read these at import): no banner, mini's global
    config folder in the episode's private HOME (not the user's, whose `.env` mini would load), no
    cost-map download, no cost errors, and mini's retries per model call."""
    os.environ.update(
        MSWEA_SILENT_STARTUP="1",
        MSWEA_CONFIGURED="1",
        MSWEA_GLOBAL_CONFIG_DIR=os.path.join(os.environ["HOME"], "mini-swe-agent"),
        MSWEA_COST_TRACKING="ignore_errors",
        MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=str(attempts),
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_LOG="ERROR",
        HF_HUB_OFFLINE="1",
    )


class Bridge:
    """The episode's end of the pipe: one JSON line out, one JSON line back."""

    def __init__(self, out: TextIO, back: TextIO) -> None:
        self.out, self.back = out, back

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        line = self.back.readline()
        if not line:
            raise RuntimeError("the episode closed the shell bridge")
        return json.loads(line)


def environment_class() -> type:
    """mini's `LocalEnvironment` with `execute` forwarded to the sandbox (imported after the env is set)."""
    from minisweagent.environments.local import LocalEnvironment  # pyrefly: ignore[missing-import]
    from minisweagent.exceptions import LimitsExceeded  # pyrefly: ignore[missing-import]
    from minisweagent.utils.serialize import recursive_merge  # pyrefly: ignore[missing-import]

    class SandboxShellEnvironment(LocalEnvironment):
        """Each command runs in streamrl's sandbox on the trajectory's repository (`episode.py`);
        completion is detected here as mini's own environments do (`_check_finished`)."""

        def __init__(self, *, bridge: Bridge, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.bridge = bridge

        def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
            reply = self.bridge.call({"command": action.get("command", ""), "env": self.config.env})
            output = {k: reply[k] for k in ("output", "returncode", "exception_info")}
            if reply.get("stop"):
                raise LimitsExceeded(
                    {
                        "role": "exit",
                        "content": reply["stop"],
                        "extra": {"exit_status": reply["stop"], "submission": ""},
                    }
                )
            self._check_finished(output)
            return output

        def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
            # mini's adds os.environ, which holds the session's key: a template must not reach it
            return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    return SandboxShellEnvironment


def build_agent(spec: dict[str, Any], bridge: Bridge) -> Any:
    """mini's DefaultAgent with mini's model class and the sandbox environment, configured as its `-c`
    flag would be (files and key=value pairs merged in order), then streamrl's settings on top."""
    import litellm  # pyrefly: ignore[missing-import]
    from minisweagent.agents.default import DefaultAgent  # pyrefly: ignore[missing-import]
    from minisweagent.config import get_config_from_spec  # pyrefly: ignore[missing-import]
    from minisweagent.models import get_model_class  # pyrefly: ignore[missing-import]
    from minisweagent.utils.serialize import recursive_merge  # pyrefly: ignore[missing-import]

    litellm.suppress_debug_info = True  # no "Provider List" banners in the episode's stderr
    config = recursive_merge(*(get_config_from_spec(item) for item in spec["config"]))
    model_config = dict(config.get("model", {}))
    model_config.pop("model_class", None)
    model_config.update(model_name=spec["model"], cost_tracking="ignore_errors")
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": os.environ["OPENAI_BASE_URL"],
        "api_key": os.environ["OPENAI_API_KEY"],
    }
    model = get_model_class(spec["model"], spec["model_class"])(**model_config)
    env_config = {k: v for k, v in config.get("environment", {}).items() if k in ("env", "timeout")}
    environment = environment_class()(bridge=bridge, **env_config)
    agent_config = {**config.get("agent", {}), **spec["agent"]}
    return DefaultAgent(model, environment, **agent_config)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    bridge = Bridge(os.fdopen(os.dup(1), "w"), sys.stdin)
    os.dup2(2, 1)  # what mini and litellm print goes to stderr, not into the bridge
    _quiet_and_offline(spec["model_attempts"])
    agent = build_agent(spec, bridge)
    try:
        info = agent.run(spec["task"])
        done = {"exit_status": info.get("exit_status", ""), "error": ""}
    except Exception as exc:  # mini re-raises what ended the run (a gateway error after its retries)
        done = {"exit_status": type(exc).__name__, "error": str(exc)[-500:]}
    done["num_calls"] = agent.n_calls
    bridge.send({"done": done})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
