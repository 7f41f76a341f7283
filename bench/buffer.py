"""Replay-buffer benchmark: append throughput vs raw Arrow IPC, sample latency, memory.

    python -m bench.buffer [--rows 2048] [--out bench/results/buffer.json]

Measures, on the same synthetic batches (prompt 256 + response 768 tokens per row, 64 rows a batch):
- append rows/s and tokens/s into a durable `ReplayBuffer` (log on, flush every 256 rows, checksums),
  against a raw `pyarrow.ipc` stream write of the same batches to the same disk (ratio; target
  >= 0.5); both also with a final fsync;
- `sample` latency p50/p99 with >= 1M tokens live (groups of 8, batches of 64 trajectories,
  consumption logged), and `to_padded` latency;
- memory held by the buffer (Arrow buffers + per-row arrays + Python bookkeeping traced during the
  appends) against the raw column bytes (target <= 1.3x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.machine import machine
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import RECORD_FIELDS, normalize_batch
from streamrl.buffer.store import ReplayBuffer

PROMPT, RESPONSE, ROWS_PER_BATCH, GROUP = 256, 768, 64, 8


def _lists(values: np.ndarray, width: int) -> pa.ListArray:
    """A [n, width] array as n lists of `width` values each."""
    n = values.shape[0]
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * width), pa.array(values.ravel()))


def make_batches(num_rows: int, seed: int = 0) -> list[pa.RecordBatch]:
    """Synthetic trajectory batches built column-wise (no per-row Python)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(num_rows // ROWS_PER_BATCH):
        n = ROWS_PER_BATCH
        mask = (rng.random((n, RESPONSE)) < 0.8).astype(np.int8)
        versions = np.where(mask == 1, b // 4, -1).astype(np.int32)
        logprobs = np.where(mask == 1, -rng.random((n, RESPONSE)), 0).astype(np.float32)
        ids = [f"t{b}-{i}" for i in range(n)]
        cols = {
            "trajectory_id": pa.array(ids),
            "group_id": pa.array([f"g{b}-{i // GROUP}" for i in range(n)]),
            "sample_index": pa.array(np.arange(n, dtype=np.int32) % GROUP),
            "agent_name": pa.array(["tool_agent"] * n),
            "prompt_ids": _lists(rng.integers(0, 50000, (n, PROMPT), dtype=np.int32), PROMPT),
            "response_ids": _lists(rng.integers(0, 50000, (n, RESPONSE), dtype=np.int32), RESPONSE),
            "response_mask": _lists(mask, RESPONSE),
            "behavior_logprobs": _lists(logprobs, RESPONSE),
            "policy_versions": _lists(versions, RESPONSE),
            "reward": pa.array(rng.random(n)),
            "turn_scores": pa.array([[0.5]] * n, pa.list_(pa.float64())),
            "tool_rewards": pa.array([[]] * n, pa.list_(pa.float64())),
            "status": pa.array(["finished"] * n),
            "finish_reason": pa.array(["stop"] * n),
            "agent_data_json": pa.array([None] * n, pa.string()),
        }
        for f in RECORD_FIELDS:
            if f.name not in cols:
                cols[f.name] = pa.array(np.zeros(n), f.type)
        out.append(normalize_batch(pa.RecordBatch.from_pydict(cols)))
    return out


def raw_ipc_write(batches: list[pa.RecordBatch], path: Path, *, fsync: bool) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        with pa.ipc.new_stream(f, batches[0].schema) as writer:
            for b in batches:
                writer.write_batch(b)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def buffer_append(batches: list[pa.RecordBatch], root: Path, *, fsync: bool) -> float:
    cfg = BufferConfig(root_dir=str(root), batch_size=64, group_size=GROUP, flush_every_rows=256, max_staleness=1000)
    buf = ReplayBuffer(cfg)
    t0 = time.perf_counter()
    for b in batches:
        buf.append(b)
    buf.checkpoint() if fsync else buf.flush()
    elapsed = time.perf_counter() - t0
    buf.close()
    return elapsed


def bench_write(batches: list[pa.RecordBatch], work: Path, repeats: int) -> dict:
    rows = sum(b.num_rows for b in batches)
    tokens = rows * (PROMPT + RESPONSE)
    res: dict = {}
    for fsync in (False, True):
        raw, buf = [], []
        for r in range(repeats):
            raw.append(raw_ipc_write(batches, work / f"raw-{fsync}-{r}.arrow", fsync=fsync))
            buf.append(buffer_append(batches, work / f"buf-{fsync}-{r}", fsync=fsync))
        raw_s, buf_s = float(np.median(raw)), float(np.median(buf))
        key = "with_fsync" if fsync else "flushed_to_os"
        res[key] = {
            "raw_ipc_rows_per_s": rows / raw_s,
            "raw_ipc_tokens_per_s": tokens / raw_s,
            "buffer_rows_per_s": rows / buf_s,
            "buffer_tokens_per_s": tokens / buf_s,
            "ratio_buffer_over_raw": raw_s / buf_s,
        }
    return res


def bench_sample(batches: list[pa.RecordBatch], work: Path, num_samples: int) -> dict:
    cfg = BufferConfig(root_dir=str(work / "sample"), batch_size=64, group_size=GROUP, reuse=10**6, max_staleness=1000)
    buf = ReplayBuffer(cfg)
    for b in batches:
        buf.append(b)
    buf.flush()
    live_tokens = sum(b.num_rows for b in batches) * (PROMPT + RESPONSE)
    sample_ms, pad_ms = [], []
    for step in range(num_samples):
        t0 = time.perf_counter()
        batch = buf.sample(served_version=0, learner_step=step)
        t1 = time.perf_counter()
        batch.to_padded()
        t2 = time.perf_counter()
        sample_ms.append((t1 - t0) * 1e3)
        pad_ms.append((t2 - t1) * 1e3)
    buf.close()
    return {
        "live_tokens": live_tokens,
        "batch_trajectories": 64,
        "batch_tokens": 64 * (PROMPT + RESPONSE),
        "num_samples": num_samples,
        "sample_ms_p50": float(np.percentile(sample_ms, 50)),
        "sample_ms_p99": float(np.percentile(sample_ms, 99)),
        "to_padded_ms_p50": float(np.percentile(pad_ms, 50)),
        "to_padded_ms_p99": float(np.percentile(pad_ms, 99)),
    }


def bench_memory(batches: list[pa.RecordBatch]) -> dict:
    column_bytes = sum(b.nbytes for b in batches)
    tracemalloc.start()
    buf = ReplayBuffer(BufferConfig(batch_size=64, group_size=GROUP, flush_every_rows=256))
    for b in batches:
        buf.append(b)
    buf.flush()
    python_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = buf.memory_bytes()
    return {
        "column_bytes": column_bytes,
        "arrow_and_row_arrays_bytes": held,
        "python_bookkeeping_bytes": python_bytes,
        "ratio_to_column_bytes": (held + python_bytes) / column_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="rows appended (x1024 tokens each)")
    parser.add_argument("--repeats", type=int, default=5, help="write runs of each kind (medians reported)")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--out", default="bench/results/buffer.json")
    parser.add_argument("--workdir", default=None, help="where to write logs (default: a temp dir)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    batches = make_batches(args.rows)
    work = Path(tempfile.mkdtemp(prefix="streamrl-bench-buffer-", dir=args.workdir))
    try:
        write = bench_write(batches, work, args.repeats)
        sample = bench_sample(batches, work, args.samples)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    memory = bench_memory(batches)
    result = {
        "command": " ".join(["python -m bench.buffer", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(pyarrow=pa.__version__),
        "rows": args.rows,
        "tokens": args.rows * (PROMPT + RESPONSE),
        "write": write,
        "sample": sample,
        "memory": memory,
        "targets": {
            "append_ratio_ge_0.5": write["flushed_to_os"]["ratio_buffer_over_raw"] >= 0.5,
            "sample_p99_lt_10ms_at_1M_tokens": sample["sample_ms_p99"] < 10 and sample["live_tokens"] >= 1_000_000,
            "memory_le_1.3x": memory["ratio_to_column_bytes"] <= 1.3,
        },
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
