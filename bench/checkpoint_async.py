"""Checkpoint benchmark: what a learner checkpoint costs the training path, written inline or in the
background (`trainer.async_checkpoint`), on the default config's learner.

    python -m bench.checkpoint_async [--config configs/default.toml] [--rounds 4]
                                     [--out bench/results/checkpoint_async.json]

One `TrainingEngine` built from the config's `[learner]` section (SmolLM2-135M on the default), the
synthetic GRPO batch of `bench.learner`. Each round times, interleaved so a slow spell of the
machine hits every mode alike, a checkpoint followed by one training step:
- `none`: the step alone (no checkpoint);
- `inline`: `save_checkpoint` (snapshot, write, fsync, seal) then the step;
- `background`: `start_checkpoint` (the snapshot) then the step while the writer thread writes,
  then `finish_checkpoint` (whatever of the write the step did not cover).

The training path's cost of a checkpoint is each mode's time minus `none`'s; the saving is inline's
cost minus background's, per checkpoint and per learner step at the config's `checkpoint_every`.
Memory: the process's peak RSS above its level before the checkpoint (sampled every 10 ms), which
for `background` is the snapshot held while the step runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "inline", "background")


class PeakRss:
    """The process's peak resident memory above its level at entry, sampled every 10 ms."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.base = self.peak = _rss()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def above_gb(self) -> float:
        return (self.peak - self.base) / 2**30


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_round(engine, batch, mode: str, folder: Path) -> dict[str, float]:
    """One checkpoint (or none) and one training step; seconds of each part and the RSS above the start."""
    parts: dict[str, float] = {}

    def clock(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        parts[name] = time.perf_counter() - t0

    with PeakRss() as rss:
        t0 = time.perf_counter()
        if mode == "inline":
            clock("checkpoint_s", lambda: engine.save_checkpoint(folder))
        elif mode == "background":
            clock("checkpoint_s", lambda: engine.start_checkpoint(folder))
        clock("step_s", lambda: engine.train_step(batch))
        if mode == "background":
            clock("finish_wait_s", engine.finish_checkpoint)
        parts["total_s"] = time.perf_counter() - t0
    parts["rss_above_gb"] = rss.above_gb
    return parts


def run(config: str, rounds: int, root: Path) -> dict:
    from bench.learner import synthetic_batch
    from streamrl.core.memory import trim_allocator
    from streamrl.learner.engine import TrainingEngine
    from streamrl.streaming.config import load_config

    cfg = load_config(config, [])
    engine = TrainingEngine(cfg.learner)
    batch = synthetic_batch(engine.policy.lm.config.vocab_size)
    engine.train_step(batch)  # warm-up: the optimizer state exists from here on
    engine.save_checkpoint(root / "warm-up")  # and the first write's page-cache and allocator costs are paid
    shutil.rmtree(root / "warm-up")
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else reversed(MODES):
            folder = root / f"{mode}-{i}"
            samples[mode].append(timed_round(engine, batch, mode, folder))
            shutil.rmtree(folder, ignore_errors=True)
            trim_allocator()
            print(f"round {i} {mode}: {samples[mode][-1]}", flush=True)
    engine.save_checkpoint(root / "size")
    size = sum(p.stat().st_size for p in (root / "size").rglob("*") if p.is_file())
    summary = {
        mode: {
            key: statistics.median(s[key] for s in samples[mode])
            for key in samples[mode][0]
            if all(key in s for s in samples[mode])
        }
        for mode in MODES
    }
    step = summary["none"]["total_s"]
    inline_cost = summary["inline"]["total_s"] - step
    background_cost = summary["background"]["total_s"] - step
    every = cfg.trainer.checkpoint_every
    return {
        "config": config,
        "model": cfg.learner.model,
        "checkpoint_every": every,
        "checkpoint_gb": size / 2**30,
        "rounds": rounds,
        "median": summary,
        "samples": samples,
        "training_path_cost_s": {"inline": inline_cost, "background": background_cost},
        "saved_s_per_checkpoint": inline_cost - background_cost,
        "saved_share_of_inline_cost": (inline_cost - background_cost) / inline_cost if inline_cost > 0 else None,
        "saved_s_per_learner_step": (inline_cost - background_cost) / every,
        "step_time_saved_share": (inline_cost - background_cost) / every / step,
        "snapshot_rss_gb": summary["background"]["rss_above_gb"],
    }


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.toml")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", default=str(REPO / "bench/results/checkpoint_async.json"))
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="streamrl-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args.config, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import torch

    result = {
        "command": "python -m bench.checkpoint_async " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(torch=torch.__version__, torch_threads=torch.get_num_threads()),
        "date": time.strftime("%Y-%m-%d"),
        **result,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    cost = result["training_path_cost_s"]
    print(
        f"checkpoint ({result['checkpoint_gb']:.2f} GB): inline costs the training path {cost['inline']:.2f} s, "
        f"background {cost['background']:.2f} s; saved {result['saved_s_per_learner_step']:.2f} s per learner "
        f"step at checkpoint_every={result['checkpoint_every']} ({result['step_time_saved_share']:.1%} of a step); "
        f"snapshot {result['snapshot_rss_gb']:.2f} GB RSS"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
