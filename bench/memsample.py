"""Per-part memory of a running `streamrl train` job, sampled from outside by process title.

Ray names its actor processes `ray::<ActorClass>...`; the driver is the `streamrl train` process
itself; vLLM's engine core (when it runs as a subprocess) is `VLLM::EngineCore`. A background thread
samples the RSS of every process in the job's session every `period_s` and keeps, per part, the peak
RSS of one process and the peak of the sum over all the job's processes (the node's share).
"""

from __future__ import annotations

import threading
import time

import psutil

PARTS = {
    "learner": ("LearnerActor", "LearnerWorker", "PublishingLearnerWorker"),
    "engine": ("EngineActor", "EngineCore"),
    "rollout_worker": ("RolloutWorkerActor",),
    "buffer": ("BufferActor",),
    "sft": ("streaming.sft",),
}


def part_of(proc: psutil.Process) -> str:
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    for part, names in PARTS.items():
        if any(n in title for n in names):
            return part
    if "streamrl" in title and "train" in title:
        return "driver"
    if title.startswith("ray::") or "raylet" in title or "gcs_server" in title or "ray/" in title:
        return "ray_system"
    return "other"


class MemorySampler:
    """Samples the processes of session `sid` (the job's `start_new_session`) until `stop()`."""

    def __init__(self, sid: int, period_s: float = 1.0) -> None:
        self.sid = sid
        self.period_s = period_s
        self.peak_gb: dict[str, float] = {}  # part -> peak RSS of one process of that part
        self.node_peak_gb = 0.0  # peak of the summed RSS of every process of the job
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        return {
            "node_peak_gb": round(self.node_peak_gb, 3),
            "part_peak_gb": {k: round(v, 3) for k, v in sorted(self.peak_gb.items())},
            "samples": self.samples,
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0.0
            for proc in psutil.process_iter(["pid"]):
                try:
                    import os

                    if os.getsid(proc.pid) != self.sid:
                        continue
                    rss = proc.memory_info().rss / 2**30
                except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
                    continue
                part = part_of(proc)
                total += rss
                self.peak_gb[part] = max(self.peak_gb.get(part, 0.0), rss)
            self.node_peak_gb = max(self.node_peak_gb, total)
            self.samples += 1
            self._stop.wait(self.period_s)


def sample_run(
    cmd: list[str], *, cwd: str, env: dict[str, str], log_path: str, timeout_s: float
) -> tuple[int | None, float, dict]:
    """Run `cmd` in a new session while sampling it; returns (rc or None on timeout, wall s, memory)."""
    import os
    import signal
    import subprocess

    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = MemorySampler(proc.pid).start()
        try:
            rc: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        memory = sampler.stop()
    return rc, time.monotonic() - t0, memory
