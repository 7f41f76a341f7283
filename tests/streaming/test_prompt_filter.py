"""Online difficulty filtering (`streaming/prompt_filter.py`) without engines: the pass-rate record
read from a real `ReplayBuffer`'s settled groups, retirement over epochs through the real
`Pipeline.admit_next_group`, the seeded coin of hard prompts, a resume that rebuilds the record from
the durable log, crashes between a skip and the cursor save, every prompt retired, and the config's
errors. "Generation" is done by the test: it appends each open group's finished rows with rewards
chosen per prompt, right after the group's admission (sync mode's order) unless a test says otherwise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.buffer.types import SettledGroups
from streamrl.core import faults
from streamrl.core.run_dir import RunDir
from streamrl.rollout.data import load_records
from streamrl.rollout.types import TrajectoryStatus
from streamrl.streaming.config import load_config
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.pipeline import Pipeline
from streamrl.streaming.prompt_filter import (
    Appearance,
    Difficulty,
    PromptFilter,
    PromptFilterConfig,
    admit_draw,
    classify,
    unexplained_skips,
)
from streamrl.streaming.prompts import PromptStream, parse_group_id
from tests.buffer.helpers import make_group, make_traj

GROUP_SIZE = 2


class Buffer:
    """The `BufferClient` methods admission calls, over an in-process `ReplayBuffer`."""

    def __init__(self, rb: ReplayBuffer) -> None:
        self.rb = rb

    async def has_group(self, group_id: str) -> bool:
        return self.rb.has_groups([group_id])[0]

    async def append_durable(self, rows) -> None:
        self.rb.append(rows, durable=True)

    async def settled_groups(self, start: int) -> SettledGroups:
        return self.rb.settled_groups(start)


class Sink:
    """A rollout worker that only takes what it is handed (the test generates the rows itself)."""

    async def submit(self, items) -> int:
        return len(items)


def _buffer(root: Path | None = None) -> ReplayBuffer:
    """Group size 2 with the DAPO filter on: all-pass and all-fail groups are FILTERED, never trained,
    and still tell the prompt filter their outcome."""
    return ReplayBuffer(
        BufferConfig(
            group_size=GROUP_SIZE,
            batch_size=GROUP_SIZE,
            filter_uniform_reward_groups=True,
            root_dir=None if root is None else str(root),
        )
    )


def _pipeline(run_dir: Path, rb: ReplayBuffer, *overrides: str, state: DriverState | None = None) -> Pipeline:
    cfg = load_config(
        None,
        [
            f"buffer.group_size={GROUP_SIZE}",
            f"buffer.batch_size={GROUP_SIZE}",
            "data.num_prompts=4",
            "data.prompt_filter.enabled=true",
            "wandb.enabled=false",
            *overrides,
        ],
    )
    records = load_records("arithmetic", cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    state = state or DriverState()
    stream = PromptStream(
        records, seed=cfg.data.seed, shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs, cursor=state.cursor
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    return Pipeline(
        cfg=cfg,
        run_dir=run_dir,
        model_path="fake",
        engines=[],
        workers=[Sink()],
        buffer=Buffer(rb),
        learner=None,  # admission never trains
        stream=stream,
        prompt_filter=PromptFilter.for_run(cfg.data.prompt_filter, records, seed=cfg.data.seed),
        metrics=None,  # admission never logs
        state=state,
    )


def _generate(rb: ReplayBuffer, solved: dict[str, int], *, only: set[str] | None = None) -> None:
    """Finish the running trajectories (of the groups in `only`, default all): sample i of a prompt
    passes (reward 1) when i < solved[prompt], default 1 of 2 (a prompt with a signal)."""
    rows = []
    for t in rb.resumable():
        if only is None or t.group_id in only:
            prompt, _ = parse_group_id(t.group_id)
            rows.append(make_traj(t.group_id, t.sample_index, reward=float(t.sample_index < solved.get(prompt, 1))))
    rb.append(rows, durable=True)


async def _admit_all(pipeline: Pipeline, rb: ReplayBuffer, solved: dict[str, int]) -> int:
    """Admit until admission stops, generating each group right after its admission; returns the
    number of groups admitted."""
    num = 0
    while await pipeline.admit_next_group():
        _generate(rb, solved)
        num += 1
    return num


def _groups(rb: ReplayBuffer) -> set[str]:
    return set(rb._groups.groups)


def _epochs(rb: ReplayBuffer, prompt: str) -> list[int]:
    """The epochs of `prompt` that have a group in the buffer."""
    parsed = [parse_group_id(g) for g in _groups(rb)]
    return sorted(epoch for p, epoch in filter(None, parsed) if p == prompt)


# ---- the record ----------------------------------------------------------------------------------


def test_the_record_reads_every_settled_group_of_the_buffer_and_nothing_else():
    """Filtered (all equal) groups count too: they are exactly the easy and the hopeless ones. Failed
    samples and open groups say nothing; a group id of another form is passed over."""
    rb = _buffer()
    rb.append(make_group("p0@e0", 2, rewards=[1.0, 1.0]))  # all pass: FILTERED by DAPO
    rb.append(make_group("p1@e0", 2, rewards=[0.0, 1.0]))  # ready
    rb.append([make_traj("p2@e0", 0, reward=1.0), make_traj("p2@e0", 1, status=TrajectoryStatus.FAILED)])
    rb.append(make_group("loose", 2, rewards=[1.0, 1.0]))  # not a prompt stream's group
    rb.append([make_traj("p3@e0", 0, reward=1.0), make_traj("p3@e0", 1, status=TrajectoryStatus.PARTIAL)])
    settled = rb.settled_groups(0)
    assert {o.group_id: o.rewards for o in settled.outcomes} == {
        "p0@e0": (1.0, 1.0),
        "p1@e0": (0.0, 1.0),
        "p2@e0": (1.0,),
        "loose": (1.0, 1.0),
    }
    assert settled.next_start == 4 and settled.num_in_flight == 2  # p3's two members are open
    cfg = PromptFilterConfig(enabled=True, window=2, min_appearances=1)
    record = PromptFilter(cfg, prompts=["p0", "p1", "p2", "p3"], seed=0)
    record.observe(settled)
    assert record.appearances == {
        "p0": [Appearance(epoch=0, num_passed=2, num_samples=2)],
        "p1": [Appearance(epoch=0, num_passed=1, num_samples=2)],
        "p2": [Appearance(epoch=0, num_passed=1, num_samples=1)],
    }
    assert record.difficulty == {"p0": Difficulty.EASY, "p2": Difficulty.EASY}
    rb.append([make_traj("p3@e0", 1, reward=0.0)])  # p3 settles: only it is read next
    later = rb.settled_groups(record.next_start)
    assert [o.group_id for o in later.outcomes] == ["p3@e0"] and later.num_in_flight == 0
    record.observe(later)
    assert record.appearances["p3"] == [Appearance(epoch=0, num_passed=1, num_samples=2)]


def test_the_newest_appearances_by_epoch_decide_whatever_order_they_settle_in():
    cfg = PromptFilterConfig(enabled=True, window=2, min_appearances=2)
    record = PromptFilter(cfg, prompts=["p"], seed=0)

    def settle(epoch: int, rewards: tuple[float, ...], start: int) -> None:
        record.observe(SettledGroups(outcomes=[_outcome(f"p@e{epoch}", rewards)], next_start=start, num_in_flight=0))

    settle(2, (1.0, 1.0), 1)
    assert record.difficulty == {}  # one appearance of the two it takes
    settle(3, (1.0, 1.0), 2)
    assert record.difficulty == {"p": Difficulty.EASY}
    settle(1, (0.0, 0.0), 3)  # an older group settling late is outside the window
    assert record.difficulty == {"p": Difficulty.EASY} and [a.epoch for a in record.appearances["p"]] == [2, 3]
    settle(4, (0.0, 1.0), 4)  # pooled over epochs 3 and 4: 3 of 4 pass
    assert record.difficulty == {} and record.counts[Difficulty.EASY] == 0


def _outcome(group_id: str, rewards: tuple[float, ...]):
    from streamrl.buffer.types import GroupOutcome

    return GroupOutcome(group_id=group_id, rewards=rewards)


@pytest.mark.parametrize(
    "passed,expected",
    [((4, 4), Difficulty.EASY), ((4, 3), None), ((0, 0), Difficulty.HARD), ((1, 0), None), ((4,), None)],
)
def test_classify_pools_the_samples_of_the_window(passed, expected):
    cfg = PromptFilterConfig(enabled=True, window=3, min_appearances=2, easy_pass_rate=1.0, hard_pass_rate=0.1)
    appearances = [Appearance(epoch=e, num_passed=n, num_samples=4) for e, n in enumerate(passed)]
    assert classify(appearances, cfg) == expected


@pytest.mark.parametrize(
    "group_id,parsed",
    [("arith-0@e3", ("arith-0", 3)), ("a@e1@e12", ("a@e1", 12)), ("x", None), ("x@e", None), ("@e3", None)],
)
def test_a_group_id_names_its_prompt_and_epoch(group_id, parsed):
    assert parse_group_id(group_id) == parsed


# ---- admission over epochs -----------------------------------------------------------------------


async def test_a_prompt_every_sample_solves_is_retired_in_later_epochs_and_counted(tmp_path):
    rb = _buffer()
    pipeline = _pipeline(
        tmp_path, rb, "data.num_epochs=5", "data.prompt_filter.window=2", "data.prompt_filter.min_appearances=2"
    )
    easy, hard, *_ = [r.group_id for r in pipeline.stream.records]
    admitted = await _admit_all(pipeline, rb, {easy: GROUP_SIZE, hard: 0})
    assert pipeline.state.cursor == 4 * 5 and admitted == 4 * 5 - 3
    assert _epochs(rb, easy) == [0, 1]  # two appearances, then retired for epochs 2, 3 and 4
    assert _epochs(rb, hard) == [0, 1, 2, 3, 4]  # hard prompts are kept by default
    assert pipeline.state.num_prompts_skipped_easy == 3 and pipeline.state.num_prompts_skipped_hard == 0
    assert pipeline.prompt_filter.metrics(pipeline.state) == {
        "data/prompts_easy": 1.0,
        "data/prompts_hard": 1.0,
        "data/prompts_retired": 1.0,
        "data/prompts_skipped_easy": 3.0,
        "data/prompts_skipped_hard": 0.0,
    }
    saved = DriverState.load(RunDir(tmp_path).driver_state)  # the skips are saved with the cursor
    assert (saved.cursor, saved.num_prompts_skipped_easy) == (20, 3)
    assert pipeline.prompts_exhausted
    missing = sorted(f"{easy}@e{e}" for e in (2, 3, 4))
    assert unexplained_skips(missing, _groups(rb), num_skipped=3, min_appearances=2) == []


async def test_the_filter_off_admits_every_prompt_of_every_epoch(tmp_path):
    rb = _buffer()
    pipeline = _pipeline(tmp_path, rb, "data.num_epochs=3", "data.prompt_filter.enabled=false")
    assert pipeline.prompt_filter is None
    easy = pipeline.stream.records[0].group_id
    assert await _admit_all(pipeline, rb, {easy: GROUP_SIZE}) == 12


async def test_hard_prompts_are_admitted_by_a_seeded_coin_that_every_run_repeats(tmp_path):
    overrides = ("data.num_epochs=24", "data.prompt_filter.min_appearances=1", "data.prompt_filter.window=1")
    overrides += ("data.prompt_filter.hard_admit_probability=0.5",)
    runs = []
    for name in ("a", "b"):
        rb = _buffer()
        pipeline = _pipeline(tmp_path / name, rb, *overrides)
        hard = pipeline.stream.records[1].group_id
        await _admit_all(pipeline, rb, {hard: 0})
        runs.append((_epochs(rb, hard), pipeline.state.num_prompts_skipped_hard))
    (epochs, skipped), again = runs
    assert again == (epochs, skipped)
    assert epochs[0] == 0 and skipped == 24 - len(epochs)
    assert 5 <= skipped <= 18, f"a coin of 0.5 skipped {skipped} of 23 appearances"
    kept = [e for e in range(1, 24) if admit_draw(0, hard, e) < 0.5]
    assert epochs[1:] == kept


def test_the_coin_depends_on_the_seed_and_never_on_the_process():
    draws = [admit_draw(7, "arith-medium-0-1", e) for e in range(8)]
    assert draws != [admit_draw(8, "arith-medium-0-1", e) for e in range(8)]
    assert all(0.0 <= d < 1.0 for d in draws) and len(set(draws)) == 8
    code = (
        "from streamrl.streaming.prompt_filter import admit_draw\n"
        "print([admit_draw(7, 'arith-medium-0-1', e) for e in range(8)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(draws)


# ---- resume --------------------------------------------------------------------------------------


async def test_a_resume_rebuilds_the_record_from_the_log_and_repeats_every_decision(tmp_path):
    overrides = ("data.num_epochs=6", "data.prompt_filter.window=2", "data.prompt_filter.min_appearances=2")
    overrides += ("data.prompt_filter.hard_admit_probability=0.5",)
    rb = _buffer(tmp_path / "buffer")
    pipeline = _pipeline(tmp_path, rb, *overrides)
    prompts = [r.group_id for r in pipeline.stream.records]
    solved = {prompts[0]: GROUP_SIZE, prompts[1]: 0}
    for _ in range(4 * 3 - 2):  # epochs 0 and 1, most of epoch 2
        assert await pipeline.admit_next_group()
        _generate(rb, solved)
    live = pipeline.prompt_filter
    live.observe(rb.settled_groups(live.next_start))  # the group generated after the last admission
    assert live.difficulty == {prompts[0]: Difficulty.EASY, prompts[1]: Difficulty.HARD}
    decisions = {(p, e): live.skips(p, e) for p in prompts for e in range(2, 40)}
    assert set(decisions.values()) == {None, Difficulty.EASY, Difficulty.HARD}
    rb.close()

    recovered = _buffer(tmp_path / "buffer")
    rebuilt = PromptFilter(live.cfg, prompts=prompts, seed=live.seed)
    rebuilt.observe(recovered.settled_groups(0))
    assert rebuilt.appearances == live.appearances and rebuilt.difficulty == live.difficulty
    assert {(p, e): rebuilt.skips(p, e) for p in prompts for e in range(2, 40)} == decisions
    recovered.close()


def _crash_on_first_skip_save(pipeline: Pipeline) -> None:
    """The driver state's first save that records a skip raises: the process died before it."""
    save = pipeline.state.save

    def crashing_save(path: Path) -> None:
        if pipeline.state.num_prompts_skipped_easy:
            raise RuntimeError("killed before the cursor save")
        save(path)

    pipeline.state.save = crashing_save


