"""OpenAI function-tool schema, validated with pydantic.

This is what the chat template receives in `tools=[...]` (via `ToolRegistry.schemas()`), what
`rollout.parsers.validate_call` checks arguments against, and what verl's tool configs carry under
`tool_schema`. Property schemas allow extra JSON-schema keywords (`minimum`, `pattern`, ...) because
they are passed through to the model verbatim; the envelope itself is strict.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One JSON-schema node describing an argument (nested `items` / `properties` stay plain dicts)."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None
    items: dict[str, Any] | None = None
    properties: dict[str, Any] | None = None
    required: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["object"] = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)
    additionalProperties: bool | None = None  # noqa: N815 (JSON-schema spelling)

    @model_validator(mode="after")
    def _required_are_declared(self) -> OpenAIFunctionParametersSchema:
        undeclared = [name for name in self.required if name not in self.properties]
        if undeclared:
            raise ValueError(f"required argument(s) {undeclared} are not declared in properties")
        return self


class OpenAIFunctionSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool | None = None


class OpenAIFunctionToolSchema(BaseModel):
    """`{"type": "function", "function": {"name", "description", "parameters": {...}}}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema

    @property
    def name(self) -> str:
        return self.function.name

    def to_openai(self) -> dict[str, Any]:
        """Plain dict for chat templates and `validate_call` (unset optional keys dropped)."""
        return self.model_dump(exclude_none=True)

    @classmethod
    def one_string_argument(
        cls, name: str, description: str, argument: str, argument_description: str
    ) -> OpenAIFunctionToolSchema:
        """A function of one required string argument (the shape of the built-in tools)."""
        return cls.model_validate(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {argument: {"type": "string", "description": argument_description}},
                        "required": [argument],
                    },
                },
            }
        )

    def with_name(self, name: str) -> OpenAIFunctionToolSchema:
        return self.model_copy(update={"function": self.function.model_copy(update={"name": name})})
