"""One episode of the coding harness: the gateway's `command` for a sample of a mini-swe run.

    python -I -m streamrl.rollout.mini_swe.episode SPEC     # SPEC: an `EpisodeSpec` as JSON

Run by the gateway loop per sample (`rollout/gateway/command.py`), with the sample's session URL and
key, `STREAMRL_SAMPLE` and `STREAMRL_REWARD_FILE` in its environment. It

1. finds the sample's task from its group id (`tasks.task_id_of`) and makes the trajectory's
   repository copy and its sandbox (`shell.RepoShell`);
2. starts mini-swe-agent in the harness venv (`runner.py`) with the session URL and key but without
   the reward file's name, and serves the agent's shell commands over the runner's stdin/stdout, each
   in a fresh sandbox on the copy;
3. once the agent is done, however it ended, runs the task's hidden tests on the copy (`RepoShell.score`)
   and writes the fraction that passed to the reward file, and how the agent ended to the metrics file
   (`exit_<status>` = 1, e.g. `exit_submitted`, `exit_repeatedformaterror`, `exit_limitsexceeded`, and
   `model_calls`), which the run logs as `rollout/program/<name>/mean`.

The model's calls go from mini through litellm to the gateway, so the session records exactly what the
engine sampled; this program only carries commands and outputs. A runner that fails to start (its venv,
its configuration) fails the trajectory; an agent that ends badly is still scored.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from streamrl.rollout.mini_swe.config import EpisodeSpec
from streamrl.rollout.mini_swe.shell import RepoShell
from streamrl.rollout.mini_swe.tasks import Task, load_task, task_id_of

RUNNER = str(Path(__file__).with_name("runner.py"))  # run by the harness venv's python
# rollout.gateway.command's names, spelled here: importing the gateway would load its server stack
# (and its agent loops) into every episode's interpreter
REWARD_FILE_ENV = "STREAMRL_REWARD_FILE"
METRICS_FILE_ENV = "STREAMRL_METRICS_FILE"
MAX_LINE_BYTES = 1 << 20  # one request of the runner (a shell command)


def runner_spec(spec: EpisodeSpec, task: Task) -> dict[str, Any]:
    """What `runner.py` is told: mini's configuration, the model, the agent's limits, the task text."""
    cfg = spec.mini_swe
    return {
        "task": task.problem,
        "config": cfg.config,
        "model_class": cfg.model_class,
        "model": spec.model,
        "model_attempts": cfg.model_attempts,
        "agent": {
            "step_limit": cfg.step_limit,
            "max_consecutive_format_errors": cfg.max_consecutive_format_errors,
            "wall_time_limit_seconds": cfg.wall_time_s,
            "output_path": None,
        },
    }


def runner_env(home: str) -> dict[str, str]:
    """The runner's environment: this program's (the gateway's minimal one) without the reward file's
    and metrics files' names and the sample, which neither mini nor anything it starts has a use for, and a private HOME
    (mini keeps its global config folder there) that ends with the episode."""
    env = {k: v for k, v in os.environ.items() if k not in (REWARD_FILE_ENV, METRICS_FILE_ENV, "STREAMRL_SAMPLE")}
    return env | {"HOME": home}


async def serve(spec: EpisodeSpec, task: Task, shell: RepoShell, home: str) -> dict[str, Any]:
    """Run the harness on the task (HOME `home`), answering its shell commands; returns its `done` report."""
    assert spec.mini_swe.prepared is not None
    proc = await asyncio.create_subprocess_exec(
        spec.mini_swe.prepared.python, "-I", RUNNER, json.dumps(runner_spec(spec, task)),
        env=runner_env(home), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=MAX_LINE_BYTES,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    done: dict[str, Any] | None = None
    try:
        while line := await proc.stdout.readline():
            request = json.loads(line)
            if "done" in request:
                done = request["done"]
                break
            reply = await answer(spec, shell, request)
            proc.stdin.write((json.dumps(reply) + "\n").encode())
            await proc.stdin.drain()
    finally:
        if proc.returncode is None and done is None:
            proc.kill()
        status = await proc.wait()
    if done is None or status != 0:
        raise RuntimeError(f"the mini-swe-agent runner exited with {status} before reporting (its stderr above)")
    return done


async def answer(spec: EpisodeSpec, shell: RepoShell, request: dict[str, Any]) -> dict[str, Any]:
    """One shell command in the sandbox; `stop` is set when the repository outgrew its limit."""
    env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
    result = await shell.run(str(request["command"]), env)
    reply: dict[str, Any] = {
        "output": result.output,
        "returncode": result.returncode,
        "exception_info": result.exception_info,
        "stop": "",
    }
    if shell.repo_mb() > spec.mini_swe.sandbox.max_repo_mb:
        reply["stop"] = "RepositoryTooLarge"
    return reply


async def play(spec: EpisodeSpec, sample: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The whole episode (see the module docstring); returns the reward and the episode's metrics."""
    cfg = spec.mini_swe
    task = load_task(Path(cfg.tasks) / f"{task_id_of(sample['group_id'])}.toml")
    shell = RepoShell(task, cfg.sandbox)
    try:
        with tempfile.TemporaryDirectory(prefix="streamrl-mini-swe-home-") as home:
            done = await serve(spec, task, shell, home)  # however the agent ended, its repository is scored
        score = await shell.score(cfg.score_timeout_s)
    finally:
        shell.close()
    return score.reward, episode_metrics(done)


def episode_metrics(done: dict[str, Any]) -> dict[str, float]:
    """How the agent ended, as the run's metrics (`rollout.gateway.command.read_metrics`): its exit
    status (mini's, or the exception that ended it) as a flag `exit_<status>`, and its model calls."""
    status = re.sub(r"[^a-z0-9]+", "_", str(done.get("exit_status") or "none").lower()).strip("_")[:40] or "none"
    return {f"exit_{status}": 1.0, "model_calls": float(done.get("num_calls") or 0)}


def main(argv: list[str]) -> int:
    spec = EpisodeSpec.model_validate_json(argv[1])
    reward, metrics = asyncio.run(play(spec, json.loads(os.environ["STREAMRL_SAMPLE"])))
    Path(os.environ[REWARD_FILE_ENV]).write_text(f"{reward!r}\n")
    if METRICS_FILE_ENV in os.environ:  # absent when an older gateway runs the episode
        Path(os.environ[METRICS_FILE_ENV]).write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
