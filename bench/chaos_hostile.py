"""The chaos bench's hostile-callback family: user code that misbehaves inside a real run
(`bench/hostile.py`), checked against the invariants and against what it must not do.

- `hostile`: a tiny run whose reward is NaN, inf or hangs for three tenths of the trajectories
  (`mixed_reward`, `rollout.agent.reward_timeout_s` = 2 s). The run must finish; each hostile reward
  is a FAILED trajectory (never a reward in the buffer), the final weights and every learner metric
  are finite, the one rollout worker is never replaced, and no log or console line carries a raw
  escape. Its calculator is `bench.hostile:calculator`, a function tool that hangs for some
  expressions and prints terminal escapes for others, but the tiny model calls tools only after an
  SFT warm-up too slow for a loaded 2-core machine (see HOSTILE_OVERRIDES), so the tool hostilities
  are unit-level (`tool_check`): the real `ToolRegistry` answers a hung call after
  `tool_timeout_s` and serves the next call at once; an escape-laden answer logged through an
  actor's log handler is escaped.
- `all_fail`: every reward is NaN: the run must stop with a clear error and a non-zero exit
  (`streaming/failures.py`), not walk through its prompts.
- the decompression bomb is unit-level too (`image_bomb_check`): the real tool executor and image store of
  a VLM worker, a function tool answering with a 36-megapixel PNG. A run of `configs/vlm_tiny.toml`
  cannot reach it: its random-weight VLM never calls a tool.
"""

from __future__ import annotations

import asyncio
import math
import re
import resource
from pathlib import Path

from bench.hostile import ESCAPE_MARKER, HANG_S, REWARD_BUCKETS
from streamrl.core.run_dir import RunDir

# No SFT warm-up: on a loaded 2-core machine (load average 60) it ran at 16 s a step, 30 min for the
# 120 steps that make the tiny model call its calculator; the tool hostilities are checked on the
# real tool executor instead (`tool_check`), and the run keeps the hostile tool configured.
HOSTILE_OVERRIDES = [
    "rollout.agent.reward_fn=bench.hostile:mixed_reward",
    "rollout.agent.reward_timeout_s=2",
    "rollout.agent.tool_timeout_s=2",
    "trainer.total_steps=6",  # ~5 s a step: more trajectories meet a hostile reward
]
ALL_FAIL_OVERRIDES = [
    "rollout.agent.reward_fn=bench.hostile:nan_reward",
    "trainer.failed_window=16",  # judged after 16 trajectories instead of 64
]
# The CLI prints it as "streamrl: error: the run stopped at ..." (streaming/failures.py, FailureWindow.message).
STOP_MESSAGE = re.compile(r"the run stopped at learner step \d+: (\d+) of the last \d+ trajectories failed[^\n]*")
_ESCAPED_MARKER = ESCAPE_MARKER.replace("\x1b", "\\x1b")  # what safe_text shows instead


def hostile_tools(root: Path, run_name: str) -> list[str]:
    """The override giving a run `bench.hostile:calculator` as its function tool named calculator."""
    path = root / f"{run_name}.tools.yaml"
    path.write_text("tools:\n  - function: bench.hostile:calculator\n    name: calculator\n")
    return [f"rollout.agent.tool_config={path}"]


def _failed_rows(run_dir: Path) -> int:
    """FAILED trajectories in the buffer log (their latest rows)."""
    from streamrl.buffer.cli import load_frame

    frame = load_frame(RunDir(run_dir).buffer)
    return int((frame["is_latest"] & (frame["status"] == "failed")).sum())


