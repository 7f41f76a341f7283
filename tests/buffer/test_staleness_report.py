"""`streamrl staleness`: lags, spans, length bias and reward by lag from a buffer directory alone,
against a buffer whose every number is known."""

from __future__ import annotations

import dataclasses
import json

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.staleness import analyze, write_report
from streamrl.buffer.store import ReplayBuffer
from streamrl.streaming.cli import build_parser
from tests.buffer.helpers import make_traj


def _traj(gid: str, i: int, versions: list[int], reward: float):
    t = make_traj(gid, i, num_response=len(versions), reward=reward)
    return dataclasses.replace(
        t, response_mask=[1] * len(versions), policy_versions=versions, behavior_logprobs=[-0.5] * len(versions)
    )


def _buffer(tmp_path):
    cfg = BufferConfig(root_dir=str(tmp_path / "buffer"), batch_size=2, group_size=2, max_staleness=8)
    buf = ReplayBuffer(cfg)
    buf.append([_traj("a", 0, [1, 1, 2], 1.0), _traj("a", 1, [2, 2], 0.0)])  # oldest tokens v1 and v2
    buf.sample(served_version=3, learner_step=1)  # trajectory lags 2 and 1; token lags 2 2 1 | 1 1
    buf.append([_traj("b", 0, [3] * 6, 1.0), _traj("b", 1, [3] * 6, 1.0)])  # made, never trained
    buf.close()


def test_analyze_a_known_buffer(tmp_path):
    _buffer(tmp_path)
    got = analyze(tmp_path / "buffer")
    assert got["finished_trajectories"] == 4 and got["consumed_trajectories"] == 2 and got["uses"] == 2
    assert got["trajectory_lag_at_consume"] == {"1": 1, "2": 1}
    assert got["token_lag_at_consume"] == {"1": 3, "2": 2}
    assert got["version_span"] == {"0": 3, "1": 1}
    assert got["length"]["generated_mean_tokens"] == (3 + 2 + 6 + 6) / 4
    assert got["length"]["trained_mean_tokens"] == 2.5  # the long ones were never trained: biased short
    assert got["length"]["trained_by_bucket"] == {"2": 1, "4": 1}
    assert got["reward_by_trajectory_lag"] == {"1": {"uses": 1, "mean": 0.0}, "2": {"uses": 1, "mean": 1.0}}


def test_cli_writes_json_and_html(tmp_path, capsys):
    _buffer(tmp_path)
    args = build_parser().parse_args(["staleness", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "trajectory lag at consume: 1:1 2:1" in out
    assert json.loads((tmp_path / "staleness.json").read_text())["uses"] == 2
    page = (tmp_path / "staleness.html").read_text()
    assert "Token lag at consume" in page and "ratio 0.588" in page
    _, _, again = write_report(tmp_path / "buffer")  # a bare buffer directory works too
    assert again["uses"] == 2
