"""The one registry behind agent loops, tool parsers, interactions and reward functions."""

from __future__ import annotations

import pytest

from streamrl.core.registry import Registry
from streamrl.rollout.agent_loop.base import LOOPS
from streamrl.rollout.interactions.base import INTERACTIONS
from streamrl.rollout.parsers.base import PARSERS
from streamrl.rollout.rewards import REWARDS


def test_register_get_and_errors():
    reg: Registry[object] = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    assert reg.register("a")(a) is a  # the same object again is fine (a module imported twice)
    with pytest.raises(ValueError, match="widget 'a' is already registered by .*a"):
        reg.register("a")(lambda: 2)
    assert reg.get("a") is a and reg.find("b") is None and "a" in reg and reg.names() == ["a"]
    with pytest.raises(ValueError, match=r"unknown widget 'b'; registered: \['a'\], or else"):
        reg.get("b", hint=", or else")


def test_the_four_registries_are_registries():
    import streamrl.rollout.agent_loop  # noqa: F401  (registers the loops)
    from streamrl.rollout.parsers import get_parser

    get_parser("hermes")  # registers the parsers
    assert LOOPS.names() == ["gateway", "single_turn_agent", "tool_agent"]
    assert {"hermes", "gpt-oss", "harmony"} <= set(PARSERS.names())
    assert {"math_answer"} <= set(REWARDS.names())
    assert all(isinstance(r, Registry) for r in (LOOPS, PARSERS, INTERACTIONS, REWARDS))