def _crash_after_append_past_a_skip(pipeline: Pipeline, monkeypatch) -> None:
    """The first group appended after a skip: its rows are durable, the cursor is not saved."""

    def crashing_hit(point: str) -> None:
        if point == "admit.after_append" and pipeline.state.num_prompts_skipped_easy:
            raise RuntimeError("killed before the cursor save")

    monkeypatch.setattr(faults, "hit", crashing_hit)


@pytest.mark.parametrize("crash", ["before_skip_save", "after_append"])
async def test_a_crash_around_a_skip_neither_loses_nor_duplicates_a_prompt(tmp_path, monkeypatch, crash):
    """I1 with skips: after the crash and a resume, the admitted groups and the skip count are those
    of the same run without a crash, and the invariant checker's rule finds no prompt lost."""
    overrides = ("data.num_epochs=4", "data.prompt_filter.window=2", "data.prompt_filter.min_appearances=2")
    reference_rb = _buffer()
    reference = _pipeline(tmp_path / "reference", reference_rb, *overrides)
    solved = {reference.stream.records[0].group_id: GROUP_SIZE}
    await _admit_all(reference, reference_rb, solved)
    assert reference.state.num_prompts_skipped_easy == 2

    run_dir = tmp_path / "run"
    rb = _buffer(run_dir / "buffer")
    pipeline = _pipeline(run_dir, rb, *overrides)
    if crash == "before_skip_save":
        _crash_on_first_skip_save(pipeline)
    else:
        _crash_after_append_past_a_skip(pipeline, monkeypatch)
    with pytest.raises(RuntimeError, match="killed before the cursor save"):
        await _admit_all(pipeline, rb, solved)
    counted = pipeline.state.num_prompts_skipped_easy  # in memory when it died
    monkeypatch.undo()
    rb.close()

    state = DriverState.load(RunDir(run_dir).driver_state)
    assert counted >= 1 and state.num_prompts_skipped_easy == (0 if crash == "before_skip_save" else counted)
    rb = _buffer(run_dir / "buffer")
    resumed = _pipeline(run_dir, rb, *overrides, state=state)
    await resumed.reconcile_cursor()
    _generate(rb, solved)  # what was running when it died is resumed and finishes
    await _admit_all(resumed, rb, solved)
    assert _groups(rb) == _groups(reference_rb)
    assert resumed.state.cursor == reference.state.cursor == 16
    assert resumed.state.num_prompts_skipped_easy == 2
    expected = {f"{p.group_id}@e{e}" for p in resumed.stream.records for e in range(4)}
    missing = sorted(expected - _groups(rb))
    assert len(missing) == 2
    assert unexplained_skips(missing, _groups(rb), num_skipped=2, min_appearances=2) == []
    rb.close()


