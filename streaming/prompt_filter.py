"""Online difficulty filtering: keep the generation budget on prompts that can still teach.

A GRPO group whose samples all pass (or all fail) has no reward spread, so its advantages are 0 and
the DAPO filter (`buffer.filter_uniform_reward_groups`) drops it after it was generated. This module
acts one step earlier, at admission, as prime-rl's and AReaL's online difficulty filtering do: it
keeps each prompt's recent pass rate and decides, before the prompt's next appearance, whether to
admit it.

    recent pass rate >= easy_pass_rate   easy: admitted with easy_admit_probability (0: retired)
    recent pass rate <= hard_pass_rate   hard: admitted with hard_admit_probability (1: kept)
    otherwise, or fewer than min_appearances settled appearances: admitted

An appearance is the prompt's group of one epoch. The recent pass rate is the share of passing
samples (reward >= pass_threshold) over the prompt's newest `window` settled appearances; failed
samples are left out. The record has one source, the buffer's settled groups
(`ReplayBuffer.settled_groups`). They are read incrementally while the run goes, and from the start
after a restart, when the recovered log settles every group again; so the record needs no file of
its own. A probability's coin is drawn from (data.seed, prompt, epoch) alone, so one appearance gets
the same answer in any process.

Admission (`Pipeline.admit_next_group`) asks `next_prompt`, which moves the stream's cursor past the
prompts it skips and counts them in the driver state; the driver saves both in one write. A crash
before that write repeats the decisions, so a prompt is never skipped uncounted or admitted twice
(I1). While every prompt is retired nothing is admitted. Once nothing is in flight either, no outcome
can bring a prompt back, and the prompts count as exhausted: the run ends as when its stream runs out.

In sync mode every earlier group has settled when a round is admitted, so decisions repeat exactly
from run to run. In async mode a decision sees the groups settled when it is made; a prompt's
previous group may still be running.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.streaming.prompts import group_id_for, parse_group_id

if TYPE_CHECKING:
    from streamrl.buffer.types import SettledGroups
    from streamrl.rollout.types import PromptRecord
    from streamrl.streaming.actors.clients import BufferClient
    from streamrl.streaming.driver_state import DriverState
    from streamrl.streaming.prompts import PromptStream

logger = logging.getLogger(__name__)


class Difficulty(StrEnum):
    EASY = "easy"  # recent pass rate >= easy_pass_rate
    HARD = "hard"  # recent pass rate <= hard_pass_rate


class PromptFilterConfig(BaseModel):
    """`[data.prompt_filter]`: which appearances of a prompt are admitted, from its recent pass rate
    (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    pass_threshold: float = Field(1.0, allow_inf_nan=False)  # a sample passes when its reward >= this
    window: int = Field(4, gt=0)  # a prompt's newest settled appearances (epochs) that count
    min_appearances: int = Field(2, gt=0)  # with fewer settled appearances a prompt is always admitted
    easy_pass_rate: float = Field(1.0, ge=0.0, le=1.0)  # recent pass rate >= this: easy
    hard_pass_rate: float = Field(0.0, ge=0.0, le=1.0)  # recent pass rate <= this: hard
    easy_admit_probability: float = Field(0.0, ge=0.0, le=1.0)  # 0: an easy prompt is retired
    hard_admit_probability: float = Field(1.0, ge=0.0, le=1.0)  # 1: a hard prompt is kept

    @model_validator(mode="after")
    def _check(self) -> PromptFilterConfig:
        if self.min_appearances > self.window:
            raise ValueError(
                f"data.prompt_filter.min_appearances={self.min_appearances} > window={self.window}: "
                "no prompt could ever have enough appearances to be judged"
            )
        if self.hard_pass_rate >= self.easy_pass_rate:
            raise ValueError(
                f"data.prompt_filter.hard_pass_rate={self.hard_pass_rate} >= easy_pass_rate={self.easy_pass_rate}: "
                "a pass rate would be both hard and easy; hard_pass_rate must be below easy_pass_rate"
            )
        return self

    def admit_probability(self, difficulty: Difficulty) -> float:
        return self.easy_admit_probability if difficulty is Difficulty.EASY else self.hard_admit_probability


@dataclass(frozen=True, kw_only=True, slots=True)
class Appearance:
    """One settled group of a prompt: its epoch and how many of its finished samples passed."""

    epoch: int
    num_passed: int
    num_samples: int  # finished samples, > 0


def pass_rate(appearances: Sequence[Appearance]) -> float:
    """Passing samples over all samples of `appearances` (not empty)."""
    return sum(a.num_passed for a in appearances) / sum(a.num_samples for a in appearances)


def classify(appearances: Sequence[Appearance], cfg: PromptFilterConfig) -> Difficulty | None:
    """A prompt's difficulty from its newest appearances; None: neither easy nor hard, or too few to tell."""
    if len(appearances) < cfg.min_appearances:
        return None
    rate = pass_rate(appearances)
    if rate >= cfg.easy_pass_rate:
        return Difficulty.EASY
    if rate <= cfg.hard_pass_rate:
        return Difficulty.HARD
    return None


def admit_draw(seed: int, prompt: str, epoch: int) -> float:
    """A number in [0, 1) fixed by (seed, prompt, epoch) alone (not Python's salted `hash`): the coin
    of one appearance is the same after any restart, in any process."""
    digest = hashlib.blake2b(f"{seed}/{prompt}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class PromptFilter:
    """The run's one holder of each prompt's recent pass rate, and the admission decision made from it."""

    def __init__(self, cfg: PromptFilterConfig, *, prompts: list[str], seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        self.prompts = frozenset(prompts)  # `PromptRecord.group_id` of every prompt of the dataset
        self.appearances: dict[str, list[Appearance]] = {}  # prompt -> its newest `window`, oldest first
        self.difficulty: dict[str, Difficulty] = {}  # the prompts that are easy or hard now
        self.counts: Counter[Difficulty] = Counter()  # prompts per difficulty (`difficulty`'s values)
        self.next_start = 0  # settled groups read from the buffer so far
        self.num_in_flight = 0  # the buffer's trajectories of open groups at the last read
        self._told_all_retired = False

    @classmethod
    def for_run(cls, cfg: PromptFilterConfig, records: list[PromptRecord], *, seed: int) -> PromptFilter | None:
        """The filter of a run over `records`; None when `cfg.enabled` is off."""
        return cls(cfg, prompts=[r.group_id for r in records], seed=seed) if cfg.enabled else None

    # ---- the record ---------------------------------------------------------------------------

    def observe(self, settled: SettledGroups) -> None:
        """Take in the outcomes of newly settled groups. A group of another id form, of a prompt outside
        the dataset, or without a finished sample says nothing about a prompt and is passed over."""
        for outcome in settled.outcomes:
            parsed = parse_group_id(outcome.group_id)
            if parsed is None or parsed[0] not in self.prompts or not outcome.rewards:
                continue
            prompt, epoch = parsed
            num_passed = sum(r >= self.cfg.pass_threshold for r in outcome.rewards)
            self._add(prompt, Appearance(epoch=epoch, num_passed=num_passed, num_samples=len(outcome.rewards)))
        self.next_start = settled.next_start
        self.num_in_flight = settled.num_in_flight

    def _add(self, prompt: str, appearance: Appearance) -> None:
        """Keep the newest `window` appearances by epoch (an older one arriving late drops out first)."""
        kept = self.appearances.setdefault(prompt, [])
        kept.append(appearance)
        kept.sort(key=lambda a: a.epoch)
        del kept[: -self.cfg.window]
        before, now = self.difficulty.pop(prompt, None), classify(kept, self.cfg)
        if before is not None:
            self.counts[before] -= 1
        if now is not None:
            self.difficulty[prompt] = now
            self.counts[now] += 1

    @property
    def num_retired(self) -> int:
        """Prompts never admitted while they stay as they are: of a difficulty admitted with probability 0."""
        return sum(n for d, n in self.counts.items() if self.cfg.admit_probability(d) == 0.0)

    @property
    def all_retired(self) -> bool:
        return self.num_retired == len(self.prompts)

    @property
    def exhausted(self) -> bool:
        """Every prompt is retired and nothing was in flight at the last read: no outcome still to come
        can bring a prompt back, so nothing will ever be admitted again."""
        return self.all_retired and self.num_in_flight == 0

    # ---- the decision -------------------------------------------------------------------------

    def skips(self, prompt: str, epoch: int) -> Difficulty | None:
        """The difficulty for which this appearance of `prompt` is not admitted; None: admit it."""
        difficulty = self.difficulty.get(prompt)
        if difficulty is None or admit_draw(self.seed, prompt, epoch) < self.cfg.admit_probability(difficulty):
            return None
        return difficulty

    async def next_prompt(
        self, stream: PromptStream, buffer: BufferClient, state: DriverState
    ) -> tuple[PromptRecord, int] | None:
        """The stream's next prompt to admit, decided on every group settled so far. The prompts before
        it that this filter skips are passed (the stream's cursor moves) and counted in `state`; the
        caller saves the two together. None when the stream has ended, or while every prompt is
        retired (the cursor then stays)."""
        self.observe(await buffer.settled_groups(self.next_start))
        while not self.all_retired and (item := stream.peek()) is not None:
            record, epoch = item
            difficulty = self.skips(record.group_id, epoch)
            if difficulty is None or await buffer.has_group(group_id_for(record, epoch)):
                return item  # to admit, or admitted before a crash (admission finds its rows)
            if difficulty is Difficulty.EASY:
                state.num_prompts_skipped_easy += 1
            else:
                state.num_prompts_skipped_hard += 1
            stream.advance()
        if self.all_retired and not self._told_all_retired:
            self._told_all_retired = True
            logger.warning(
                "every one of the %d prompts is retired by data.prompt_filter (recent pass rate >= easy_pass_rate "
                "%s with easy_admit_probability 0, or <= hard_pass_rate %s with hard_admit_probability 0): nothing "
                "is admitted while that holds, and once nothing is in flight (%d trajectories now) the run ends "
                "as when its prompts run out",
                len(self.prompts),
                self.cfg.easy_pass_rate,
                self.cfg.hard_pass_rate,
                self.num_in_flight,
            )
        return None

    def metrics(self, state: DriverState) -> dict[str, float]:
        """`data/*`: the prompts easy, hard and retired now, and the appearances skipped so far."""
        return {
            "data/prompts_easy": float(self.counts[Difficulty.EASY]),
            "data/prompts_hard": float(self.counts[Difficulty.HARD]),
            "data/prompts_retired": float(self.num_retired),
            "data/prompts_skipped_easy": float(state.num_prompts_skipped_easy),
            "data/prompts_skipped_hard": float(state.num_prompts_skipped_hard),
        }


def unexplained_skips(missing: list[str], present: set[str], *, num_skipped: int, min_appearances: int) -> list[str]:
    """I1 with the filter on (`streaming.invariants`): of the groups `missing` among the first `cursor`
    prompts, those the filter's skips do not explain. That is none when their number is the number of
    skips saved with the cursor and each one's prompt has at least `min_appearances` groups of earlier
    epochs among the `present` ones (a prompt with fewer is never skipped); otherwise it is all of them."""
    epochs: dict[str, list[int]] = {}
    for group_id in present:
        if (parsed := parse_group_id(group_id)) is not None:
            epochs.setdefault(parsed[0], []).append(parsed[1])

    def explained(group_id: str) -> bool:
        parsed = parse_group_id(group_id)
        return parsed is not None and sum(e < parsed[1] for e in epochs.get(parsed[0], [])) >= min_appearances

    if len(missing) == num_skipped and all(explained(g) for g in missing):
        return []
    return missing