def _log_lines(run_dir: Path, needle: str) -> list[str]:
    """The lines of the run's process logs (every actor, every segment) that contain `needle`."""
    return [
        line
        for log in sorted(RunDir(run_dir).logs.glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if needle in line
    ]


def _finite_weights(run_dir: Path) -> tuple[str | None, int]:
    """(the newest checkpoint, number of non-finite weights in it)."""
    import torch
    from safetensors.torch import load_file

    checkpoints = RunDir(run_dir).checkpoint_folders()
    if not checkpoints:
        return None, -1
    bad = 0
    for shard in sorted(checkpoints[-1].path.rglob("*.safetensors")):
        bad += sum(int((~torch.isfinite(t.float())).sum()) for t in load_file(str(shard)).values())
    return checkpoints[-1].name, bad


def _learner_metrics(run_dir: Path) -> tuple[int, int]:
    """(learner metric values logged, how many of them are not finite)."""
    values = []
    for row in RunDir(run_dir).metric_records():
        values += [v for k, v in row.items() if k.startswith("learner/") and isinstance(v, (int, float))]
    return len(values), sum(not math.isfinite(v) for v in values)


def _max_metric(run_dir: Path, key: str) -> float:
    best = 0.0
    for row in RunDir(run_dir).metric_records():
        value = row.get(key)
        if isinstance(value, (int, float)):
            best = max(best, value)
    return best


def _escapes(paths: list[Path]) -> tuple[int, int]:
    """(raw escape payloads, escaped ones) in text files a terminal may show."""
    raw = escaped = 0
    for path in paths:
        text = path.read_text(errors="replace")
        raw += text.count(ESCAPE_MARKER)
        escaped += text.count(_ESCAPED_MARKER)
    return raw, escaped


def hostile_report(run_dir: Path, console_log: Path) -> dict:
    """What the hostile run's callbacks did, and whether the run kept them out of the weights.

    A failed trajectory's error is in its rollout worker's log ("trajectory T failed: ..."), not in
    its row; the hostile calculator logs each hang and each escape-laden answer it gives."""
    failures = _log_lines(run_dir, " failed: ")
    nan = sum("is nan" in line for line in failures)
    inf = sum("is inf" in line for line in failures)
    hung = sum("did not return within" in line for line in failures)
    # the hangs the reward function started (runs before that line existed: 0, a lower bound); every
    # reward call queued behind a hung one in the 4-thread reward pool times out too
    reward_hangs = len(_log_lines(run_dir, "hostile reward: hang"))
    tool_hangs = len(_log_lines(run_dir, "hostile calculator: hanging"))
    escape_outputs = len(_log_lines(run_dir, "hostile calculator output"))
    tool_timeouts = int(_max_metric(run_dir, "rollout/tools/num_timeouts"))  # cumulative per worker
    checkpoint, bad_weights = _finite_weights(run_dir)
    num_learner_values, bad_metrics = _learner_metrics(run_dir)
    raw, escaped = _escapes([*sorted(RunDir(run_dir).logs.glob("*.log")), console_log])
    return {
        "nan_rewards_failed": nan,
        "inf_rewards_failed": inf,
        "reward_timeouts_failed": hung,  # the hung calls and the calls queued behind them
        "reward_hangs_injected": reward_hangs,
        "failed_trajectories": _failed_rows(run_dir),  # every cause; >= the three above
        "tool_hangs": tool_hangs,  # calls that hung (the executor answers each after tool_timeout_s)
        "tool_timeouts": tool_timeouts,  # hung calls and any queued behind them in the tool's slots
        "escape_outputs": escape_outputs,  # answers carrying OSC 52 / CSI 2J / a retitle
        "raw_escapes_in_logs": raw,  # must be 0
        "escaped_escapes_in_logs": escaped,  # the same payloads, shown as text
        "checkpoint": checkpoint,
        "non_finite_weights": bad_weights,  # must be 0 (-1: no checkpoint)
        "learner_metric_values": num_learner_values,
        "non_finite_learner_metrics": bad_metrics,  # must be 0
        "learner_nonfinite_steps": int(_max_metric(run_dir, "learner/num_nonfinite_steps")),  # skipped steps: 0
        "rollout_worker_incarnations": len(list(RunDir(run_dir).logs.glob("RolloutWorkerActor-*.log"))),
        "hostile_callbacks": nan + inf + reward_hangs + tool_hangs + escape_outputs,
        "reward_buckets": REWARD_BUCKETS,
        "hang_s": HANG_S,
    }


def all_fail_report(rc: int | None, output: str, run_dir: Path | None = None) -> dict:
    """The all-fail run must stop on its own, non-zero, saying why; its NaN rewards are counted from
    the workers' logs (each failed trajectory's line), else from the stop message's window."""
    match = STOP_MESSAGE.search(output)
    nan = (sum("is nan" in line for line in _log_lines(run_dir, " failed: ")) if run_dir is not None else 0) or (
        int(match.group(1)) if match else 0
    )
    return {
        "rc": rc,
        "stopped_clearly": bool(match) and rc not in (0, None),
        "message": match.group(0)[:400] if match else None,
        "nan_rewards_failed": nan,
        "hostile_callbacks": nan,
    }


def image_bomb_check(tmp: Path) -> dict:
    """A function tool returning a 36-megapixel PNG (as bytes, a data URL and a file) to the real
    executor with a VLM worker's image store: each must be an error result, nothing stored, and the
    process must not grow by the 108 MB a decode would take."""
    from bench.hostile import bomb_png
    from streamrl.rollout.images import ImageStore
    from streamrl.tools.config import load_tool_config
    from streamrl.tools.types import ToolCall

    bomb_png()  # built before the baseline: its compression is not the executor's memory
    store = ImageStore(tmp / "images")
    registry = load_tool_config({"tools": [{"function": "bench.hostile:image_bomb", "name": "bomb"}]})
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = {}
    for form in ("bytes", "data_url", "path"):
        call = ToolCall(call_id=f"c-{form}", name="bomb", arguments={"form": form})
        (result,) = asyncio.run(registry.run_calls([call], {}, timeout_s=30, images=store))
        results[form] = {"is_error": result.is_error, "text": result.text[:240], "num_images": len(result.images)}
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024
    refused = sum(r["is_error"] and r["num_images"] == 0 for r in results.values())
    return {
        "bombs": len(results),
        "refused": refused,
        "images_stored": len(store),
        "peak_rss_growth_mb": round(grown_mb, 1),
        "results": results,
        "hostile_callbacks": len(results),
    }


def tool_check(num_calls: int = 3) -> dict:
    """The hostile calculator on the real tool executor: `num_calls` hanging calls time out (2 s) and
    a normal call right after each is answered (the registry stays healthy); `num_calls` escape-laden
    answers reach the observation as they are (the model may see any text), and the same text logged
    through `SafeFormatter` (console and actor log files) carries no control character."""
    import logging
    import time

    from bench import hostile
    from streamrl.observability.safe_text import SafeFormatter
    from streamrl.tools.config import load_tool_config
    from streamrl.tools.types import ToolCall

    registry = load_tool_config({"tools": [{"function": "bench.hostile:calculator", "name": "calculator"}]})
    by_bucket: dict[str, list[str]] = {"hang": [], "escapes": [], None: []}
    for i in range(1000):
        expression = f"{i} + 1"
        found = by_bucket[hostile.TOOL_BUCKETS.get(hostile.bucket(expression, 6))]
        if len(found) < num_calls:
            found.append(expression)

    def run(expression: str, timeout_s: float):
        call = ToolCall(call_id="c", name="calculator", arguments={"expression": expression})
        t0 = time.monotonic()
        (result,) = asyncio.run(registry.run_calls([call], {}, timeout_s=timeout_s))
        return result, time.monotonic() - t0

    timed_out = served_after = 0
    for hang, normal in zip(by_bucket["hang"], by_bucket[None]):
        result, _ = run(hang, 2.0)
        timed_out += result.is_error and "timed out" in result.text
        after, seconds = run(normal, 2.0)
        served_after += not after.is_error and seconds < 1.0
    escapes_shown = escapes_logged_clean = 0
    formatter = SafeFormatter("%(message)s")
    for expression in by_bucket["escapes"]:
        result, _ = run(expression, 2.0)
        escapes_shown += result.text.startswith(hostile.ESCAPES)
        record = logging.LogRecord("bench.hostile", logging.WARNING, __file__, 1, "tool said: %s", (result.text,), None)
        line = formatter.format(record)
        escapes_logged_clean += "\x1b" not in line and _ESCAPED_MARKER in line
    return {
        "level": "unit (real ToolRegistry, no run)",
        "hung_calls": len(by_bucket["hang"]),
        "timed_out": timed_out,
        "next_call_served_at_once": served_after,
        "escape_answers": len(by_bucket["escapes"]),
        "escapes_reached_the_observation": escapes_shown,
        "escapes_logged_escaped": escapes_logged_clean,
        "hostile_callbacks": len(by_bucket["hang"]) + len(by_bucket["escapes"]),
    }
