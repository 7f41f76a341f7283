"""Buffer recovery time against log size: how long reopening a run's buffer takes after N groups.

    python -m bench.recovery [--groups 500 2000 8000] [--out bench/results/recovery.json]

For each N it writes a real durable buffer log the way a run does: every group is admitted as 8
PENDING partial rows (prompt only, with their AgentData), then its 8 finished rows (32 prompt + 96
response tokens), and the learner samples every complete batch (64 trajectories), so the log also
holds a consumption record per step. Then it times `ReplayBuffer(cfg)` on that directory (recovery
replays the consumption log and every trajectory frame, verifying checksums), median of
`--repeats`, each in a fresh process after a warm-up open of an empty directory, and records the
log's size on disk, the rows and frames recovered, and the resident memory the reopened buffer
holds. Recovery reads the whole log, so time and memory are expected to grow linearly with N; this measures the slope,
it changes nothing in `buffer/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.machine import machine
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import RECORD_FIELDS, normalize_batch
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import AgentData

PROMPT, RESPONSE, GROUP, BATCH, GROUPS_PER_CHUNK = 32, 96, 8, 64, 64


def _lists(values: np.ndarray, width: int) -> pa.ListArray:
    n = values.shape[0]
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * width), pa.array(values.ravel()))


def _batch(first_group: int, num_groups: int, *, partial: bool, rng: np.random.Generator) -> pa.RecordBatch:
    """`num_groups` groups of GROUP rows: PENDING partial rows (prompt only) or finished ones."""
    n = num_groups * GROUP
    ids = [f"g{first_group + i // GROUP}@e0/{i % GROUP}" for i in range(n)]
    groups = [f"g{first_group + i // GROUP}@e0" for i in range(n)]
    prompt = rng.integers(0, 50000, (n, PROMPT), dtype=np.int32)
    width = 0 if partial else RESPONSE
    mask = np.ones((n, width), dtype=np.int8)
    cols = {
        "trajectory_id": pa.array(ids),
        "group_id": pa.array(groups),
        "sample_index": pa.array(np.arange(n, dtype=np.int32) % GROUP),
        "agent_name": pa.array(["tool_agent"] * n),
        "prompt_ids": _lists(prompt, PROMPT),
        "response_ids": _lists(rng.integers(0, 50000, (n, width), dtype=np.int32), width),
        "response_mask": _lists(mask, width),
        "behavior_logprobs": _lists(-rng.random((n, width)).astype(np.float32), width),
        "policy_versions": _lists(np.zeros((n, width), dtype=np.int32), width),
        "reward": pa.array(rng.random(n)),
        "status": pa.array(["partial" if partial else "finished"] * n),
        "finish_reason": pa.array(["abort" if partial else "stop"] * n),
        "agent_data_json": pa.array(
            [
                AgentData(trajectory_id=t, group_id=g, sample_index=i % GROUP, prompt_ids=prompt[i].tolist()).to_json()
                if partial
                else None
                for i, (t, g) in enumerate(zip(ids, groups))
            ],
            pa.string(),
        ),
    }
    for f in RECORD_FIELDS:
        if f.name not in cols:
            cols[f.name] = pa.array([[]] * n, f.type) if pa.types.is_list(f.type) else pa.array(np.zeros(n), f.type)
    return normalize_batch(pa.RecordBatch.from_pydict(cols))


def _cfg(root: Path) -> BufferConfig:
    return BufferConfig(root_dir=str(root), batch_size=BATCH, group_size=GROUP, max_staleness=10**6)


def write_log(root: Path, num_groups: int, seed: int = 0) -> int:
    """A run's log of `num_groups` groups (admitted, finished, consumed); returns learner steps taken."""
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer(_cfg(root))
    step = 0
    for first in range(0, num_groups, GROUPS_PER_CHUNK):
        count = min(GROUPS_PER_CHUNK, num_groups - first)
        buf.append(_batch(first, count, partial=True, rng=rng), durable=True)
        buf.append(_batch(first, count, partial=False, rng=rng))
        while buf.sample(served_version=0, learner_step=step + 1) is not None:
            step += 1
    buf.checkpoint()
    buf.close()
    return step


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


_CHILD = """
import json, sys, tempfile, time
from pathlib import Path
from bench.recovery import _cfg
from streamrl.buffer.store import ReplayBuffer

def rss_mb():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS"))
    return int(line.split()[1]) / 1024

with tempfile.TemporaryDirectory() as empty:  # warm-up: lazy imports and first-use costs are not recovery
    ReplayBuffer(_cfg(Path(empty) / "b")).close()
before = rss_mb()
t0 = time.perf_counter()
buf = ReplayBuffer(_cfg(Path(sys.argv[1])))
elapsed = time.perf_counter() - t0
r = buf.recovery_report
print(json.dumps({"reopen_s": elapsed, "rss_growth_mb": rss_mb() - before,
                  "num_rows": r.num_rows, "num_frames": r.num_frames, "num_segments": r.num_segments,
                  "num_consumption_records": r.num_consumption_records, "clean": r.clean}))
buf.close()
"""


def time_reopen(root: Path, repeats: int) -> dict:
    """Median wall time of `ReplayBuffer(cfg)` on `root` (recovery), each in a fresh process, the RSS
    it added, and what it recovered."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = runs[0]
    return {
        "reopen_s_median": statistics.median(r["reopen_s"] for r in runs),
        "reopen_s_min": min(r["reopen_s"] for r in runs),
        "reopen_s_all": [r["reopen_s"] for r in runs],
        "rss_growth_mb_median": statistics.median(r["rss_growth_mb"] for r in runs),
        "num_rows_recovered": first["num_rows"],
        "num_frames": first["num_frames"],
        "num_consumption_records": first["num_consumption_records"],
        "clean": first["clean"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/recovery.json")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="streamrl-recovery-") as tmp:
        for n in args.groups:
            root = Path(tmp) / f"n{n}"
            t0 = time.perf_counter()
            steps = write_log(root, n)
            write_s = time.perf_counter() - t0
            row = {
                "num_groups": n,
                "num_trajectories": n * GROUP,
                "learner_steps": steps,
                "write_s": write_s,
                "log_mb": _disk_bytes(root) / 2**20,
                **time_reopen(root, args.repeats),
            }
            row["reopen_us_per_row"] = 1e6 * row["reopen_s_median"] / max(row["num_rows_recovered"], 1)
            results.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(root)
    out = {
        "command": "python -m bench.recovery " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(pyarrow=pa.__version__, loadavg_at_end=list(os.getloadavg())),
        "setup": {
            "group_size": GROUP,
            "batch_size": BATCH,
            "prompt_tokens": PROMPT,
            "response_tokens": RESPONSE,
            "rows_per_group": 2 * GROUP,
            "note": "every group admitted (partial rows), finished and consumed",
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
