"""The offline HTML report from a synthetic run directory: plots present, trajectory tokens coloured by
mask and policy_version with the version change visible, tool text escaped, robust to a killed run."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pandas as pd
import pytest

from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.core.versions import lag_fractions, lag_histogram
from streamrl.observability.metrics import MetricsLogger, summarize
from streamrl.observability.report import load_run, write_report
from streamrl.observability.report_figures import busy_fractions, per_step, resume_points, union_length
from streamrl.observability.report_tokens import FastTokenizerFile, decode_pieces, load_tokenizer
from streamrl.observability.report_viewer import pick_samples
from streamrl.rollout.types import Trajectory

CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call><|im_end|>'
OBS_TEXT = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ANSWER_TEXT = "The answer is \\boxed{3}.<|im_end|>"
START = time.time() - 60.0


def _trajectory(tok, tid: str, *, versions: tuple[int, int]) -> Trajectory:
    """Assistant tool call interrupted halfway (version change), tool observation, final answer."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True)
    call, obs, answer = (tok.encode(t, add_special_tokens=False) for t in (CALL_TEXT, OBS_TEXT, ANSWER_TEXT))
    half = len(call) // 2
    ids = call + obs + answer
    mask = [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    pv = [versions[0]] * half + [versions[1]] * (len(call) - half) + [-1] * len(obs) + [versions[1]] * len(answer)
    return Trajectory(
        trajectory_id=tid,
        group_id="g1",
        sample_index=0,
        agent_name="tool_agent",
        prompt_ids=list(prompt if isinstance(prompt, list) else prompt["input_ids"]),
        response_ids=ids,
        response_mask=mask,
        behavior_logprobs=[-0.1 if m else 0.0 for m in mask],
        policy_versions=pv,
        reward=1.0,
        num_turns=3,
        num_tool_calls=1,
        num_interrupts=1,
    )


def _write_run(run_dir, tok, model_path, *, num_steps: int = 6) -> None:
    info = RunInfo(
        run_name="synthetic", model_path=str(model_path), mode="async", config={"lr": 1e-5}, started_at=START
    )
    RunDir(run_dir).write_info(info)
    with MetricsLogger(run_dir, wandb_cfg=None, console=False, started_at=START) as ml:
        for step in range(1, num_steps + 1):
            hist = lag_histogram(np.array([0] * step + [1] * 3 + [2] + [5]), max_lag=2)
            ml.log(
                {
                    "rollout/reward_mean": 0.1 * step,
                    "rollout/tokens_per_s": 200.0,
                    "rollout/num_finished": 8,
                    "rollout/num_partial": 2,
                    "rollout/num_resumed": 1,
                    "rollout/response_len_mean": 30 + step,
                    "buffer/occupancy": 0.5,
                    "learner/loss": 1.0 / step,
                    "learner/grad_norm": 0.5,
                    "learner/idle_ratio": 0.1,
                    "engine/busy_fraction": 0.97,
                    "engine/busy_fraction/engine-0": 0.97,
                    "is/ratio_mean": 1.0,
                    "is/ratio_mean/lag_0": 1.0,
                    "is/ratio_mean/lag_1": 0.9,
                    "is/clip_frac/lag_1": 0.2,
                    "sync/pause_s": 0.1,
                    "sync/transfer_s": 0.3,
                    "sync/resume_s": 0.05,
                    "sync/total_s": 0.45,
                    "custom/thing": step,
                    "memory/learner_peak_gb": 2.0 + step / 10,
                    "memory/learner_rss_gb": 1.5,
                    "memory/engine_peak_gb": 4.25,
                    "memory/driver_peak_gb": 0.5,
                    **lag_fractions(hist, "staleness/lag_frac/batch/"),
                    **summarize([0, 1, step], prefix="staleness/lag_"),
                },
                learner_step=step,
                policy_version=step,
            )
            ml.span("generate", "engine-0", step - 1.0, step - 0.1)
            ml.span("generate", "engine-0", step - 0.8, step - 0.05)  # overlapping requests
            ml.span("tool", "engine-0", step - 0.1, step)
            ml.span("train", "learner", step - 0.6, step - 0.2)
            ml.span("sync", "learner", step - 0.2, step - 0.1)
            ml.span("idle", "learner", step - 1.0, step - 0.6)
        ml.sample(_trajectory(tok, "traj-mixed", versions=(3, 4)), learner_step=5)
        ml.sample(_trajectory(tok, "traj-plain", versions=(6, 6)), learner_step=6)


@pytest.mark.timeout(60)
def test_report_from_synthetic_run(tmp_path, tiny_model_path, tiny_tokenizer):
    _write_run(tmp_path, tiny_tokenizer, tiny_model_path)
    out = write_report(tmp_path)
    assert out == tmp_path / "report.html"
    html = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # offline: nothing fetched, no CDN
    assert "<script" not in html and "<link" not in html
    for anchor in ("rollout", "throughput", "learner", "memory", "staleness", "timeline", "sync", "is", "other"):
        section = html.split(f'<h2 id="{anchor}">', 1)[1].split("<h2", 1)[0]
        assert "<svg" in section, f"figure {anchor} missing"
    assert "custom/thing" in html  # metrics no dedicated figure shows still get a panel
    assert "engine-0 (" in html and "% busy)" in html
    # trajectory viewer: tool text escaped, tokens coloured by mask and version, version change marked
    assert "&lt;tool_call&gt;" in html and "&lt;tool_response&gt;" in html
    assert "<tool_call>" not in html and "<tool_response>" not in html
    assert 'class="tok v3' in html and 'class="tok v4' in html and 'class="tok obs' in html
    assert html.count('<span class="vchg">v3→v4</span>') == 1  # traj-plain has no version change
    assert 'class="tok v4 call"' in html and 'class="tok v4 special"' in html  # tool call and <|im_end|>
    assert "policy_version 3 · lag 2" in html  # sampled at v3, consumed at learner step 5
    assert "calculator" in html and "Incomplete run data" not in html
    summary = dict(
        re.findall(r"<tr><td>([^<]+)</td><td>([^<]*)</td></tr>", html.split('id="summary"')[1].split("<h2")[0])
    )
    assert summary["learner steps"] == "6" and summary["trajectories finished"] == "48"
    assert summary["initial reward (mean of first 3 steps)"] == "0.200"
    assert summary["final reward (mean of last 3 steps)"] == "0.500"
    assert summary["engine busy fraction (mean)"] == "97.0%"
    assert summary["weight syncs (count, mean total s)"] == "6, 0.450"
    assert summary["peak memory by part (GiB)"] == "driver 0.50, engine 4.25, learner 2.60"  # max over steps


@pytest.mark.timeout(60)
def test_report_survives_a_killed_run(tmp_path, tiny_model_path, tiny_tokenizer):
    _write_run(tmp_path, tiny_tokenizer, tiny_model_path, num_steps=2)
    (tmp_path / "timeline.jsonl").unlink()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"time": 1, "learner_step": 3, "rollout/rew')  # torn by SIGKILL
    info = json.loads((tmp_path / "run_info.json").read_text())
    info["model_path"] = str(tmp_path / "moved-model")
    (tmp_path / "run_info.json").write_text(json.dumps(info))
    html = write_report(tmp_path).read_text()
    assert "Incomplete run data" in html
    assert "timeline.jsonl is missing" in html and "skipped 1 unreadable line" in html
    assert "moved-model not found" in html and "⟨" in html  # falls back to token ids
    rollout = html.split('<h2 id="rollout">', 1)[1].split("<h2", 1)[0]
    assert "<svg" in rollout


def test_report_of_an_empty_run_dir(tmp_path):
    html = write_report(tmp_path).read_text()
    assert "run_info.json is missing" in html and "metrics.jsonl is missing" in html
    assert "no sampled trajectories" in html
    with pytest.raises(ValueError, match="does not exist"):
        write_report(tmp_path / "nope")


def test_resume_duplicates_average_per_step(tmp_path):
    with MetricsLogger(tmp_path, wandb_cfg=None, console=False, started_at=0.0) as ml:
        for step, reward in [(1, 0.0), (2, 1.0), (2, 3.0)]:  # step 2 redone after a resume
            ml.log({"rollout/reward_mean": reward}, learner_step=step, policy_version=step)
    data = load_run(tmp_path)
    assert per_step(data.metrics, "rollout/reward_mean").to_dict() == {1: 0.0, 2: 2.0}
    assert resume_points(data.metrics) == []
    data.metrics.loc[len(data.metrics)] = {"learner_step": 1, "elapsed_s": 9.0, "rollout/reward_mean": 0.5}
    assert resume_points(data.metrics) == [9.0]


def test_interval_helpers():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([]) == 0
    spans = pd.DataFrame(
        [
            {"kind": "generate", "who": "engine-0", "start": 0.0, "end": 6.0},
            {"kind": "generate", "who": "engine-0", "start": 4.0, "end": 8.0},
            {"kind": "idle", "who": "learner", "start": 0.0, "end": 5.0},
            {"kind": "train", "who": "learner", "start": 5.0, "end": 10.0},
        ]
    )
    assert busy_fractions(spans) == {"engine-0": 0.8, "learner": 0.5}


def test_decode_pieces_join_to_full_text(tiny_model_path, tiny_tokenizer):
    raw = load_tokenizer(str(tiny_model_path), problems := [])
    assert isinstance(raw, FastTokenizerFile) and not problems
    assert sorted(raw.all_special_ids) == sorted(tiny_tokenizer.all_special_ids)
    for text in (CALL_TEXT + OBS_TEXT, "héllo ✓ 数学 🙂 done"):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        full = tiny_tokenizer.decode(ids, skip_special_tokens=False)
        pieces = decode_pieces(tiny_tokenizer, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == full and "\ufffd" not in full
        assert decode_pieces(raw, ids) == pieces  # tokenizer.json decodes exactly like transformers


def test_decode_pieces_fallback_for_split_characters(tiny_tokenizer):
    ids = tiny_tokenizer.encode("数学🙂", add_special_tokens=False)
    one_by_one = tiny_tokenizer.batch_decode([[i] for i in ids])
    assert "\ufffd" in "".join(one_by_one)  # byte-level tokens split the characters
    pieces = decode_pieces(tiny_tokenizer, ids)
    assert "".join(pieces) == "数学🙂" and "" in pieces  # completed by the token that ends each char


def test_pick_samples_prefers_version_changes():
    plain = [{"response_mask": [1, 1], "policy_versions": [1, 1], "i": i} for i in range(10)]
    mixed = [{"response_mask": [1, 1], "policy_versions": [1, 2], "i": 100 + i} for i in range(3)]
    rows = plain[:5] + mixed + plain[5:]
    picked = pick_samples(rows, 4)  # 2 with version changes, 2 spread over the rest, in file order
    assert [r["i"] for r in picked] == [0, 100, 101, 9]
    assert pick_samples(rows[:3], 4) == rows[:3]


def test_unloadable_tokenizer_is_a_problem_not_a_crash(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    problems: list[str] = []
    assert load_tokenizer(str(tmp_path), problems) is None
    assert "could not be loaded" in problems[0]
    assert load_tokenizer(None, problems) is None and "no model_path" in problems[1]
