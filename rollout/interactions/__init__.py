"""Interactions: simulated users / environments that respond between assistant turns."""

from __future__ import annotations

from streamrl.rollout.interactions.base import BaseInteraction, load_interaction_config, register_interaction
from streamrl.rollout.interactions.math_feedback import MathFeedbackInteraction

__all__ = ["BaseInteraction", "MathFeedbackInteraction", "load_interaction_config", "register_interaction"]
