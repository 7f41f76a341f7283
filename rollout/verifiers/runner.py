"""Run a verifiers environment inside its own virtual environment: dump its dataset, or play one sample.

This file is executed as a script by the environment's venv python (`venv.py` made it), never imported
by streamrl: it uses the standard library and `verifiers` only, so it runs beside whatever the
environment pins. Two commands, both given the environment as one JSON argument (`SPEC`: `environment`,
`args`, `paths`, `group_rewards`, `model`, `sampling_args`; `prepare.py` writes it):

    python runner.py dump SPEC OUT_DIR     # train.jsonl (+ eval.jsonl) in streamrl's prompt layout
    python runner.py rollout SPEC          # one sample, as a gateway `command` (docs/gateway.md)

`dump` writes each split's rows with `id` = `<split>-<example_id>`, so a prompt's group id
(`<id>@e<epoch>`, held-out ones prefixed `eval/`) names its dataset row. `rollout` reads the sample
from `STREAMRL_SAMPLE`, finds its row from the group id, runs the environment's own
`Environment.run_rollout` (its rollout, then its rubric's `score_rollout`) against the session's
`OPENAI_BASE_URL` with the session's `OPENAI_API_KEY`, and writes the reward to `STREAMRL_REWARD_FILE`
and the rollout's `metrics` (each reward function's score, the environment's own counts) to
`STREAMRL_METRICS_FILE`, which the run logs as `rollout/program/<name>/mean`.
An environment whose rubric has group-level reward functions is scored as a group of one
(`Environment.run_group` on the one input) when `group_rewards = "singleton"`, and refused otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

CLASSIC_API = ("Environment", "SingleTurnEnv", "MultiTurnEnv", "ToolEnv", "StatefulToolEnv", "Rubric")
SPLITS = {"train": "get_dataset", "eval": "get_eval_dataset"}
EVAL_GROUP_PREFIX = "eval/"  # held-out group ids (streaming/heldout.py)
METRICS_FILE_ENV = "STREAMRL_METRICS_FILE"  # rollout/gateway/command.py: at most 16 names of [a-z0-9_]{1,48}
MAX_METRICS = 16


class RunnerError(Exception):
    """A problem with the environment or the sample, reported in one line (exit status 2)."""


def load_env(spec: dict[str, Any]) -> Any:
    """The environment, made by verifiers' own loader (`verifiers.load_environment(env_id, **args)`)."""
    for path in reversed(spec.get("paths", [])):
        sys.path.insert(0, path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a training run never downloads from a hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import verifiers as vf  # pyrefly: ignore[missing-import]

    missing = [name for name in CLASSIC_API if not _has(vf, name)]
    if missing:
        raise RunnerError(
            f"verifiers {getattr(vf, '__version__', '?')} has no {', '.join(missing)}: streamrl runs the classic "
            "environment API (verifiers 0.4 keeps only verifiers.v1); pin verifiers<0.4 in requirements"
        )
    env = vf.load_environment(spec["environment"], **spec.get("args", {}))
    if not isinstance(env, vf.Environment):
        raise RunnerError(f"{spec['environment']}.load_environment() returned {type(env).__name__}, not an Environment")
    if env.requires_group_rollouts and spec.get("group_rewards", "refuse") != "singleton":
        raise RunnerError(
            f"{spec['environment']}: its rubric has group-level reward functions "
            f"({', '.join(group_funcs(env.rubric))}); "
            'streamrl scores each sample on its own: set group_rewards = "singleton" to score each as a group of one'
        )
    return env


def group_funcs(rubric: Any) -> list[str]:
    """Names of a rubric's (or a RubricGroup's members') group-level reward functions."""
    if hasattr(rubric, "rubrics"):
        return [name for member in rubric.rubrics for name in group_funcs(member)]
    return [getattr(f, "__name__", repr(f)) for f in rubric.funcs if rubric._is_group_func(f)]


def _has(module: Any, name: str) -> bool:
    try:
        getattr(module, name)
    except (AttributeError, ImportError):
        return False
    return True


def split_rows(env: Any, split: str) -> list[dict[str, Any]]:
    """The rows of one split as the environment builds them (`get_dataset` / `get_eval_dataset`), or []
    when it has no such split (verifiers' `get_eval_dataset` would fall back to the training rows)."""
    if split == "eval" and env.build_eval_dataset() is None:
        return []
    if split == "train" and env.build_dataset() is None:
        return []
    return list(getattr(env, SPLITS[split])().to_list())


def prompt_row(row: dict[str, Any], split: str, env_id: str) -> dict[str, Any]:
    """One dataset row in streamrl's flat prompt layout (`rollout/data/loaders.py`)."""
    messages = []
    for message in row["prompt"]:
        content = message.get("content")
        if not isinstance(content, str):
            raise RunnerError(f"{split} row {row['example_id']}: only text prompts are supported, got {content!r:.80}")
        messages.append({"role": message["role"], "content": content})
    answer = row.get("answer")
    return {
        "id": f"{split}-{row['example_id']}",
        "messages": messages,
        "ground_truth": None if answer is None else str(answer),
        "data_source": f"verifiers:{env_id}",
    }


def dump(spec: dict[str, Any], out_dir: Path) -> dict[str, int]:
    """Write `train.jsonl` and, when the environment has an eval split, `eval.jsonl`; returns row counts."""
    env = load_env(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        rows = split_rows(env, split)
        if not rows:
            continue
        lines = [json.dumps(prompt_row(r, split, spec["environment"]), ensure_ascii=False) for r in rows]
        (out_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        counts[split] = len(rows)
    if "train" not in counts:
        raise RunnerError(f"{spec['environment']} has no training dataset")
    return counts


def example_of(group_id: str) -> tuple[str, int]:
    """(split, example_id) of a group id `<split>-<example_id>@e<epoch>` (held-out: `eval/` before it)."""
    prompt = group_id.removeprefix(EVAL_GROUP_PREFIX).rpartition("@e")[0]
    split, _, example = prompt.rpartition("-")
    if split not in SPLITS or not example.lstrip("-").isdigit():
        raise RunnerError(f"group id {group_id!r} names no dataset row (expected <split>-<example_id>@e<epoch>)")
    return split, int(example)


def find_row(env: Any, group_id: str) -> dict[str, Any]:
    split, example_id = example_of(group_id)
    dataset = getattr(env, SPLITS[split])()
    index = dataset["example_id"].index(example_id) if example_id in dataset["example_id"] else None
    if index is None:
        raise RunnerError(f"{split} split has no example_id {example_id} (group {group_id!r})")
    return dict(dataset[index])


def rollout_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The `metrics` of verifiers' RolloutOutput (each reward function's score by its name, and what the
    environment adds) as the gateway's metrics file takes them: names lowercased to `[a-z0-9_]`, finite
    numbers only, the first `MAX_METRICS`."""
    out: dict[str, float] = {}
    for name, value in (result.get("metrics") or {}).items():
        key = re.sub(r"[^a-z0-9]+", "_", str(name).lower()).strip("_")[:48]
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if key and number and len(out) < MAX_METRICS:
            out[key] = float(value)
    return out


async def rollout(spec: dict[str, Any], output: Path | None) -> tuple[float, dict[str, float]]:
    """Play and score the sample in STREAMRL_SAMPLE against the session; returns its reward and metrics."""
    env = load_env(spec)
    from verifiers.types import ClientConfig  # pyrefly: ignore[missing-import]

    sample = json.loads(os.environ["STREAMRL_SAMPLE"])
    row = find_row(env, sample["group_id"])
    client = ClientConfig(
        api_base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY", max_retries=spec.get("max_retries", 2)
    )
    args = (client, spec.get("model", "policy"), dict(spec.get("sampling_args", {})))
    if env.requires_group_rollouts:
        (result,) = await env.run_group([row], *args)
    else:
        result = await env.run_rollout(row, *args)
    if output is not None:
        output.write_text(json.dumps(result, default=str))
    if result.get("error"):
        print(f"verifiers rollout error: {result['error']}", file=sys.stderr)
    return float(result["reward"]), rollout_metrics(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("dump", "rollout"))
    parser.add_argument("spec", help="the environment, as JSON")
    parser.add_argument("out_dir", nargs="?", help="dump: where the JSONL files go")
    parser.add_argument("--output", type=Path, help="rollout: also write verifiers' RolloutOutput here (JSON)")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    try:
        if args.command == "dump":
            if args.out_dir is None:
                parser.error("dump needs OUT_DIR")
            print(json.dumps(dump(spec, Path(args.out_dir))))
            return 0
        reward, metrics = asyncio.run(rollout(spec, args.output))
    except RunnerError as exc:
        print(f"streamrl verifiers runner: {exc}", file=sys.stderr)
        return 2
    Path(os.environ["STREAMRL_REWARD_FILE"]).write_text(f"{reward!r}\n")
    if METRICS_FILE_ENV in os.environ:
        Path(os.environ[METRICS_FILE_ENV]).write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