def test_the_checker_reports_every_missing_group_the_skips_do_not_explain():
    present = {"a@e0", "a@e1", "b@e0", "b@e1", "b@e2"}
    assert unexplained_skips(["a@e2"], present, num_skipped=1, min_appearances=2) == []
    assert unexplained_skips(["a@e2"], present, num_skipped=0, min_appearances=2) == ["a@e2"]  # not counted
    assert unexplained_skips(["a@e1"], present - {"a@e1"}, num_skipped=1, min_appearances=2) == ["a@e1"]  # too early
    assert unexplained_skips(["a@e2", "c@e2"], present, num_skipped=2, min_appearances=2) == ["a@e2", "c@e2"]


# ---- every prompt retired ------------------------------------------------------------------------


async def test_when_every_prompt_is_retired_admission_stops_without_running_through_the_epochs(tmp_path, caplog):
    rb = _buffer()
    pipeline = _pipeline(
        tmp_path, rb, "data.num_epochs=50", "data.prompt_filter.window=1", "data.prompt_filter.min_appearances=1"
    )
    solved = {r.group_id: GROUP_SIZE for r in pipeline.stream.records}
    with caplog.at_level(logging.WARNING, logger="streamrl.streaming.prompt_filter"):
        assert await _admit_all(pipeline, rb, solved) == 4
        assert not await pipeline.admit_next_group()
    assert pipeline.state.cursor == 4  # at the start of epoch 1, not run through the 49 epochs left
    assert pipeline.stream.peek() is not None and pipeline.prompts_exhausted  # the run ends as out of prompts
    assert pipeline.prompt_filter.metrics(pipeline.state)["data/prompts_retired"] == 4.0
    told = [r for r in caplog.records if "every one of the 4 prompts is retired" in r.getMessage()]
    assert len(told) == 1


