"""The prompt stream: a deterministic, resumable order over a dataset (`rollout.data`), and admission records.

`cursor` counts prompts handed out; it is the data position saved in every checkpoint. Trajectory ids
are deterministic (`<group>@e<epoch>/<sample>`), so admitting the same prompt twice after a crash is
detected by the buffer already holding its rows — admission is idempotent.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import TYPE_CHECKING

from streamrl.rollout.types import AgentData, PromptRecord

if TYPE_CHECKING:
    from streamrl.streaming.config import DataConfig


class PromptStream:
    def __init__(self, records: list[PromptRecord], *, seed: int, shuffle: bool, num_epochs: int, cursor: int = 0):
        if not records:
            raise ValueError("the dataset has no prompts")
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.cursor = cursor

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def peek(self) -> tuple[PromptRecord, int] | None:
        epoch, pos = divmod(self.cursor, len(self.records))
        if epoch >= self.num_epochs:
            return None
        return self.records[self._order(epoch)[pos]], epoch

    def advance(self) -> None:
        self.cursor += 1


def first_group_ids(data: DataConfig, cursor: int) -> list[str]:
    """The group ids of a run's first `cursor` prompts, in stream order (what admission handed out
    before its cursor reached `cursor`): the invariant checker's and the tests' expectation."""
    from streamrl.rollout.data import load_records

    records = load_records(data.source, data.num_prompts, data.seed, data.difficulty)
    stream = PromptStream(records, seed=data.seed, shuffle=data.shuffle, num_epochs=data.num_epochs)
    groups = []
    for _ in range(cursor):
        peeked = stream.peek()
        assert peeked is not None, f"cursor {cursor} is past the end of the prompt stream"
        record, epoch = peeked
        groups.append(group_id_for(record, epoch))
        stream.advance()
    return groups


def group_id_for(record: PromptRecord, epoch: int) -> str:
    return f"{record.group_id}@e{epoch}"


def parse_group_id(group_id: str) -> tuple[str, int] | None:
    """(the prompt's `PromptRecord.group_id`, the epoch) of a group id `group_id_for` made; None for
    any other form. The prompt's id is the same in every epoch: it names the prompt across the run."""
    prompt, sep, epoch = group_id.rpartition("@e")
    return (prompt, int(epoch)) if sep and prompt and epoch.isascii() and epoch.isdigit() else None


def make_group(record: PromptRecord, epoch: int, group_size: int, interaction: str | None) -> list[AgentData]:
    """The `group_size` AgentData (PENDING) of one prompt."""
    gid = group_id_for(record, epoch)
    now = time.time()
    return [
        AgentData(
            trajectory_id=f"{gid}/{i}",
            group_id=gid,
            sample_index=i,
            agent_name=record.agent_name or "",  # "": the worker runs the run's default_agent
            messages=[dict(m) for m in record.messages],
            tools_kwargs=dict(record.tools_kwargs),
            ground_truth=record.ground_truth,
            data_source=record.data_source,
            raw_ground_truth=record.raw_ground_truth,
            extra_info=dict(record.extra_info),
            interaction_name=interaction,
            request_id=uuid.uuid4().hex,
            created_at=now,
        )
        for i in range(group_size)
    ]
