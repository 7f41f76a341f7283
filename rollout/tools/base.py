"""`BaseTool`: the interface every tool implements (same life cycle as verl's tools).

Per trajectory the loop calls `create` once (one instance per tool, keyed by `instance_id`, with the
row's `tools_kwargs[name]["create_kwargs"]`), `execute` for every call, `calc_reward` at the end and
`release` always (in `finally`). Instance state lives in the tool object of the rollout worker, so it
is in-process: tools must not depend on model weights, which is what lets tool calls keep running
while a weight sync pauses generation.

A tool is built from its YAML entry as `cls(config=..., tool_schema=...)`: `config` is validated by
the tool's `config_model` (pydantic, extra keys forbidden) and `tool_schema` defaults to the tool's
`default_schema()`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from rollout.instances import InstanceStore
from rollout.tools.schema import OpenAIFunctionToolSchema


@dataclass(kw_only=True, slots=True)
class ToolExecution:
    """The outcome of one `execute`: the observation text, a per-call reward and numeric metrics."""

    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class EmptyToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaseTool(abc.ABC):
    config_model: ClassVar[type[BaseModel]] = EmptyToolConfig

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

    def instance_state(self, instance_id: str) -> dict[str, Any]:
        return self._instances.get(instance_id)

    @abc.abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        """Run one call. Errors the model made should come back as text, not exceptions."""

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        self._instances.drop(instance_id)