async def test_a_group_still_running_can_bring_a_retired_prompt_back(tmp_path):
    """Async mode: a prompt's next group may be admitted before its previous one settled. While it
    runs, every prompt may look retired: nothing is admitted, but the prompts are not exhausted; its
    outcome can un-retire its prompt, and admission goes on."""
    rb = _buffer()
    pipeline = _pipeline(
        tmp_path, rb, "data.num_epochs=50", "data.prompt_filter.window=1", "data.prompt_filter.min_appearances=1"
    )
    solved = {r.group_id: GROUP_SIZE for r in pipeline.stream.records}
    for _ in range(5):  # all of epoch 0 and the first prompt of epoch 1, nothing settled yet
        assert await pipeline.admit_next_group()
    (running,) = [g for g in _groups(rb) if g.endswith("@e1")]
    _generate(rb, solved, only={g for g in _groups(rb) if g.endswith("@e0")})
    assert not await pipeline.admit_next_group()
    assert pipeline.prompt_filter.all_retired and not pipeline.prompts_exhausted  # 2 trajectories still run
    prompt, _ = parse_group_id(running)
    _generate(rb, {prompt: 0})  # its newest appearance: every sample fails (hard, kept)
    assert await pipeline.admit_next_group()
    assert _groups(rb) - {f"{r.group_id}@e0" for r in pipeline.stream.records} == {running, f"{prompt}@e2"}
    assert pipeline.state.num_prompts_skipped_easy == pipeline.state.cursor - 6  # the others were passed over


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.prompt_filter.min_appearances=5", "min_appearances=5 > window=4"),
        ("data.prompt_filter.hard_pass_rate=1.0", "hard_pass_rate must be below easy_pass_rate"),
        ("data.prompt_filter.easy_admit_probability=1.5", "data.prompt_filter.easy_admit_probability"),
        ("data.prompt_filter.window=0", "data.prompt_filter.window"),
        ("data.prompt_filter.pass_threshold=nan", "data.prompt_filter.pass_threshold"),
        ("data.prompt_filter.easy_pass_rte=0.9", "data.prompt_filter.easy_pass_rte"),
    ],
)
def test_a_bad_prompt_filter_config_is_one_error_naming_it(override, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(None, [override])


def test_the_filter_is_off_by_default():
    assert load_config(None, []).data.prompt_filter.enabled is False
