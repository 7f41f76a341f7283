"""Datasets: where prompts come from.

`load_records(source, ...)` is the one entry point: the generated arithmetic word problems
(`loaders.make_arithmetic_dataset`), the generated dot-counting images for a VLM (`dots`), or a
parquet / jsonl file in verl's layout (`loaders.load_prompts`; image rows in `images`). The SFT
warm-up's tool transcripts are generated in `loaders` too.
"""

from __future__ import annotations

from streamrl.rollout.data.loaders import Difficulty, load_prompts, make_arithmetic_dataset
from streamrl.rollout.types import PromptRecord


def load_records(source: str, num_prompts: int, seed: int, difficulty: Difficulty = "medium") -> list[PromptRecord]:
    if source == "arithmetic":
        return make_arithmetic_dataset(num_prompts, seed, difficulty=difficulty)
    if source == "dots":  # image prompts for a VLM policy (rollout/data/dots.py)
        from streamrl.rollout.data.dots import make_dots_dataset

        return make_dots_dataset(num_prompts, seed)
    if source == "verifiers":  # rollout/verifiers/prepare.py replaces it with the dumped split's file
        raise ValueError(
            'data.source = "verifiers" is the environment\'s dataset, written by the preparation phase of '
            "`streamrl train` (into the run directory) or `streamrl rollout`"
        )
    return load_prompts(source)
