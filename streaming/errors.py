"""Failures a person can act on: one sentence instead of a Ray traceback.

`StreamRLError` carries a complete message (the CLI prints it without a traceback). `explain_failure`
turns a run stopped by a `StreamRLError` (non-finite learner steps, too many failed trajectories) into
its own message, and a part killed for memory — Ray's memory monitor (`ray.exceptions.OutOfMemoryError`,
or an actor error whose message says the node ran low on memory), wrapped however deep by the driver's
`RuntimeError("learner loop failed") from ...` — into the sentence `streamrl train` ends with: which
part, its peak when Ray reported it, the knobs that shrink it and the exact resume command.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


class StreamRLError(RuntimeError):
    """A failure whose message is complete and user-facing (no traceback needed)."""


class NonFiniteTrainingError(StreamRLError):
    """`learner.max_nonfinite_steps` learner steps in a row were skipped for a non-finite loss or
    gradient norm (their weights never changed, so nothing non-finite was published or saved)."""


def check_nonfinite_steps(num_in_row: int, max_in_row: int, learner_step: int) -> None:
    """Raise `NonFiniteTrainingError` once `num_in_row` skipped steps reach `max_in_row`."""
    if num_in_row == 0:
        return
    logger.warning(
        "learner step %d was skipped: non-finite loss or gradient norm (%d in a row)", learner_step, num_in_row
    )
    if num_in_row >= max_in_row:
        raise NonFiniteTrainingError(
            f"the run stopped at learner step {learner_step}: {num_in_row} learner steps in a row had a non-finite "
            "loss or gradient norm (their updates were skipped; the weights and checkpoints are finite). Look for "
            "NaN/inf rewards (failed trajectories say so in RUN_DIR/logs) or lower learner.lr; "
            "learner.max_nonfinite_steps sets this limit"
        )


# Ray actor class -> (what a person calls it, the knobs that shrink it).
PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "EngineActor": ("the inference engine", ("rollout.engine.kv_cache_space_gb", "rollout.num_engines")),
    "LearnerActor": (
        "the learner",
        ("learner.micro_batch_tokens", "learner.logits_chunk_tokens", "learner.gradient_checkpointing=true"),
    ),
    "LearnerWorker": (
        "a learner rank",
        ("learner.micro_batch_tokens", "learner.logits_chunk_tokens", "learner.gradient_checkpointing=true"),
    ),
    "RolloutWorkerActor": ("a rollout worker", ("rollout.max_concurrent_per_worker",)),
    "BufferActor": ("the replay buffer", ("buffer.capacity_rows", "buffer.batch_size")),
}
_MEMORY = re.compile(r"low on memory|out of memory|outofmemory|memory pressure", re.IGNORECASE)
# Each worker Ray's memory monitor killed: "(task name=EngineActor.__init__, required resources={...},
# pid=27063, actual memory used=3.95GB" (Ray >= 2.55, several per kill) or "name=f, pid=1, memory used=1.2GB".
_VICTIM = re.compile(r"\bname=(\w+)[^()]*?\bpid=(\d+), (?:actual )?memory used=([\d.]+\s*GB)")
_DIED = re.compile(r"class_name:\s*(\w+)(?:.*?\n\s*pid:\s*(\d+))?", re.DOTALL)  # ActorDiedError's header
_NODE = re.compile(r"was ([\d.]+GB)(?: used)? / ([\d.]+GB)")


def join_or(items: list[str] | tuple[str, ...]) -> str:
    """`a`, `a or b`, `a, b or c`."""
    return " or ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else list(items))


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, Ray's wrapped remote causes and exception-group members."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]  # RayTaskError.cause: the remote error
        stack += list(getattr(e, "exceptions", ()))  # ExceptionGroup
        stack = [s for s in stack if isinstance(s, BaseException)]


def _killed_for_memory(e: BaseException) -> bool:
    try:
        from ray.exceptions import OutOfMemoryError, RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(e, OutOfMemoryError) or (isinstance(e, RayActorError) and bool(_MEMORY.search(str(e))))


def _victims(text: str) -> list[tuple[str | None, str | None, str | None]]:
    """(actor class, pid, memory used) of each killed worker the message names, largest first."""
    found = [(m.group(1), m.group(2), m.group(3)) for m in _VICTIM.finditer(text)]
    if found:
        return sorted(found, key=lambda v: -float(v[2].removesuffix("GB")))
    died = _DIED.search(text)
    return [(died.group(1), died.group(2), None)] if died else [(None, None, None)]


def explain_failure(exc: BaseException, run_dir: str | Path) -> str | None:
    """One sentence for a part killed for memory, for every engine gone, or for a `StreamRLError` (too
    many non-finite learner steps or failed trajectories), anywhere in `exc`'s chain; None for
    anything else."""
    from streamrl.engines.base import NoHealthyEngineError

    resume = f"continue the run with: streamrl train --resume {shlex.quote(str(run_dir))}"
    if complete := next((e for e in exception_chain(exc) if isinstance(e, StreamRLError)), None):
        return str(complete)  # its message says it all (non-finite steps, failed trajectories, ...)
    if gone := next((e for e in exception_chain(exc) if isinstance(e, NoHealthyEngineError)), None):
        reason = str(gone).strip().splitlines()[-1]
        return f"the run stopped because no inference engine is left ({reason}); see {run_dir}/logs, then {resume}"
    killed = next((e for e in exception_chain(exc) if _killed_for_memory(e)), None)
    if killed is None:
        return None
    text = str(killed)
    victims = _victims(text)
    names, knobs = [], []
    for cls, pid, used in victims:
        name, part_knobs = PARTS.get(cls or "", ("a part of the run", ()))
        details = ", ".join(x for x in (cls, f"pid {pid}" if pid else None, f"peak {used}" if used else None) if x)
        names.append(f"{name} ({details})" if details else name)
        knobs += [k for k in part_knobs if k not in knobs]
    node = _NODE.search(text)
    fix = (
        f"shrink it with {join_or(knobs[:4])} (`streamrl train --dry-run` shows the memory estimate), then "
        if knobs
        else ""
    )
    return (
        f"{' and '.join(names)} {'was' if len(names) == 1 else 'were'} killed for lack of memory"
        + (f" with the node at {node.group(1)} of {node.group(2)}" if node else "")
        + f"; {fix}{resume}"
    )
