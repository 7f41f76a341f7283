"""The driver's part of a whole-system checkpoint: learner step, the served policy version and its
label offset, the data cursor (with the prompts the prompt filter skipped) and the checkpoints kept.
Saved atomically and fsynced as RUN_DIR/driver_state.json after every admitted group and checkpoint;
`--resume` starts from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from streamrl.core.atomic import atomic_write
from streamrl.core.versions import PolicyVersion
from streamrl.streaming.checkpoints import CheckpointRecord


@dataclass(kw_only=True)
class DriverState:
    """The driver's part of a whole-system checkpoint (JSON, written atomically and fsynced)."""

    learner_step: int = 0
    policy_version: int = 0  # version label of the weights the engines serve
    # Version labels never repeat across restarts: a resume rewinds the learner to its checkpoint but
    # labels its weights above every version ever handed out (`version_high_water`), so
    # label = learner step of the weights + version_offset.
    version_offset: int = 0
    version_high_water: int = 0
    cursor: int = 0  # prompts admitted (saved once the admitted group's rows are durable)
    num_admitted: int = 0  # trajectories admitted
    # Prompts the prompt filter passed over (streaming.prompt_filter), saved with the cursor past them.
    num_prompts_skipped_easy: int = 0
    num_prompts_skipped_hard: int = 0
    checkpoint: str | None = None  # directory of the latest complete checkpoint
    checkpoint_step: int = 0  # learner_step / policy_version of that checkpoint: a resume restarts there
    checkpoint_policy_version: int = 0
    checkpoint_version_offset: int = 0  # version_offset when it was taken: its weights' label - step
    checkpoints: list[CheckpointRecord] = field(default_factory=list)  # kept ones, oldest first (streaming.checkpoints)
    elapsed_s: float = 0.0  # wall time of earlier segments of this run

    def rewind_to_checkpoint(self, max_version_seen: int = 0) -> None:
        """On resume: the learner restarts from its checkpoint; the cursor stays (data is in the buffer).

        The checkpoint's weights get a fresh label above every version used before the crash (the
        saved high-water mark and `max_version_seen` in the recovered buffer), so no label names two
        different weights and versions never decrease inside a resumed trajectory."""
        self.learner_step = self.checkpoint_step
        checkpoint_label = PolicyVersion(self.checkpoint_step, self.checkpoint_version_offset).label
        self.version_high_water = max(self.version_high_water, max_version_seen, self.policy_version)
        if self.version_high_water <= checkpoint_label:  # no label beyond the checkpoint was used
            self.policy_version = checkpoint_label
            self.version_offset = self.checkpoint_version_offset
            return
        self.policy_version = self.version_high_water + 1
        self.version_offset = self.policy_version - self.checkpoint_step
        self.version_high_water = self.policy_version

    @property
    def served_step(self) -> int:
        """Learner step of the weights the engines serve (admission counts in steps, not labels)."""
        return PolicyVersion.of_label(self.policy_version, self.version_offset).step

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(asdict(self)), sync=True)

    @classmethod
    def load(cls, path: Path) -> DriverState:
        data = json.loads(path.read_text())
        return cls(**data | {"checkpoints": [CheckpointRecord(**r) for r in data.get("checkpoints", [])]})
