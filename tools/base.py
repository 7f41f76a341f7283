"""`BaseTool`: the interface every tool implements (same life cycle as verl's tools).

Per trajectory the loop calls `create` once (one instance per tool; the instance id is the
trajectory id; kwargs are the row's `tools_kwargs[name]["create_kwargs"]`), `execute` for every call,
`calc_reward` at the end and `release` when the trajectory ends (finished or failed). An instance
lives for the whole trajectory: a weight-sync park keeps it. Instance state lives in the tool object
of the rollout worker, so it is in-process: when a trajectory resumes in another process (worker
death, job restart), `restore` rebuilds the instance from the create kwargs and the trajectory's tool
journal (the calls that completed, with their results). Tools must not depend on model weights, which
is what lets tool calls keep running while a weight sync pauses generation.

At most once: the journal records each call before it runs. A call whose worker died mid-call is in
doubt on resume; it is re-run only when the tool declares `idempotent = True` (running it twice has
the effect of running it once), otherwise the model gets an "interrupted" error observation.

A tool is built from its YAML entry as `cls(config=..., tool_schema=...)`: `config` is validated by
the tool's `config_model` (pydantic, extra keys forbidden) and `tool_schema` defaults to the tool's
`default_schema()`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from streamrl.tools.instances import InstanceStore
from streamrl.tools.schema import OpenAIFunctionToolSchema
from streamrl.tools.types import ToolJournalEntry


@dataclass(kw_only=True, slots=True)
class ToolExecution:
    """The outcome of one `execute`: the observation text, a per-call reward, numeric metrics and
    images to show the model.

    Each image is a local path, a `data:image/...;base64,` URL or plain base64 string, encoded bytes
    (PNG, JPEG: anything PIL reads) or a PIL image. The observation shows the images first, then the
    text (verl's layout for multi-modal tool responses). For a VLM policy the executor admits them
    into the worker's image store; an image that cannot be read, or any image for a text-only policy,
    turns the result into an error observation (see `ToolRegistry.run_calls`)."""

    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # [num_images]; sources, shown before the text
    # Whether the call failed; None: the convention of our tools, text starting with "Error:". A tool
    # whose successful output may start with that (the code interpreter prints what a cell printed)
    # says so explicitly.
    is_error: bool | None = None


class EmptyToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaseTool(abc.ABC):
    config_model: ClassVar[type[BaseModel]] = EmptyToolConfig
    # the `config_model` instance (or the model instance passed in); a subclass declares its model's
    # type (`config: MyConfig`), which `Any` here lets it narrow
    config: Any
    # True when running a call twice has the effect of running it once (pure functions, lookups):
    # a call interrupted by a worker's death is then re-run on resume instead of reported as lost.
    # A class default that a tool built per entry (function, MCP) sets on itself.
    idempotent: bool = False

    def __init__(
        self,
        config: dict[str, Any] | BaseModel | None = None,
        tool_schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None,
    ) -> None:
        if isinstance(config, BaseModel):
            self.config = config
        else:
            self.config = self.config_model.model_validate(config or {})
        if tool_schema is None:
            tool_schema = self.default_schema()
        if not isinstance(tool_schema, OpenAIFunctionToolSchema):
            tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
        self.schema: OpenAIFunctionToolSchema = tool_schema
        self._instances = InstanceStore("tool", self.name)

    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        raise ValueError(f"{cls.__name__} has no default schema: give `tool_schema` in the tool config")

    @property
    def name(self) -> str:
        return self.schema.function.name

    @property
    def num_instances(self) -> int:
        return len(self._instances)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start one instance (one per trajectory); `kwargs` are the row's create_kwargs."""
        return self._instances.start(instance_id, kwargs)

    async def restore(self, instance_id: str, journal: list[ToolJournalEntry], **kwargs: Any) -> str:
        """Rebuild the instance of a trajectory resumed in a process that does not hold it.

        `journal` holds this tool's completed calls of the trajectory (status DONE, with results), in
        call order. The default recreates the instance from its create kwargs and replays nothing,
        which is right for tools whose instance state does not depend on earlier calls; a stateful tool
        overrides this to replay the recorded results (never by re-executing the calls)."""
        return await self.create(instance_id, **kwargs)

    def instance_state(self, instance_id: str) -> dict[str, Any]:
        return self._instances.get(instance_id)

    @abc.abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        """Run one call. Errors the model made should come back as text, not exceptions."""

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        self._instances.drop(instance_id)

    def close(self) -> None:
        """Stop what the tool runs in the background (the worker's shutdown); blocking, idempotent.

        The default runs nothing in the background, so there is nothing to stop."""
        return None
