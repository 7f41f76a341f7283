"""`BaseInteraction`: a simulated user / environment that answers the agent between turns.

When the assistant ends a turn without tool calls and the trajectory has an interaction, the agent
loop (state INTERACTING) calls `generate_response` with the chat so far; the interaction returns
`(should_terminate, response, turn_score, extra)`. A non-terminating response is appended as a user
message (mask 0 tokens) and generation continues. The response is a string, or, to show the model
images, a list of content parts `[{"type": "text", "text": ...}, {"type": "image", "image": SOURCE}]`
(SOURCE: a local path, a `data:image/...;base64,` URL, plain base64, encoded bytes or a PIL image),
kept in that order; the loop admits the images into the worker's image store and the message keeps
`{"type": "image", "image_ref": sha256}` parts (`rollout/agent_loop/image_observation.py`: images a
text-only policy, the decoder or the image limit refuses make it an "Error: ..." text instead). The
`messages` an interaction receives may therefore hold such parts. The life cycle mirrors tools and verl's
interactions: `start_interaction` once per trajectory (with the row's interaction kwargs, e.g.
`ground_truth`), `calculate_score` at the end, `finalize_interaction` when the trajectory ends
(finished or failed; a weight-sync park keeps the instance). Instance state is in-process: a
trajectory resumed in another process gets its instance back through `restore`, which rebuilds what
must survive from the messages (e.g. `num_replies`).

Configs use verl's layout (`interaction: [{name, class_name, config}]`); `class_name` may be omitted
for built-ins registered with `@register_interaction`, and `interactions:` is accepted as the key.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from streamrl.core.registry import Registry, import_object
from streamrl.tools.instances import InstanceStore


class BaseInteraction(abc.ABC):
    """Subclasses set `config_model` to validate `config` (verl passes the raw dict plus `name`)."""

    config_model: type[BaseModel] | None = None
    # the `config_model` instance, or the raw dict without one; a subclass declares its model's type
    # (`config: MyConfig`), which `Any` here lets it narrow
    config: Any

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        raw = dict(config or {})
        self.name: str = str(raw.pop("name", type(self).__name__))
        self.config = self.config_model.model_validate(raw) if self.config_model is not None else raw
        self._instances = InstanceStore("interaction", self.name)

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return self._instances.start(instance_id, kwargs)

    async def restore(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """Restart the instance of a trajectory resumed in a process that does not hold it, with the
        chat so far. The default starts it afresh; stateful interactions override this to rebuild
        their state from `messages` (never from anything only the dead process knew)."""
        return await self.start_interaction(instance_id, **kwargs)

    def instance_state(self, instance_id: str) -> dict[str, Any]:
        return self._instances.get(instance_id)

    @abc.abstractmethod
    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate, response, turn score, extra) for the chat so far; the response is a
        string or a list of text / image content parts (module doc)."""

    async def calculate_score(self, instance_id: str) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str) -> None:
        self._instances.drop(instance_id)


def num_replies(messages: list[dict[str, Any]]) -> int:
    """How many times the interaction has answered this trajectory so far: the user messages after
    the first assistant message (an agent loop adds user messages only for interaction replies; tool
    results are `tool` messages). Assumes the prompt holds no assistant turn (no few-shot dialogue)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return sum(1 for m in messages[first:] if m.get("role") == "user")


INTERACTIONS: Registry[type[BaseInteraction]] = Registry("built-in interaction")


def register_interaction(name: str) -> Callable[[type[BaseInteraction]], type[BaseInteraction]]:
    return INTERACTIONS.register(name)


def _builtin(name: str) -> type[BaseInteraction]:
    from streamrl.rollout.interactions import math_feedback  # noqa: F401 (registers the built-in)

    return INTERACTIONS.get(name, hint=", or give `class_name`")


class InteractionEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    class_name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)


def build_interaction(entry: InteractionEntry) -> BaseInteraction:
    if entry.class_name is not None:
        cls = import_object(entry.class_name)
    else:
        cls = _builtin(entry.name)
    if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
        raise ValueError(f"{entry.class_name} is not a subclass of rollout.interactions.base.BaseInteraction")
    return cls({**entry.config, "name": entry.name})


def load_interaction_config(source: str | Path | Mapping[str, Any]) -> dict[str, BaseInteraction]:
    """{name: interaction} from a YAML path or a loaded mapping with an `interaction` list."""
    label = "<dict>"
    if isinstance(source, Mapping):
        data: Any = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"interaction config {path} does not exist")
        label, data = str(path), yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, Mapping) or not ({"interaction", "interactions"} & set(data)):
        raise ValueError(f"interaction config {label} must be a mapping with an `interaction` list")
    entries = data.get("interaction", data.get("interactions")) or []
    if not isinstance(entries, list):
        raise ValueError(f"interaction config {label}: `interaction` must be a list")
    out: dict[str, BaseInteraction] = {}
    for i, raw in enumerate(entries):
        try:
            entry = InteractionEntry.model_validate(raw)
            if entry.name in out:
                raise ValueError(f"duplicate interaction name {entry.name!r}")
            out[entry.name] = build_interaction(entry)
        except (ValidationError, ValueError, TypeError) as exc:
            raise ValueError(f"interaction config {label}: entry #{i}: {exc}") from exc
    return out
