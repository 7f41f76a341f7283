"""Lag is defined once (`core.versions.token_lag`): the buffer (numpy, at consume time) and the
learner's loss (torch, against its own version) compute the same numbers from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.core.versions import token_lag
from streamrl.learner.step_inputs import token_lags


def test_numpy_and_torch_give_the_same_lags():
    rng = np.random.default_rng(0)
    versions = rng.integers(-1, 6, size=(4, 17))  # -1: observation tokens
    expected = np.where(versions >= 0, 7 - versions, -1)
    assert np.array_equal(token_lag(7, versions), expected)
    as_torch = token_lag(7, torch.from_numpy(versions))
    assert isinstance(as_torch, torch.Tensor) and torch.equal(as_torch, torch.from_numpy(expected))


class _Batch:  # the two fields token_lags reads
    def __init__(self, versions, mask):
        self.policy_versions, self.loss_mask = torch.tensor(versions), torch.tensor(mask)


def test_the_learner_uses_the_same_lag_on_action_tokens_and_zero_elsewhere():
    batch = _Batch([[3, 3, -1, 4, 5, -1]], [[1, 1, 0, 1, 1, 0]])
    assert token_lags(batch, 5).tolist() == [[2, 2, 0, 1, 0, 0]]
    with pytest.raises(ValueError, match="policy_version 5 > learner policy_version 4"):
        token_lags(batch, 4)  # a token newer than the learner: a label bug, never a negative lag
