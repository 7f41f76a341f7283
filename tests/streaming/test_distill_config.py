"""The `[distill]` table: it reaches the learner and the teacher's engine, and refuses what is not built."""

from __future__ import annotations

import pytest

from streamrl.learner.config import DistillMode
from streamrl.streaming.config import load_config


def test_distill_reaches_the_learner_and_the_teacher_engine():
    cfg = load_config("configs/tiny.toml", ["distill.teacher=smollm2", "distill.mode=mixed", "distill.coef=0.5"])
    assert cfg.distill is not None and cfg.distill.engine.model == "smollm2"
    assert cfg.learner.distill is not None
    assert (cfg.learner.distill.mode, cfg.learner.distill.coef) == (DistillMode.MIXED, 0.5)
    assert cfg.rollout.engine.model == "tiny"  # the student keeps its own model
    assert load_config("configs/tiny.toml", []).learner.distill is None
    served = load_config(
        "configs/tiny.toml",
        ["distill.teacher=tiny", "distill.engine.backend=vllm_server", 'distill.engine.server_urls=["http://h:1"]'],
    )
    assert served.distill is not None and served.distill.engine.backend == "vllm_server"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distill.engine.max_model_len=1024"], "must exceed"),
        (["distill.engine.backend=sglang_server", 'distill.engine.server_urls=["http://h:1"]'], "sglang_server"),
        (
            [
                "distill.engine.backend=vllm_server",
                'distill.engine.server_urls=["http://h:1"]',
                "distill.num_engines=2",
            ],
            "one per",
        ),
        (["distill.coef=0"], "distill.coef"),
        (["distill.mode=forward"], "distill.mode"),
        (["distill.mode=kl", "buffer.filter_uniform_reward_groups=true"], "filter_uniform_reward_groups"),
    ],
)
def test_distill_refuses_what_is_not_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("configs/tiny.toml", ["distill.teacher=tiny", *overrides])
