"""Two Ray nodes on one machine (`bench/two_node.py`): the engine on one node, the learner on the
other, placed by custom resources only; weight sync finds its rendezvous address by itself. Runs the
bench in a child process: it starts its own two-node cluster, separate from the session's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]


@pytest.mark.timeout(900)
def test_engine_and_learner_on_two_nodes_train_and_sync(tmp_path):
    out = tmp_path / "two_node.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.two_node", "--steps", "2", "--out", str(out), "--keep", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    log = tmp_path / "run" / "train.log"
    assert proc.returncode == 0, (
        proc.stdout[-3000:],
        proc.stderr[-3000:],
        log.read_text()[-4000:] if log.exists() else "",
    )
    result = json.loads(out.read_text())["result"]  # bench.two_node.check_run raised on any failed check
    assert result["num_nodes"] == 2 and result["learner_step"] == 2 and result["policy_version"] == 2
    assert set(result["engine_nodes"]).isdisjoint(result["learner_nodes"])
    assert result["buffer_node"] == result["driver_node"] and result["syncs_failed"] == 0
