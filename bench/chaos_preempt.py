"""The `preempt` chaos family: engines come and go during a real `streamrl train` run.

    python -m bench.chaos --families preempt [--seeds 1] [--keep DIR]

One run (tiny model, 2 engines) driven from outside, as an operator or a cloud would:
`streamrl scale RUN_DIR --engines 3` once the first step is trained, a preemption notice for
engine-0 (`streamrl scale RUN_DIR --preempt engine-0`) once engine-2 serves, then one of the
remaining engine actor processes SIGKILLed without notice once engine-0 was drained. The run must
finish and pass the invariant checker like every chaos run (0 lost, 0 stranded, versions right: no
sampled token below version 0, i.e. none from an engine that had not yet received a published policy).
The counts come from the driver's log (`streaming.elastic` lines) and the checker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from streamrl.core.run_dir import RunDir
from streamrl.observability.logs import DRIVER_LOG
from streamrl.streaming.driver_state import DriverState

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["rollout.num_engines=2", "trainer.total_steps=40", "trainer.checkpoint_every=10"]
JOINED = re.compile(r"engine (engine-\d+) serves policy_version -?\d+: into routing")
DRAINED = re.compile(r"engine (engine-\d+) preempted: (\d+) generations went on elsewhere")
DEAD = re.compile(r"engine (engine-\d+) is dead")


def _scale(run_dir: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "streamrl.streaming.cli", "scale", str(run_dir), *args]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=60)


def _engine_processes(pid: int) -> list:
    """The engine actor processes of the job rooted at `pid`, oldest first."""
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineActor" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.create_time())


def _learner_step(run_dir: Path) -> int:
    try:
        return DriverState.load(RunDir(run_dir).driver_state).learner_step
    except (OSError, ValueError, TypeError):
        return -1


def _drive(proc: subprocess.Popen, run_dir: Path, deadline: float) -> dict:
    """Act on the run as it goes: scale up, preempt, kill. Returns what was done and when (seconds)."""
    t0, done, log = time.monotonic(), {}, RunDir(run_dir).logs / DRIVER_LOG
    while proc.poll() is None and time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "scale_up" not in done and _learner_step(run_dir) >= 1:
            _scale(run_dir, "--engines", "3")
            done["scale_up"] = time.monotonic() - t0
        elif "preempt" not in done and "engine-2" in JOINED.findall(text):
            _scale(run_dir, "--preempt", "engine-0")
            done["preempt"] = time.monotonic() - t0
        elif "drained" not in done and DRAINED.search(text):
            done["drained"] = time.monotonic() - t0
        elif "kill" not in done and "drained" in done and time.monotonic() - t0 > done["drained"] + 3.0:
            engines = _engine_processes(proc.pid)  # the drained engine's process is gone by now
            if engines:
                os.kill(engines[0].pid, signal.SIGKILL)
                done["kill"] = time.monotonic() - t0
        time.sleep(0.5)
    return done


def run_preempt(seed: int, root: Path, timeout_s: float) -> dict:
    from bench.chaos import OVERRIDES as BASE
    from streamrl.streaming.invariants import check_run

    run_name = f"preempt-s{seed}"
    run_dir, log = root / run_name, root / f"{run_name}.log"
    args = ["--config", "configs/tiny.toml", f"trainer.run_root={root}", f"trainer.run_name={run_name}"]
    args += [f"trainer.seed={seed}", *BASE, *OVERRIDES]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "streamrl.streaming.cli", "train", *args]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            actions = _drive(proc, run_dir, t0 + timeout_s)
            rc = proc.wait(max(1.0, t0 + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
    text = (RunDir(run_dir).logs / DRIVER_LOG).read_text(errors="replace") if run_dir.exists() else ""
    drained = [(e, int(n)) for e, n in DRAINED.findall(text)]
    result = {
        "name": "preempt",
        "seed": seed,
        "rc": rc,
        "wall_s": round(time.monotonic() - t0, 1),
        "hangs": int(rc is None),
        "completed": rc == 0,
        "actions_at_s": {k: round(v, 1) for k, v in actions.items()},
        "engines_joined": JOINED.findall(text),
        "engines_preempted": [e for e, _ in drained],
        "generations_handed_back": sum(n for _, n in drained),
        "engines_killed": DEAD.findall(text),
        "faults_injected": len(drained) + len(DEAD.findall(text)),
    }
    if RunDir(run_dir).driver_state.exists():
        result["invariants"] = asdict(check_run(run_dir))
    return result
