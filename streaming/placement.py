"""Placement: which CPU cores each part's compute threads run on (the `[placement]` table).

On a GPU cluster the engines and the learner have their own devices, and a synchronous trainer
leaves one side idle while the other works. On one CPU machine the stand-in is disjoint cores:
`engine_cores` for the inference engines, `learner_cores` for the learner. Each part pins every
thread of its process to its cores and sizes torch's pool to them (`core.cpu_affinity.pin_process`);
light processes (the driver, the buffer, rollout workers, Ray's own) float.

Unset (the default), every part floats over all cores, which is the colocated placement: in sync
mode the engines and the learner take turns on the whole machine, as verl's hybrid engine does.
With several engines, `engine_cores` is split into `rollout.num_engines` contiguous slices of equal
size, engine i taking slice i (an engine added later by `streamrl scale` shares slice i mod n).

    [placement]
    engine_cores = [0]
    learner_cores = [1]
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from streamrl.engines.config import EngineConfig


class PlacementConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine_cores: list[int] | None = Field(default=None, min_length=1)  # None: engines float on all cores
    learner_cores: list[int] | None = Field(default=None, min_length=1)  # None: the learner floats

    @model_validator(mode="after")
    def _check(self) -> PlacementConfig:
        for name, cores in self.parts().items():
            if min(cores) < 0 or len(set(cores)) != len(cores):
                raise ValueError(f"placement.{name} = {cores}: cores are distinct non-negative ids")
        if self.engine_cores and self.learner_cores and set(self.engine_cores) & set(self.learner_cores):
            shared = sorted(set(self.engine_cores) & set(self.learner_cores))
            raise ValueError(
                f"placement.engine_cores and placement.learner_cores share cores {shared}: a part's cores are its "
                "own (leave both unset for the colocated placement, where every part floats on all cores)"
            )
        return self

    def parts(self) -> dict[str, list[int]]:
        """{field name: cores} of the parts that are placed."""
        placed = {"engine_cores": self.engine_cores, "learner_cores": self.learner_cores}
        return {name: cores for name, cores in placed.items() if cores is not None}

    @property
    def dedicated(self) -> bool:
        return bool(self.parts())

    def engine_slice(self, index: int, num_engines: int) -> list[int] | None:
        """The cores of engine `index` of `num_engines` (None when engines float)."""
        if self.engine_cores is None:
            return None
        if len(self.engine_cores) % num_engines:
            raise ValueError(
                f"placement.engine_cores has {len(self.engine_cores)} cores for {num_engines} engines: "
                "give each engine the same number of cores"
            )
        width = len(self.engine_cores) // num_engines
        start = (index % num_engines) * width
        return self.engine_cores[start : start + width]

    def engine_config(self, engine_cfg: EngineConfig, index: int, num_engines: int) -> EngineConfig:
        """`engine_cfg` with engine `index`'s cores (unchanged when engines float)."""
        cores = self.engine_slice(index, num_engines)
        return engine_cfg if cores is None else engine_cfg.model_copy(update={"cpu_cores": cores})

    def check_machine(self) -> None:
        """ValueError unless every placed core exists and is allowed to this process (the driver's
        node; an engine on another node checks its own cores when it pins)."""
        allowed = os.sched_getaffinity(0)
        for name, cores in self.parts().items():
            missing = sorted(set(cores) - allowed)
            if missing:
                raise ValueError(
                    f"placement.{name} = {cores}: cores {missing} are not on this machine "
                    f"(os.cpu_count() = {os.cpu_count()}, allowed {sorted(allowed)})"
                )


def pin_part(cores: list[int]) -> None:
    """Pin this process (a part's actor) to `cores` and size torch's intra-op pool to them, one
    compute thread per core; called before the part starts its model (vLLM fixes the pool size)."""
    import torch

    from streamrl.core.cpu_affinity import pin_process

    torch.set_num_threads(len(pin_process(cores)))
