"""bench/results/simulator.png: the validation table (predicted against measured, per run and number)
and the projection curves of bench/simulator.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = ("trained_samples_per_hour", "engine_busy_fraction", "learner_idle_fraction", "lag_mean")
SHORT = {
    "trained_samples_per_hour": "samples/h",
    "engine_busy_fraction": "engine busy",
    "learner_idle_fraction": "learner idle",
    "lag_mean": "mean lag",
}


def _validation(ax: Any, table: dict[str, Any], which: str) -> None:
    runs = list(table)
    width = 0.8 / len(METRICS)
    for i, m in enumerate(METRICS):
        rows = [table[r][which][m] for r in runs]
        errs = [max(min(100 * row["rel_error"], 100), -100) if row["measured"] else 0.0 for row in rows]
        ax.bar([j + i * width for j in range(len(runs))], errs, width, label=SHORT[m])
    ax.axhspan(-10, 10, color="green", alpha=0.1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs))])
    ax.set_xticklabels([r + ("*" if table[r]["in_sample"] else "") for r in runs], rotation=20, fontsize=7)
    ax.set_ylabel("predicted vs measured, % (cut at ±100)")
    ax.set_title(f"latest validation, {which.replace('_', ' ')} (* = calibration runs; band ±10 %)", fontsize=9)
    ax.legend(fontsize=6)


def _split(ax: Any, split: dict[str, Any]) -> None:
    for name, modes in split.items():
        for mode, style in (("async", "-o"), ("sync", "--x")):
            rows = modes[mode]
            ax.plot(
                [r["engine_gpus"] / r["gpus"] for r in rows],
                [r["tokens_per_s_per_gpu"] for r in rows],
                style,
                label=f"{name} {mode}",
                markersize=3,
            )
    ax.set_xlabel("engine share of 256 GPUs")
    ax.set_ylabel("trained tokens/s per GPU")
    ax.set_yscale("log")
    ax.set_title("throughput vs engine:learner split", fontsize=9)
    ax.legend(fontsize=6)


def _knobs(ax: Any, knobs: dict[str, Any]) -> None:
    s = knobs["max_staleness"]
    ax.plot([r["max_staleness"] for r in s], [r["samples_per_hour"] / 1e3 for r in s], "-o", label="max_staleness")
    e = knobs["sync_every"]
    ax.plot([r["sync_every"] for r in e], [r["samples_per_hour"] / 1e3 for r in e], "-s", label="sync_every")
    ax.set_xlabel("value")
    ax.set_ylabel("k samples/h")
    ax.set_title(f"{knobs['model']} on {knobs['gpus']} GPUs: staleness, sync cadence", fontsize=9)
    ax.legend(fontsize=6)


def _ratios(ax: Any, ratios: dict[str, Any], areal: dict[str, Any]) -> None:
    models = sorted({k.split("@")[0] for k in ratios}, key=lambda m: float(m.rstrip("B")))
    for m in models:
        keys = [k for k in ratios if k.startswith(m + "@")]
        gpus = [int(k.split("@")[1]) for k in keys]
        ax.plot(gpus, [ratios[k]["async_over_sync"] for k in keys], "-o", markersize=3, label=f"{m} / sync")
        ax.plot(gpus, [ratios[k]["async_over_colocated"] for k in keys], ":x", markersize=3, label=f"{m} / colocated")
    ax.axhspan(2.35, 2.77, color="orange", alpha=0.2, label="published 2.35-2.77x")
    ax.plot([128], [areal["async_over_colocated"]], "k*", markersize=10, label="sim, math workload @128")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("async / sync throughput")
    ax.set_title("async/sync ratio", fontsize=9)
    ax.legend(fontsize=5)


def _pause(ax: Any, pause: dict[str, Any]) -> None:
    names = list(pause)
    for i, (overlap, label) in enumerate((("True", "staged (overlap)"), ("False", "in place"))):
        ax.bar(
            [j + 0.4 * i for j in range(len(names))],
            [100 * pause[n][overlap]["sync_pause_share"] for n in names],
            0.4,
            label=label,
        )
    ax.set_xticks([j + 0.2 for j in range(len(names))])
    ax.set_xticklabels(names)
    ax.set_ylabel("% of time engines paused")
    ax.set_title("weight-sync pause share (256 GPUs, 20 GB/s)", fontsize=9)
    ax.legend(fontsize=6)


def figure(result: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    p = result["projections"]
    _validation(axes[0][0], result["validation"]["table"], "calibrated_on_base")
    _split(axes[0][1], p["split"])
    _knobs(axes[0][2], p["knobs"])
    _ratios(axes[1][0], p["ratios"], p["areal_check"])
    _pause(axes[1][1], p["pause"])
    _validation(axes[1][2], result["validation"]["table"], "calibrated_on_itself")
    fig.suptitle("streamrl pipeline simulator: validation on this machine, projections with published costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
