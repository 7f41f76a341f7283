"""Rewards a model can raise in tens of steps, for end-to-end learning checks.

A random tiny model cannot learn arithmetic in a CI budget, but it can shift its token distribution.
`digit_share` rewards the share of digit characters in what the policy wrote: under the untrained
tiny model it is about a fifth, and only a working loop of sampling, buffer, learner and weight sync
raises it. Every such reward is prompt-independent, so any held-out prompt set measures it.
"""

from __future__ import annotations

from streamrl.rollout.rewards import RewardInput, register_reward


@register_reward("digit_share")
def digit_share(inp: RewardInput) -> float:
    """Digits / non-whitespace characters of the assistant's text (0 for an empty answer)."""
    chars = [c for c in inp.response_text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
