"""The routing-replay benchmark's parts (`bench/r3.py`): the near-tied model variant and the summary."""

from __future__ import annotations

import pytest

from bench.r3 import router_variant, summarize


def test_the_variant_scales_the_routers_and_nothing_else(tmp_path):
    from safetensors.torch import load_file

    base = router_variant(1.0, tmp_path)
    scaled = router_variant(0.02, tmp_path)
    assert scaled != base and scaled.parent == tmp_path
    before, after = load_file(base / "model.safetensors"), load_file(scaled / "model.safetensors")
    assert before.keys() == after.keys()
    gates = [name for name in before if name.endswith("mlp.gate.weight")]
    assert len(gates) == 2  # tiny-moe: two sparse layers
    for name, tensor in before.items():
        expected = tensor * 0.02 if name in gates else tensor
        assert (after[name] - expected).abs().max().item() < 1e-6, name


def _run(scale: float, setting: str, seed: int, lag0: list[float | None]) -> dict:
    return {
        "router_scale": scale,
        "setting": setting,
        "seed": seed,
        "exit_code": 0,
        "per_step": {"is/mismatch_kl/lag_0": lag0, "is/mismatch_kl": lag0, "is/ratio_max": [1.0 for _ in lag0]},
        "trained_rows": 8,
        "rows_with_routes": 8 if setting == "replay" else 0,
        "rows_interrupted": 1,
    }


def test_the_summary_averages_steps_then_seeds_and_compares_live_with_replay():
    runs = [
        _run(0.02, "replay", 0, [0.001, 0.003]),
        _run(0.02, "replay", 1, [0.004, None]),  # a step without lag-0 tokens is left out
        _run(0.02, "live", 0, [0.02, 0.04]),
        _run(0.02, "live", 1, [0.06, 0.06]),
        {**_run(1.0, "live", 0, [0.5]), "exit_code": 1},  # a failed run counts for nothing
    ]
    summary = summarize(runs)
    cell = summary["0.02"]
    assert cell["replay"]["is/mismatch_kl/lag_0"] == pytest.approx({"mean": 0.003, "min": 0.002, "max": 0.004})
    assert cell["live"]["is/mismatch_kl/lag_0"] == pytest.approx({"mean": 0.045, "min": 0.03, "max": 0.06})
    assert cell["live_over_replay"] == pytest.approx(15.0)
    assert cell["replay"]["rows_with_routes"] == 16 and cell["live"]["rows_with_routes"] == 0
    assert summary["1"] == {}
