"""Interactions: simulated users / environments that respond between assistant turns."""

from __future__ import annotations

from rollout.interactions.base import BaseInteraction, load_interaction_config, register_interaction
from rollout.interactions.math_feedback import MathFeedbackInteraction

__all__ = ["BaseInteraction", "MathFeedbackInteraction", "load_interaction_config", "register_interaction"]
