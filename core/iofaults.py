"""Seeded I/O fault injection: ENOSPC, EIO, torn and short writes, failing fsync, on the buffer's logs,
the learner's checkpoints and the run files.

Every write that must survive a crash goes through one `PlainIO` object: by default it calls
`os.write` / `os.fsync`; a `FaultPlan` does the same except at the calls it was told to break, or
that it draws from its seed. Each call names its target (`log`):

- `traj`, `consumed`, `images`: the buffer's logs (every `SegmentWriter`, `buffer/log.py`);
- `ckpt/<file>`: a learner checkpoint's files, by path inside the checkpoint (`ckpt/optimizer.pt`,
  `ckpt/scheduler.pt`, `ckpt/rng.pt`, `ckpt/value_head.pt`, `ckpt/state.json`, the seal
  `ckpt/SEALED.json`; the HF weights, config and tokenizer `ckpt/hf/...`, written by the
  safetensors/transformers writers, reach the plan at the seal's fsync of each file, not per write);
- `run/<file name>`: every `core.atomic.atomic_write` (`run/driver_state.json`, `run/run_info.json`,
  `run/accounting.json`, `run/placement.json`, the buffer's manifest, held-out results, ...).

A `logs` filter names targets or their prefix (`ckpt` is every checkpoint file, `run` every run file).
What each writer does with a fault is its module's business: the buffer log fails for good
(`buffer/log.py`); a checkpoint is never sealed and the run stops (`learner/checkpoint.py`,
`core/atomic.py`); a run file keeps its previous content and the write raises
`core.atomic.WriteFailedError`, which stops the run (`streaming/checkpoints.py`).

Tests install a plan for a block (`with install(plan): ...`); the chaos bench arms one per process
through the environment, read by the first write that needs it:

    STREAMRL_IO_FAULTS="seed=7,rate=0.02,kinds=torn+eio+fsync_eio,logs=traj+consumed+ckpt,max=1"

(`rate`: chance that a write or fsync call breaks; `kinds`, `logs`: which faults, on which targets,
all when omitted; `max`: faults per process, default 1) or, for an exact point,
`STREAMRL_IO_FAULTS="at=traj:write:12:torn"` (the 13th write call on a `traj` log tears;
`at=ckpt/SEALED.json:write:0:torn` tears this process's first checkpoint seal,
`at=run/driver_state.json:fsync:3:fsync_eio` fails the 4th fsync of the driver state).
A plan counts write and fsync calls per target, so a point names the same call in every run of the
same workload. Each injected fault is logged as a warning and kept in `FaultPlan.injected`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

logger = logging.getLogger(__name__)

ENV = "STREAMRL_IO_FAULTS"


class FaultKind(StrEnum):
    ENOSPC = "enospc"  # the write raises ENOSPC having written nothing
    EIO = "eio"  # the write raises EIO having written nothing
    TORN = "torn"  # `nbytes` of the data reach the file, then ENOSPC (a short write whose retry failed)
    SHORT = "short"  # the write returns after `nbytes` bytes: legal, the caller must write the rest
    FSYNC_EIO = "fsync_eio"  # fsync raises EIO (the kernel may have dropped the dirty pages: fsyncgate)

    @property
    def op(self) -> str:
        return "fsync" if self is FaultKind.FSYNC_EIO else "write"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """Break call number `at` (0-based, counted per target and per op) of `kind.op` on target `log`."""

    kind: FaultKind
    at: int
    log: str = "traj"
    nbytes: int = 100  # TORN / SHORT: bytes that reach the file (fewer if the data is shorter)


class PlainIO:
    """`os.write` / `os.fsync`; `log` (the target: module doc) only matters to a `FaultPlan`."""

    def write(self, fd: int, data: memoryview, *, log: str) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int, *, log: str) -> None:
        os.fsync(fd)


class FaultPlan(PlainIO):
    """Breaks the calls listed in `faults` and, with `rate` > 0, calls drawn from `seed` (at most
    `max_faults` random ones). Thread-safe: the trajectory log writes from its own thread."""

    def __init__(
        self,
        faults: tuple[Fault, ...] = (),
        *,
        seed: int = 0,
        rate: float = 0.0,
        kinds: tuple[FaultKind, ...] = tuple(FaultKind),
        logs: tuple[str, ...] | None = None,
        max_faults: int = 1,
    ) -> None:
        self.faults = {(f.log, f.kind.op, f.at): f for f in faults}
        self.rate, self.kinds, self.logs, self.max_faults = rate, kinds, logs, max_faults
        self._rng = np.random.default_rng(seed)
        self.calls: Counter[tuple[str, str]] = Counter()  # (log, op) -> calls so far
        self._lock = threading.Lock()
        self.injected: list[str] = []  # "<log> <op> #<call> <kind>" of every fault injected

    def _draw(self, log: str, op: str) -> Fault | None:
        with self._lock:
            n = self.calls[log, op]
            self.calls[log, op] += 1
            fault = self.faults.get((log, op, n))
            if fault is None and self.rate and len(self.injected) < self.max_faults and selected(log, self.logs):
                kinds = [k for k in self.kinds if k.op == op]
                if kinds and self._rng.random() < self.rate:
                    fault = Fault(
                        kind=kinds[int(self._rng.integers(len(kinds)))],
                        at=n,
                        log=log,
                        nbytes=int(self._rng.integers(1, 200)),
                    )
            if fault is not None:
                self.injected.append(f"{log} {op} #{n} {fault.kind.value}")
                logger.warning("I/O fault injected: %s call #%d on log %s: %s", op, n, log, fault.kind.value)
            return fault

    def write(self, fd: int, data: memoryview, *, log: str) -> int:
        fault = self._draw(log, "write")
        if fault is None:
            return os.write(fd, data)
        if fault.kind in (FaultKind.ENOSPC, FaultKind.EIO):
            code = errno.ENOSPC if fault.kind is FaultKind.ENOSPC else errno.EIO
            raise OSError(code, f"{os.strerror(code)} (injected)")
        if fault.kind is FaultKind.SHORT:
            return os.write(fd, data[: max(1, min(fault.nbytes, len(data) - 1))])
        written = os.write(fd, data[: min(fault.nbytes, len(data) - 1)]) if len(data) > 1 else 0
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected after {written} bytes)")

    def fsync(self, fd: int, *, log: str) -> None:
        if self._draw(log, "fsync") is not None:
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected fsync failure)")
        os.fsync(fd)


def selected(log: str, logs: tuple[str, ...] | None) -> bool:
    """Whether the target `log` is one of `logs` or under one of them (`ckpt` covers `ckpt/rng.pt`)."""
    return logs is None or any(log == name or log.startswith(f"{name}/") for name in logs)


def write_all(io: PlainIO, fd: int, data: bytes | bytearray | memoryview, *, log: str) -> int:
    """Write all of `data` through `io`, finishing short writes; returns its length."""
    view = memoryview(data).cast("B")
    total = len(view)
    while len(view):
        view = view[io.write(fd, view, log=log) :]
    return total


PLAIN_IO = PlainIO()
_installed: PlainIO | None = None
_from_env: PlainIO | None = None


def parse(spec: str) -> FaultPlan:
    """A plan from the `STREAMRL_IO_FAULTS` syntax (see the module docstring); ValueError if malformed."""
    opts: dict[str, str] = {}
    faults: list[Fault] = []
    try:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = item.partition("=")
            if key == "at":
                log, op, n, kind = value.split(":")
                fault = Fault(kind=FaultKind(kind), at=int(n), log=log)
                if fault.kind.op != op:
                    raise ValueError(f"{kind} is not a {op} fault")
                faults.append(fault)
            elif key in ("seed", "rate", "kinds", "logs", "max"):
                opts[key] = value
            else:
                raise ValueError(f"unknown key {key!r}")
        return FaultPlan(
            tuple(faults),
            seed=int(opts.get("seed", 0)),
            rate=float(opts.get("rate", 0.0)),
            kinds=tuple(FaultKind(k) for k in opts["kinds"].split("+")) if "kinds" in opts else tuple(FaultKind),
            logs=tuple(opts["logs"].split("+")) if "logs" in opts else None,
            max_faults=int(opts.get("max", 1)),
        )
    except ValueError as e:
        raise ValueError(
            f"bad {ENV}={spec!r} ({e}); e.g. 'seed=7,rate=0.02,kinds=torn+eio,logs=traj+ckpt,max=1' or "
            f"'at=traj:write:12:torn' or 'at=run/driver_state.json:write:3:eio'; kinds {[k.value for k in FaultKind]}"
        ) from None


def active() -> PlainIO:
    """The I/O a new log writer, checkpoint or run file uses: the installed plan, else the one `STREAMRL_IO_FAULTS` arms
    (parsed once per process), else plain `os` calls."""
    global _from_env
    if _installed is not None:
        return _installed
    spec = os.environ.get(ENV)
    if not spec:
        return PLAIN_IO
    if _from_env is None:
        _from_env = parse(spec)
        logger.warning("I/O faults armed: %s=%s", ENV, spec)
    return _from_env


@contextmanager
def install(plan: PlainIO) -> Iterator[PlainIO]:
    """Log writers opened inside the block use `plan` (for their whole life), and so do the
    checkpoint and run-file writes made inside it."""
    global _installed
    previous, _installed = _installed, plan
    try:
        yield plan
    finally:
        _installed = previous
