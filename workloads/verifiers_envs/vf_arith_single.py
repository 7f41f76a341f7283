"""A `SingleTurnEnv`: one answer per arithmetic question, scored by its boxed number.

streamrl: [rollout.agent.verifiers] environment = "vf_arith_single", paths = ["workloads/verifiers_envs"]
"""

from __future__ import annotations

import verifiers as vf  # pyrefly: ignore[missing-import]
from vf_arith_common import SYSTEM_PROMPT, boxed_answer, correct_answer, make_dataset  # pyrefly: ignore[missing-import]


def load_environment(num_train: int = 64, num_eval: int = 16, seed: int = 0) -> vf.Environment:
    parser = vf.Parser(extract_fn=boxed_answer)
    return vf.SingleTurnEnv(
        dataset=make_dataset(num_train, seed),
        eval_dataset=make_dataset(num_eval, seed + 1),
        system_prompt=SYSTEM_PROMPT,
        parser=parser,
        rubric=vf.Rubric(funcs=[correct_answer], parser=parser),
    )
