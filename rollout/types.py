"""Typed records that cross the rollout boundary.

`AgentData` is the whole resumable state of one trajectory while an agent loop works on it; it is a
pydantic model so it round-trips through JSON losslessly (the buffer stores it in `partial` rows and
a worker in another process resumes from it — never pickle). `Trajectory` is what leaves the loop and
what the Arrow schema in `buffer/schema.py` mirrors field for field.

Invariants (stated once, checked by `Trajectory.validate()` and `AgentData.check_aligned()`):
- `response_ids`, `response_mask`, `behavior_logprobs` and `policy_versions` have equal length;
- where `response_mask == 0` (tool / interaction / user tokens) the logprob is 0.0 and the
  policy_version is -1; where it is 1 the policy_version is >= 0;
- `len(prompt_ids) + len(response_ids) <= max_model_len` of the run;
- `token_side` (per-token side data an engine produced, `engines.token_side`) has at most one row per
  token of `prompt_ids + response_ids`;
- `Trajectory.teacher_logprobs`, when present, has one entry per response token, 0.0 where
  `response_mask == 0` (only the policy's tokens are scored for distillation);
- images: `prompt_ids` / `response_ids` hold the *expanded* ids (each image is one run of the model's
  image placeholder token, what the model saw), and the number of such runs in
  `prompt_ids + response_ids` equals `len(AgentData.images)`, in the same order. Checked by
  `check_aligned(image_token_id=...)` when a model with an image token is in play.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import AliasChoices, BaseModel, Field

from streamrl.core.versions import OBSERVATION_VERSION
from streamrl.engines.token_side import TokenSide, merge_first
from streamrl.models.images import ImageRef
from streamrl.models.multimodal import count_image_runs, image_run_lengths
from streamrl.tools.types import ToolCall, ToolJournalEntry, ToolResult


class AgentState(StrEnum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


class TrajectoryStatus(StrEnum):
    FINISHED = "finished"
    PARTIAL = "partial"  # parked by an interrupt; `agent_data_json` holds the resumable state
    FAILED = "failed"


class FinishReason(StrEnum):
    STOP = "stop"  # the model ended its turn and no tool call / interaction continues it
    LENGTH = "length"  # response token budget or model length exhausted
    MAX_TURNS = "max_turns"  # assistant or user turn limit
    INTERACTION_DONE = "interaction_done"  # the interaction terminated the episode
    ABORT = "abort"  # interrupted (partial rows only)
    ERROR = "error"  # failed trajectory


class AgentData(BaseModel):
    """Everything needed to resume one trajectory, in any process.

    Token arrays follow the module invariants. `turn_start` is the index in `response_ids` where
    the current assistant turn began: when a generation is interrupted the tokens already streamed
    are appended (mask 1, their versions) and the resumed generation continues the same turn.
    `images` are the images of `prompt_ids + response_ids` in placeholder order (prompt images, then
    those of tool / interaction responses as they arrive); a resume re-submits them with the ids.
    """

    trajectory_id: str
    group_id: str
    sample_index: int = 0
    agent_name: str = "tool_agent"
    state: AgentState = AgentState.PENDING

    messages: list[dict[str, Any]] = Field(default_factory=list)  # OpenAI chat format; image parts hold `image_ref`
    tools_kwargs: dict[str, Any] = Field(default_factory=dict)
    ground_truth: str | None = None
    # The dataset row's metadata for verl-style reward functions (see `PromptRecord`).
    data_source: str | None = None
    raw_ground_truth: Any = None
    extra_info: dict[str, Any] = Field(default_factory=dict)

    prompt_ids: list[int] = Field(default_factory=list)  # [num_prompt_tokens]
    response_ids: list[int] = Field(default_factory=list)  # [num_response_tokens]
    response_mask: list[int] = Field(default_factory=list)  # [num_response_tokens]
    # The sampling policy's log-probs (`Trajectory.behavior_logprobs`); snapshots written before the
    # rename say `response_logprobs` and still load.
    behavior_logprobs: list[float] = Field(
        default_factory=list, validation_alias=AliasChoices("behavior_logprobs", "response_logprobs")
    )  # [num_response_tokens]
    policy_versions: list[int] = Field(default_factory=list)  # [num_response_tokens]
    turn_start: int = 0
    images: list[ImageRef] = Field(default_factory=list)  # [num_images]; placeholder order
    # Side data of prompt + response tokens (routed experts of an MoE engine); None: the engine made none.
    token_side: TokenSide | None = None  # [<= num_prompt_tokens + num_response_tokens] rows

    num_assistant_turns: int = 0
    num_user_turns: int = 0
    pending_tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_results: list[ToolResult] = Field(default_factory=list)  # every call's outcome, as the model saw it
    tool_journal: list[ToolJournalEntry] = Field(default_factory=list)  # calls that reached a tool, in order
    turn_scores: list[float] = Field(default_factory=list)
    tool_rewards: list[float] = Field(default_factory=list)
    reward: float = 0.0  # final score, set when TERMINATED
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_parse_errors: int = 0

    interaction_name: str | None = None
    interaction_instance_id: str | None = None
    interaction_done: bool = False

    request_id: str = ""
    engine_id: str | None = None  # sticky engine affinity
    finish_reason: FinishReason | None = None
    num_interrupts: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0
    created_at: float = 0.0
    # Fencing number: 0 for the first submission, +1 each time the driver hands the trajectory to a
    # worker again after its previous holder died (`Pipeline.resubmit_orphans`). Every row carries it;
    # the buffer refuses rows of an attempt older than the newest it holds (`buffer.groups`).
    attempt: int = Field(default=0, ge=0)
    # A gateway session's state (`rollout.gateway.journal.GatewayState` as JSON: journal of answered
    # calls, forked segments, pending choices), written when the program ends; while it runs, each
    # answered call is a `JournalRecord` instead. None for every other agent loop.
    gateway: dict[str, Any] | None = None

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> AgentData:
        return cls.model_validate_json(text)

    def to_trajectory(self, status: TrajectoryStatus, *, image_token_id: int | None = None) -> Trajectory:
        """The buffer row of `data`. An image trajectory needs the model's `image_token_id` to
        measure each image's placeholder run (`num_image_tokens`); the caller hands the bytes of
        `image_refs` to the buffer with the row. A FAILED row whose runs do not match its images
        (the failure may be just that) is written without image columns."""
        image_refs: list[str] = []
        num_image_tokens: list[int] = []
        if self.images:
            if image_token_id is None:
                raise ValueError(
                    f"trajectory {self.trajectory_id} carries {len(self.images)} images; its row needs the "
                    "model's image_token_id to count each image's placeholder tokens"
                )
            runs = image_run_lengths(self.prompt_ids + self.response_ids, image_token_id)
            if len(runs) == len(self.images):
                image_refs, num_image_tokens = [r.sha256 for r in self.images], runs
            elif status is not TrajectoryStatus.FAILED:
                self.check_aligned(image_token_id=image_token_id)  # raises: a bug, never a silent text row
        partial = status is TrajectoryStatus.PARTIAL
        return Trajectory(
            trajectory_id=self.trajectory_id,
            group_id=self.group_id,
            sample_index=self.sample_index,
            agent_name=self.agent_name,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_mask=list(self.response_mask),
            behavior_logprobs=list(self.behavior_logprobs),
            policy_versions=list(self.policy_versions),
            reward=0.0 if partial else self.reward,
            turn_scores=list(self.turn_scores),
            tool_rewards=list(self.tool_rewards),
            num_turns=self.num_assistant_turns + self.num_user_turns,
            num_tool_calls=self.num_tool_calls,
            num_tool_errors=self.num_tool_errors,
            status=status,
            finish_reason=FinishReason.ABORT if partial else (self.finish_reason or FinishReason.STOP),
            num_interrupts=self.num_interrupts,
            generate_s=self.generate_s,
            tool_s=self.tool_s,
            created_at=self.created_at,
            finished_at=time.time(),
            agent_data_json=self.to_json() if partial else None,
            attempt=self.attempt,
            token_side=self.token_side,
            image_refs=image_refs,
            num_image_tokens=num_image_tokens,
        )

    def append_sampled(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        assert len(token_ids) == len(logprobs) == len(versions), "engine arrays misaligned"
        self.response_ids.extend(token_ids)
        self.response_mask.extend([1] * len(token_ids))
        self.behavior_logprobs.extend(logprobs)
        self.policy_versions.extend(versions)

    def record_side(self, side: TokenSide | None) -> None:
        """Keep an engine request's side data (rows from position 0 of prompt + response); each
        position keeps the first row recorded for it, the one its token was generated with."""
        self.token_side = merge_first(self.token_side, side)

    def append_observation(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        self.response_ids.extend(token_ids)
        self.response_mask.extend([0] * n)
        self.behavior_logprobs.extend([0.0] * n)
        self.policy_versions.extend([OBSERVATION_VERSION] * n)

    def check_aligned(self, image_token_id: int | None = None) -> None:
        """Raise AssertionError if the per-token arrays are misaligned, or, given the model's image
        placeholder token (None for a text-only model), if the placeholder runs and `images` disagree."""
        n = len(self.response_ids)
        if not (n == len(self.response_mask) == len(self.behavior_logprobs) == len(self.policy_versions)):
            raise AssertionError(
                f"per-token arrays misaligned: ids={n} mask={len(self.response_mask)} "
                f"logprobs={len(self.behavior_logprobs)} versions={len(self.policy_versions)}"
            )
        if self.token_side is not None and self.token_side.num_tokens > len(self.prompt_ids) + n:
            raise AssertionError(
                f"token side data has {self.token_side.num_tokens} rows for {len(self.prompt_ids) + n} tokens"
            )
        if image_token_id is not None:
            num_runs = count_image_runs(self.prompt_ids + self.response_ids, image_token_id)
            if num_runs != len(self.images):
                raise AssertionError(
                    f"trajectory {self.trajectory_id}: {num_runs} image placeholder runs in prompt + response "
                    f"but {len(self.images)} images"
                )


@dataclass(kw_only=True, slots=True)
class JournalRecord:
    """One entry of a running trajectory's append-only journal: a step an agent loop made durable
    without writing the whole trajectory again (the gateway: one answered call, `rollout.gateway.journal`).

    The buffer keeps a trajectory's records, in `seq` order, while its latest row is partial, and drops
    them once a final row arrives; a resumed attempt reads them back (`AgentContext.read_journal`) and
    folds them onto the row it resumed from. Records are fenced like rows: one of an attempt older than
    the trajectory's current one is refused. `payload` is the loop's own record as JSON; the buffer
    never looks inside."""

    trajectory_id: str
    attempt: int  # the attempt that wrote it
    seq: int  # 0, 1, 2, ... per trajectory, across its attempts
    payload: str


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One trajectory as it leaves the agent loop (`AgentLoopOutput`); a buffer row.

    Status `partial` carries `agent_data_json`; a later row with the same `trajectory_id` and an
    `attempt` no older supersedes it. Rewards are final for `finished` rows only.
    """

    trajectory_id: str
    group_id: str  # the prompt id; GRPO groups are the samples of one group_id
    sample_index: int
    agent_name: str
    prompt_ids: list[int]  # [num_prompt_tokens]
    response_ids: list[int]  # [num_response_tokens]
    response_mask: list[int]  # [num_response_tokens]; 1 = sampled by the policy
    behavior_logprobs: list[float]  # [num_response_tokens]; 0.0 where mask is 0
    policy_versions: list[int]  # [num_response_tokens]; -1 where mask is 0
    reward: float = 0.0
    turn_scores: list[float] = field(default_factory=list)  # [num_scored_turns]
    tool_rewards: list[float] = field(default_factory=list)  # [num_tool_calls]
    num_turns: int = 0  # assistant + user turns
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    status: TrajectoryStatus = TrajectoryStatus.FINISHED
    finish_reason: FinishReason = FinishReason.STOP
    num_interrupts: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0
    created_at: float = 0.0
    finished_at: float = 0.0
    agent_data_json: str | None = None  # resumable AgentData (partial rows)
    attempt: int = 0  # `AgentData.attempt` of the worker that wrote the row (fencing; older ones are refused)
    token_side: TokenSide | None = None  # [<= num_prompt_tokens + num_response_tokens] rows (`AgentData.token_side`)
    # The distillation teacher's log-prob of every response token (`rollout.teacher`), 0.0 where mask is 0;
    # None: not scored (no teacher, or a partial / failed row)
    teacher_logprobs: list[float] | None = None  # [num_response_tokens]
    image_refs: list[str] = field(default_factory=list)  # [num_images] sha256 hex, placeholder order
    num_image_tokens: list[int] = field(default_factory=list)  # [num_images] placeholder tokens of each

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def min_policy_version(self) -> int:
        sampled = [v for v in self.policy_versions if v >= 0]
        return min(sampled) if sampled else OBSERVATION_VERSION

    @property
    def max_policy_version(self) -> int:
        return max(self.policy_versions, default=OBSERVATION_VERSION)

    def validate(self, max_model_len: int | None = None) -> None:
        """Raise AssertionError if the data contract is broken (a bug, never the world)."""
        n = len(self.response_ids)
        assert n == len(self.response_mask) == len(self.behavior_logprobs) == len(self.policy_versions), (
            "per-token arrays misaligned"
        )
        for m, lp, v in zip(self.response_mask, self.behavior_logprobs, self.policy_versions):
            if m:
                assert v >= 0, "sampled token without a policy_version"
            else:
                assert v == OBSERVATION_VERSION and lp == 0.0, "observation token with a version/logprob"
        if max_model_len is not None:
            assert len(self.prompt_ids) + n <= max_model_len, "trajectory longer than max_model_len"
        if self.token_side is not None:
            assert self.token_side.num_tokens <= len(self.prompt_ids) + n, "token side rows past the sequence"
        if self.status is TrajectoryStatus.PARTIAL:
            assert self.agent_data_json is not None, "partial row without AgentData"
        if self.teacher_logprobs is not None:
            assert len(self.teacher_logprobs) == n, "teacher log-probs misaligned with the response"
            assert all(m or lp == 0.0 for m, lp in zip(self.response_mask, self.teacher_logprobs)), (
                "observation token with a teacher log-prob"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Trajectory:
        kwargs = {f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row}
        kwargs["status"] = TrajectoryStatus(kwargs.get("status", TrajectoryStatus.FINISHED))
        kwargs["finish_reason"] = FinishReason(kwargs.get("finish_reason", FinishReason.STOP))
        if isinstance(kwargs.get("token_side"), dict):  # an Arrow row's struct
            kwargs["token_side"] = TokenSide.model_validate(kwargs["token_side"])
        return cls(**kwargs)

    def agent_data(self) -> AgentData:
        if self.agent_data_json is None:
            raise ValueError(f"trajectory {self.trajectory_id} has no AgentData snapshot")
        return AgentData.from_json(self.agent_data_json)

    def next_attempt(self) -> Trajectory:
        """This (partial) row as the next attempt of its trajectory: the same row, `attempt` + 1 in the
        column and in its AgentData (which the new holder's rows copy, `AgentData.to_trajectory`)."""
        data = self.agent_data()
        attempt = max(self.attempt, data.attempt) + 1
        data.attempt = attempt
        return dataclasses.replace(self, attempt=attempt, agent_data_json=data.to_json())

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


@dataclass(kw_only=True, slots=True)
class PromptRecord:
    """One dataset row: a prompt that becomes a GRPO group of `n` trajectories.

    Accepts verl's parquet layout (`prompt` holding the messages, `extra_info.tools_kwargs`,
    `reward_model.ground_truth`) as well as the flat one (`messages`, `tools_kwargs`,
    `ground_truth`). The metadata of verl's layout is kept for verl-style reward functions
    (`compute_score(data_source, solution_str, ground_truth, extra_info)`) and interactions; every
    such field defaults to "absent". `ground_truth` is the text the built-in rewards compare,
    `raw_ground_truth` the value as stored (a dict or list for some verl datasets), which is what
    verl's scorers receive; `extra_info` is the row's whole `extra_info`; `interaction_kwargs` is
    `extra_info.interaction_kwargs` (or a top-level column)."""

    group_id: str
    messages: list[dict[str, Any]]
    agent_name: str | None = None  # None: the run's `rollout.agent.default_agent`
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    ground_truth: str | None = None
    data_index: int = 0  # position in the dataset: the data cursor of resumable runs
    data_source: str | None = None  # e.g. "openai/gsm8k"; selects verl's scorer
    ability: str | None = None  # e.g. "math"
    reward_style: str | None = None  # verl's reward_model.style: "rule" or "model"
    raw_ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class RolloutOutcomes:
    """One rollout worker's terminal trajectories since it started (counters only grow): what the
    driver's failed-trajectory check reads (`streaming.failures`). `failure_reasons` counts failures
    by reason (the exception's type and first line, digits as N; at most `rollout.worker.MAX_REASONS`
    kinds, the rest under "other"), counted when a trajectory fails (`num_failed` once its row is saved)."""

    worker_id: str
    num_finished: int
    num_failed: int
    failure_reasons: dict[str, int] = field(default_factory=dict)
