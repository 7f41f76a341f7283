"""Named fault-injection points for the chaos suite; inert unless `STREAMRL_FAULTS` is set.

A point is a line like `faults.hit("admit.after_append")` at a place where a crash or an error
matters for the invariants (docs/invariants.md, "The async invariants"). The environment variable arms some
of them, per process:

    STREAMRL_FAULTS="admit.after_append=kill_job@3,worker.sink=raise@2"

means: the 3rd time this process reaches `admit.after_append`, SIGKILL the whole job (the driver's
process group: the driver and its local Ray node, whose workers die with it; an actor reaches it
through `STREAMRL_FAULT_JOB_PGID`, since Ray starts each worker in a group of its own); the 2nd time it
reaches `worker.sink`, raise `FaultInjected`.
`raise%4` fires at every 4th pass instead of once. Actions: `kill_job`, `kill_self` (this process
only: an actor dies, Ray reports it dead; a replacement actor counts its own passes), `raise`, and
`delay<seconds>` (e.g. `buffer.append=delay5%3`: every 3rd append takes 5 s longer; a slow disk or a
busy buffer). Async code passes through `await ahit(point)`, which sleeps without blocking its loop.
Ray actors see the same variable (`streaming.train` forwards it), and the buffer log's I/O fault
plan, `STREAMRL_IO_FAULTS` (`core/iofaults.py`), which is read where the log is written: in the
buffer's actor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

logger = logging.getLogger(__name__)

ENV = "STREAMRL_FAULTS"
LEDGER_ENV = "STREAMRL_FAULT_LEDGER"
JOB_ENV = "STREAMRL_FAULT_JOB_PGID"  # the driver's process group, for a kill_job inside a Ray actor
IO_ENV = "STREAMRL_IO_FAULTS"  # core.iofaults.ENV (not imported: buffer imports this module)
# where a recording gateway client appends the answers it received (`workloads.answer_ledger`)
ANSWER_LEDGER_ENV = "STREAMRL_ANSWER_LEDGER"

POINTS = {
    "admit.after_append": "driver: a group's rows are durable, the cursor is not saved yet",
    "admit.before_submit": "driver: cursor saved, the group not yet handed to a worker",
    "learner.after_step": "driver: a learner step is done, its weights not yet published",
    "publish.after": "driver: weights published, the step not yet checkpointed or logged",
    "worker.sink": "rollout worker: appending a trajectory row to the buffer",
    "worker.after_sink": "rollout worker: a row was saved, the worker's bookkeeping not yet updated",
    "tool.before_run": "rollout worker: a tool call's intent is durable, the tool has not run",
    "tool.after_run": "rollout worker: a tool ran (its side effect happened), its result is not recorded yet",
    "engine.generate": "engine: a generation request arrives",
    "buffer.append": "buffer actor: rows arrive to be appended (before the room check)",
    "sync.pause": "engine: a weight-sync pause arrives (before the transfer)",
    "sync.commit": "engine: a weight-sync commit arrives (staged weights verified, not loaded yet)",
    "gateway.before_journal": "rollout worker: a gateway call was sampled; its answer is not journaled or durable",
    "gateway.before_answer": "rollout worker: a gateway call's fresh answer is journaled and durable, not yet sent",
}


class FaultInjected(RuntimeError):
    """Raised by a `raise` fault."""


_ACTION = re.compile(r"kill_job|kill_self|raise|delay\d+(\.\d+)?")


def _parse(spec: str) -> dict[str, tuple[str, int, bool]]:
    """point -> (action, pass number or period, periodic)."""
    armed: dict[str, tuple[str, int, bool]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, rest = item.partition("=")
        periodic = "%" in rest
        action, _, nth = rest.partition("%" if periodic else "@")
        if point not in POINTS or not _ACTION.fullmatch(action):
            raise ValueError(
                f"bad {ENV} entry {item!r}: points {sorted(POINTS)}, actions kill_job/kill_self/raise/delay<seconds>"
            )
        armed[point] = (action, int(nth or 1), periodic)
    return armed


_armed = _parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}


def hit(point: str) -> None:
    """Count one pass through `point`; fire its fault if this is the armed pass."""
    if seconds := _fire(point):
        time.sleep(seconds)


async def ahit(point: str) -> None:
    """`hit` for async code: a delay sleeps without blocking the event loop."""
    if seconds := _fire(point):
        await asyncio.sleep(seconds)


def _fire(point: str) -> float:
    """Count one pass; raise or kill if this is the armed pass; return a delay's seconds (else 0)."""
    if point not in _armed:
        return 0.0
    _hits[point] = _hits.get(point, 0) + 1
    action, nth, periodic = _armed[point]
    if _hits[point] % nth if periodic else _hits[point] != nth:
        return 0.0
    nth = _hits[point]
    logger.warning("fault injected at %s: %s (pass %d)", point, action, nth)
    ledger = os.environ.get(LEDGER_ENV)
    if ledger:  # one line per fired fault, written before it fires (the chaos runner counts them)
        with open(ledger, "a") as f:
            f.write(f"{point} {action} {nth} {os.getpid()}\n")
    if action == "raise":
        raise FaultInjected(point)
    if action.startswith("delay"):
        return float(action.removeprefix("delay"))
    for handler in logging.getLogger().handlers:
        handler.flush()
    if action == "kill_job":
        os.killpg(int(os.environ.get(JOB_ENV) or os.getpgrp()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: this process was sent SIGKILL")


def forwarded_env() -> dict[str, str]:
    """The variables for Ray actors' runtime_env: the armed fault points (with the ledger and the
    job's process group), the buffer log's I/O fault plan and the gateway answer ledger; empty when
    none is set."""
    env = {k: os.environ[k] for k in (IO_ENV, ANSWER_LEDGER_ENV) if os.environ.get(k)}
    if not os.environ.get(ENV):
        return env
    env |= {k: os.environ[k] for k in (ENV, LEDGER_ENV) if os.environ.get(k)}
    return {**env, JOB_ENV: os.environ.get(JOB_ENV) or str(os.getpgrp())}
