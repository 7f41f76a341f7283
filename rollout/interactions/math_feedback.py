"""Math feedback interaction: grades the assistant's answer and asks it to retry when wrong.

After each assistant turn that ends without tool calls, the last assistant message is graded with the
same extraction as the `math_answer` reward (last `\\boxed{}`, else the last number; with
`require_boxed` only boxed answers count). Correct -> terminate with turn score 1. Wrong or missing
-> a feedback user message and turn score 0, until `max_attempts` graded turns, then terminate.
`calculate_score` is 1.0 if any attempt was correct. The attempt count survives a process change:
`restore` recounts it from the feedback messages in the chat (a correct attempt ends the episode, so
a resumed one has score 0).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from streamrl.rollout.interactions.base import BaseInteraction, num_replies, register_interaction
from streamrl.rollout.rewards import answers_match, extract_answer, last_boxed


class MathFeedbackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(3, ge=1)
    require_boxed: bool = False
    rel_tol: float = Field(1e-6, ge=0.0)


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


@register_interaction("math_feedback")
class MathFeedbackInteraction(BaseInteraction):
    config_model = MathFeedbackConfig
    config: MathFeedbackConfig

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        ground_truth = kwargs.get("ground_truth")
        if ground_truth is None:
            raise ValueError(f"interaction {self.name!r} needs `ground_truth` in its start kwargs")
        return await super().start_interaction(instance_id, ground_truth=str(ground_truth), num_attempts=0, score=0.0)

    async def restore(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        instance_id = await self.start_interaction(instance_id, **kwargs)
        self.instance_state(instance_id)["num_attempts"] = num_replies(messages)
        return instance_id

    def _answer(self, text: str) -> str | None:
        if self.config.require_boxed:
            boxed = last_boxed(text)
            return boxed.strip() if boxed and boxed.strip() else None
        return extract_answer(text)

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instance_state(instance_id)
        state["num_attempts"] += 1
        attempts_left = self.config.max_attempts - state["num_attempts"]
        answer = self._answer(last_assistant_text(messages))
        extra: dict[str, Any] = {"answer": answer, "num_attempts": state["num_attempts"]}
        if answer is not None and answers_match(answer, state["ground_truth"], rel_tol=self.config.rel_tol):
            state["score"] = 1.0
            return True, "Your answer is correct.", 1.0, extra
        if answer is None:
            feedback = "I could not find a final answer. Please give your final answer as \\boxed{NUMBER}."
        else:
            feedback = f"Your answer {answer} is incorrect."
        if attempts_left <= 0:
            return True, feedback, 0.0, extra
        if answer is not None:
            feedback += " Please re-check your calculation step by step, use the calculator tool, and try again."
        return False, feedback, 0.0, extra

    async def calculate_score(self, instance_id: str) -> float:
        return float(self.instance_state(instance_id)["score"])
