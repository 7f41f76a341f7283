"""Benchmarks: `python -m bench.<name>` each, results in bench/results/ (see bench/run_all.py)."""

from __future__ import annotations

import sys

TRAIN_COMMAND = [sys.executable, "-m", "streamrl.streaming.cli", "train"]  # `streamrl train` in a fresh process
