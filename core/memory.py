"""Process memory: what the learner reports as `memory/*` and how its allocator is kept from growing.

Readers: `rss_gb` (resident now), `peak_rss_gb` (VmHWM, the high-water mark since start or the last
`reset_peak_rss`), `cuda_peak_gb` (torch's peak allocation on the current GPU) and `peak_memory_gb`,
which picks the one that bounds the device the learner computes on.

Why the learner's RSS would grow step after step on CPU: glibc malloc. Every thread that
allocates (the actor's event loop, torch's intra-op threads, gloo/weight-sync threads) gets an arena
of its own, up to 8 per core, and glibc raises its mmap threshold to the size of each freed mmapped
block (up to 32 MB), so after the first step the 1-32 MB activation and gradient tensors of a step
come from those arenas instead of mmap. Freed arena memory is not returned to the kernel unless it
sits at the top of a heap, so the resident set ratchets up with fragmentation. The fix has two
halves: `learner_runtime_env()` caps the arenas and pins the mmap threshold for the learner
process (environment variables glibc reads at start-up, hence a Ray `runtime_env`), and
`trim_allocator()` (malloc_trim) hands free pages back after every step.

The threshold is 128 KB, not 4 MB: a one-sequence micro-batch's
activation and gradient tensors of SmolLM2 are 0.4-3.5 MB, so under 4 MB they came from the heap,
where the gradients allocated during backward pinned the freed activations below them and the
resident set rose by ≈ 1.2 GiB within a step. Mmapped, each tensor goes back to the kernel when
freed: on the longest default batch the step peak fell from 4.12 to 3.61 GiB, and to 2.86 GiB
(1.43 × params + grads + AdamW) with activation checkpointing and a 128-token LM-head chunk, the
default now (`python -m bench.memory_learner --peak-variants`, bench/results/learner_peak.json).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

_GB = 1024**3

# glibc tunables for the learner process; see the module docstring and bench/memory_learner.py.
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "2",  # one arena per core instead of up to 8 per core
    "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),  # fixed: ≥ 128 KB blocks (every activation) mmapped, freed to the OS
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024 * 1024),  # let brk'd heap shrink when 64 MB at its top are free
}


def learner_runtime_env(num_threads: int | None = None) -> dict[str, str]:
    """Environment variables of a learner process (a Ray actor's `runtime_env["env_vars"]`):
    every core for torch's intra-op pool (Ray pins OMP_NUM_THREADS to the actor's num_cpus) and the
    allocator settings that keep its resident set flat across steps."""
    threads = num_threads if num_threads is not None else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(threads), **MALLOC_ENV}


def _status_kb(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_gb() -> float:
    """Resident set size of this process now, GiB."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb / 1024**2
    import psutil

    return psutil.Process().memory_info().rss / _GB


def peak_rss_gb() -> float:
    """Peak resident set size of this process (VmHWM on Linux, ru_maxrss elsewhere), GiB."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb / 1024**2
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, kB on Linux
    return peak / _GB if sys.platform == "darwin" else peak / 1024**2


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux ≥ 4.0: write 5 to /proc/self/clear_refs), so the
    next `peak_rss_gb` is the peak of what runs in between. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cuda_peak_gb(reset: bool = False) -> float | None:
    """torch's peak allocated memory on the current CUDA device, GiB; None without CUDA (or torch
    not imported yet). `reset` restarts the peak afterwards."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    peak = torch.cuda.max_memory_allocated() / _GB
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def peak_memory_gb(device: str = "cpu") -> float:
    """The peak that bounds `device`: the CUDA allocator's on "cuda", the process RSS peak otherwise."""
    if device.startswith("cuda"):
        peak = cuda_peak_gb()
        if peak is not None:
            return peak
    return peak_rss_gb()


def end_of_step(device: str = "cpu") -> dict[str, float]:
    """Called by a learner process after each train step: trim the allocator, then report
    `memory/learner_peak_gb` (the peak of `device` since the previous call: it covers this step and
    whatever ran since the last one, e.g. a weight publish) and `memory/learner_rss_gb` (the
    resident set now, after the trim: flat across steps when nothing leaks); restarts the window."""
    trim_allocator()
    peak = peak_memory_gb(device)
    metrics = {"memory/learner_peak_gb": peak, "memory/learner_rss_gb": rss_gb()}
    reset_peak_rss()
    cuda_peak_gb(reset=True)
    return metrics


def _pid_peak_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:  # gone meanwhile, or not Linux
        pass
    return 0


def part_peak_gb() -> float:
    """Peak memory of a run part (an engine, a rollout worker, the buffer, the driver): the process's
    own peak RSS plus its children's (vLLM's EngineCore and tool subprocesses), GiB. On CUDA the GPU
    peak is reported apart (`part_gpu_peak_gb`). Never reset: this is the peak since the part started."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        children = []
    return peak_rss_gb() + sum(_pid_peak_kb(c.pid) for c in children) / 1024**2


def part_memory(part: str) -> dict[str, float]:
    """`memory/<part>_peak_gb` (and `memory/<part>_gpu_peak_gb` where this process uses CUDA)."""
    out = {f"memory/{part}_peak_gb": part_peak_gb()}
    gpu = cuda_peak_gb()
    if gpu is not None:
        out[f"memory/{part}_gpu_peak_gb"] = gpu
    return out


def trim_allocator() -> bool:
    """Return free malloc memory of every arena to the kernel (glibc `malloc_trim(0)`).

    Cheap (tens of ms for GBs of free pages); False where the C library has no malloc_trim."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


_LIBC: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        _LIBC = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                libc.malloc_trim.restype = ctypes.c_int
                _LIBC = libc
            except (OSError, AttributeError):  # musl and others have no malloc_trim
                logger.info("malloc_trim unavailable; the allocator keeps its free pages")
    return _LIBC  # type: ignore[return-value]
