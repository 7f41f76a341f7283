"""Every state a power loss could leave after a recorded workload (`bench.crashsim_record`), ALICE /
CrashMonkey style: replay the trace, and at each crash point build the trees the disk may hold.

The persistence model is POSIX's pessimistic one, with no file-system-specific ordering:

- what an fsync made durable stays: a file's data (fsync of the file), a folder's entries (fsync of
  the folder);
- a file's writes and truncations since its last fsync may each be on disk or not (any subset,
  applied in issue order); one of them may be torn: a prefix of its bytes, or zeros where the data
  should be (the size was updated, the data never written). A write past the end of a file whose
  earlier writes were lost leaves a hole of zeros;
- a folder's entry changes since its last fsync (create, mkdir, unlink, rename) may each be on disk or
  not; a rename within one folder is atomic, a rename across folders is an unlink and a link that
  persist independently. A file whose entry is not on disk is lost, whatever was fsynced of it.

A crash after the first `t` operations may leave any such combination of the operations pending at
`t`. `crash_states` builds, at every `t`: the tree with nothing pending ("power loss"), the one with
everything ("process kill": the page cache survives), every combination when at most
`exhaustive_up_to` operations are pending, else prefixes in issue order and seeded random subsets,
plus torn variants. Identical trees are checked once: a `CrashState` lists every crash point it
stands for, and a checker must accept it at each of them.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from bench.crashsim_record import Op, OpKind, Trace

Tree = dict[str, bytes | None]  # relative path -> file bytes, None for a folder


@dataclass(frozen=True, kw_only=True, slots=True)
class CrashPoint:
    at: int  # operations done before the crash
    process_kill: bool  # every pending operation reached the disk, none torn (the OS survived)
    label: str  # how the pending operations were chosen


@dataclass(kw_only=True, slots=True)
class CrashState:
    tree: Tree
    points: list[CrashPoint] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Tear:
    seq: int  # the torn write
    keep: int  # bytes of it that reach the disk
    zeros: bool  # the rest (or all, with keep 0) reads as zeros instead of being absent


@dataclass(kw_only=True, slots=True)
class _File:
    durable: bytes = b""
    pending: list[tuple[int, Op]] = field(default_factory=list)  # (seq, WRITE or TRUNCATE)


@dataclass(kw_only=True, slots=True)
class _Dir:
    durable: dict[str, int] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=dict)
    pending: list[tuple[int, tuple]] = field(
        default_factory=list
    )  # (seq, ("link", name, ino) | ("unlink", name) | ("move", a, b))


def _apply_data(data: bytes, ops: list[tuple[int, Op]], tear: _Tear | None = None) -> bytes:
    if not ops:
        return data
    out = bytearray(data)
    for seq, op in ops:
        if op.kind is OpKind.TRUNCATE:
            del out[op.size :]
            out.extend(bytes(op.size - len(out)))
            continue
        chunk = op.data
        if tear is not None and tear.seq == seq:
            chunk = chunk[: tear.keep] + (bytes(len(chunk) - tear.keep) if tear.zeros else b"")
        if op.offset > len(out):
            out.extend(bytes(op.offset - len(out)))
        out[op.offset : op.offset + len(chunk)] = chunk
    return bytes(out)


def _apply_entries(entries: dict[str, int], changes: list[tuple]) -> dict[str, int]:
    out = dict(entries)
    for change in changes:
        if change[0] == "link":
            out[change[1]] = change[2]
        elif change[0] == "unlink":
            out.pop(change[1], None)
        elif change[1] in out:  # a move whose source entry is on disk
            out[change[2]] = out.pop(change[1])
    return out


class FsModel:
    """The trace replayed operation by operation: what is durable, what is pending."""

    def __init__(self, trace: Trace) -> None:
        self.root = trace.root_ino
        self.dirs: dict[int, _Dir] = {self.root: _Dir()}
        self.files: dict[int, _File] = {}
        self.seq = 0
        for path, (ino, data) in sorted(trace.initial.items()):
            parent, name = self._locate(path)
            if data is None:
                self.dirs[ino] = _Dir()
            else:
                self.files[ino] = _File(durable=data)
            self.dirs[parent].current[name] = self.dirs[parent].durable[name] = ino

    def _locate(self, path: str) -> tuple[int, str]:
        *parents, name = path.split("/")
        ino = self.root
        for part in parents:
            ino = self.dirs[ino].current[part]
        return ino, name

    def _entry(self, parent: int, change: tuple) -> None:
        d = self.dirs[parent]
        d.current = _apply_entries(d.current, [change])
        d.pending.append((self.seq, change))

    def apply(self, op: Op) -> None:
        self.seq += 1
        if op.kind in (OpKind.CREATE, OpKind.MKDIR):
            if op.kind is OpKind.CREATE:
                self.files[op.ino] = _File()
            else:
                self.dirs[op.ino] = _Dir()
            parent, name = self._locate(op.path)
            self._entry(parent, ("link", name, op.ino))
        elif op.kind in (OpKind.WRITE, OpKind.TRUNCATE):
            self.files[op.ino].pending.append((self.seq, op))
        elif op.kind is OpKind.FSYNC:
            if op.ino in self.files:
                f = self.files[op.ino]
                f.durable, f.pending = _apply_data(f.durable, f.pending), []
            else:
                d = self.dirs[op.ino]
                d.durable, d.pending = dict(d.current), []
        elif op.kind is OpKind.UNLINK:
            parent, name = self._locate(op.path)
            self._entry(parent, ("unlink", name))
        elif op.kind is OpKind.RENAME:
            (p1, a), (p2, b) = self._locate(op.path), self._locate(op.dest)
            if p1 == p2:
                self._entry(p1, ("move", a, b))
            else:
                ino = self.dirs[p1].current[a]
                self._entry(p1, ("unlink", a))
                self._entry(p2, ("link", b, ino))

    def pending(self) -> list[tuple[int, OpKind | str]]:
        """(seq, kind) of every pending operation, in issue order (kind "entry" for folder changes)."""
        units = [(seq, op.kind) for f in self.files.values() for seq, op in f.pending]
        units += [(seq, "entry") for d in self.dirs.values() for seq, _ in d.pending]
        return sorted(units)

    def tree(self, chosen: set[int], tear: _Tear | None = None) -> Tree:
        """The tree on disk if exactly the pending operations `chosen` (by seq) reached it."""
        out: Tree = {}
        stack = [("", self.root)]
        seen = set()
        while stack:
            path, ino = stack.pop()
            if ino in seen:  # a folder linked twice by a half-persisted cross-folder rename
                continue
            seen.add(ino)
            d = self.dirs[ino]
            entries = _apply_entries(d.durable, [c for s, c in d.pending if s in chosen])
            for name, child in entries.items():
                full = f"{path}/{name}" if path else name
                if child in self.dirs:
                    out[full] = None
                    stack.append((full, child))
                else:
                    f = self.files[child]
                    out[full] = _apply_data(f.durable, [(s, op) for s, op in f.pending if s in chosen], tear)
        return out


def _subsets(
    units: list[tuple[int, OpKind | str]],
    rng: random.Random,
    *,
    exhaustive_up_to: int,
    num_random: int,
    num_torn: int,
    writes: dict[int, int],
) -> list[tuple[str, set[int], _Tear | None]]:
    seqs = [s for s, _ in units]
    out: list[tuple[str, set[int], _Tear | None]] = [("power loss", set(), None), ("process kill", set(seqs), None)]
    if len(seqs) <= exhaustive_up_to:
        for k in range(1, len(seqs)):
            out += [("subset", set(c), None) for c in itertools.combinations(seqs, k)]
    else:
        for k in sorted({round(i * len(seqs) / 7) for i in range(1, 7)} - {0, len(seqs)}):
            out.append((f"prefix {k}/{len(seqs)}", set(seqs[:k]), None))
        for _ in range(num_random):
            out.append(("random subset", {s for s in seqs if rng.random() < 0.5}, None))
    torn = [s for s, kind in units if kind is OpKind.WRITE and writes[s] > 1]
    for seq in rng.sample(torn, min(num_torn, len(torn))):
        tear = _Tear(seq=seq, keep=rng.randrange(writes[seq]), zeros=rng.random() < 0.5)
        before = {s for s in seqs if s < seq}
        out.append(("torn write, earlier ones kept", before | {seq}, tear))
        out.append(("torn write, random others", {s for s in before if rng.random() < 0.5} | {seq}, tear))
    return out


def _digest(tree: Tree) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for path, data in sorted(tree.items()):
        h.update(path.encode() + b"\0" + (b"D" if data is None else b"F" + len(data).to_bytes(8, "little") + data))
    return h.digest()


def crash_states(
    trace: Trace, *, max_states: int, seed: int = 0, exhaustive_up_to: int = 4, num_random: int = 6, num_torn: int = 2
) -> tuple[list[CrashState], int]:
    """(distinct crash states, at most `max_states`; the number of distinct states found). Every
    "power loss" state is kept; the rest are a seeded sample."""
    rng = random.Random(seed)
    model = FsModel(trace)
    writes: dict[int, int] = {}
    found: dict[bytes, CrashState] = {}
    interned: dict[bytes, bytes] = {}
    for at in range(len(trace.ops) + 1):
        if at:
            model.apply(trace.ops[at - 1])
            if trace.ops[at - 1].kind is OpKind.WRITE:
                writes[model.seq] = len(trace.ops[at - 1].data)
        units = model.pending()
        for label, chosen, tear in _subsets(
            units, rng, exhaustive_up_to=exhaustive_up_to, num_random=num_random, num_torn=num_torn, writes=writes
        ):
            tree = {p: d if d is None else interned.setdefault(d, d) for p, d in model.tree(chosen, tear).items()}
            state = found.setdefault(_digest(tree), CrashState(tree=tree))
            state.points.append(CrashPoint(at=at, process_kill=label == "process kill", label=label))
    states = list(found.values())
    keep = [s for s in states if any(p.label == "power loss" for p in s.points)]
    rest = [s for s in states if not any(p.label == "power loss" for p in s.points)]
    rng.shuffle(rest)
    return keep + rest[: max(max_states - len(keep), 0)], len(states)


def write_tree(root: Path, tree: Tree) -> None:
    """Make `root` hold exactly `tree` (what is there is removed first)."""
    root.mkdir(parents=True, exist_ok=True)
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    for path, data in sorted(tree.items()):
        full = root / path
        if data is None:
            full.mkdir()
        else:
            full.write_bytes(data)
