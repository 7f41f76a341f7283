"""Learner checkpoints and HF exports, both written to a temporary sibling and renamed into place.

Checkpoint layout (`save_checkpoint(dir)`):

    dir/hf/                  save_pretrained weights + config + tokenizer (vLLM can load it)
    dir/adapter.pt           LoRA only: the adapter's weights (peft's `get_peft_model_state_dict`)
    dir/value_head.pt        PPO value head state_dict
    dir/optimizer.pt         AdamW state (FQN-keyed full state under FSDP)
    dir/scheduler.pt         LambdaLR state
    dir/rng.pt               torch CPU/CUDA, python, numpy and the engine's shuffle generator
    dir/state.json           policy_version, num_optimizer_steps, the learner config
    dir/SEALED.json          written last: every other file and its size (`core.atomic.seal_dir`)

Weights are fp32 safetensors and the optimiser state is saved as is, so on CPU a resumed engine
takes bit-identical steps. With LoRA (`learner.lora`) `hf/` holds the merged model (what the engines
serve and `streamrl eval` loads) and `adapter.pt` the adapter; a resume keeps the base weights it
loaded from `learner.model`, restores the adapter from `adapter.pt`, and checks that base + adapter
merge to the `hf/` weights (a resume on another base model is refused, not trained on). Under FSDP
rank 0 gathers full state dicts and writes; loading broadcasts from rank 0. A checkpoint is sealed
(fsynced, then its manifest) before it is renamed into place: it survives a lost machine whole, or is
recognisably torn.

A failed write stops the run, it never leaves a checkpoint a resume would take. Every file of ours
(`*.pt`, `state.json`, the seal) is written and fsynced through the I/O plan (`core.iofaults`, as
`ckpt/<file>`, so the chaos bench and the tests can break any of them at a seeded call); the HF
folder is written by transformers/safetensors and reaches the plan at the seal's fsync of each file.
When any write or fsync fails (ENOSPC, EIO, a torn or unfinished write, a failing fsync), `atomic_dir`
removes the partial folder, renames nothing into place and writes no seal, and `save_checkpoint`
raises `CheckpointWriteError` (an `OSError`: the errno, the file, the way out). The driver has not
recorded the checkpoint yet (`Pipeline.checkpoint` records it only once this returns), so the saved
driver state still names the previous complete checkpoints; the run stops, and `--resume` starts
from the newest complete one (`streaming.checkpoints.use_newest_complete`), the buffer rolling its
consumption back to that step: no acknowledged row is lost, the steps after it are retrained.
Stopping, rather than skipping the checkpoint and training on: a disk that returns ENOSPC or EIO, or
fails an fsync (whose dirty pages the kernel may have dropped), holds the buffer log too, which
fails for good on the same faults; a skipped checkpoint would silently widen what a later crash
retrains, and nothing written after a failed fsync can be trusted without the operator's look.
A failed rewrite of a step that already has a checkpoint (after a resume) keeps the old one whole.

Every `.pt` file holds tensors and plain Python values only (the RNG states are converted to them)
and is read with `torch.load(weights_only=True)`: loading a tampered checkpoint fails instead of
running the code a pickle can carry.
"""

from __future__ import annotations

import json
import logging
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np
import torch

from streamrl.core.atomic import WriteFailedError, atomic_dir, open_for_write, write_file
from streamrl.core.run_dir import CHECKPOINT_HF, CHECKPOINT_STATE
from streamrl.learner.sharded import full_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from streamrl.learner.types import TrainState

logger = logging.getLogger(__name__)

LOG = "ckpt"  # the checkpoint files' I/O-plan target prefix: `ckpt/optimizer.pt`, `ckpt/SEALED.json`, ...
ADAPTER_FILE = "adapter.pt"


class CheckpointWriteError(WriteFailedError):
    """A checkpoint could not be written: nothing of it was sealed or renamed into place (module doc)."""


def _full_lm_state(ts: TrainState) -> dict[str, torch.Tensor] | None:
    """Unsharded LM state dict (rank 0 under FSDP, None on other ranks; None single-process: use the live model)."""
    if not ts.is_distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(ts.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ts.rank != 0:
        return None
    state: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("lm."):
            assert isinstance(v, torch.Tensor), f"{k}: a full model state dict holds tensors, not {type(v).__name__}"
            state[k.removeprefix("lm.")] = v
    return state


def _write_hf(ts: TrainState, out: Path, state: dict[str, torch.Tensor] | None) -> None:
    lm = ts.policy.lm
    if state is None:
        lm.save_pretrained(out, safe_serialization=True)
    else:
        lm.save_pretrained(out, state_dict=state, safe_serialization=True)
    ts.tokenizer.save_pretrained(out)


def save_hf(ts: TrainState, directory: Path) -> Path:
    state = _full_lm_state(ts) if ts.lora is None else ts.lora.merged_state_dict()[0]
    if ts.rank == 0:
        atomic_dir(directory, lambda tmp: _write_hf(ts, tmp, state))
    _barrier(ts)
    return directory


def _optimizer_state(ts: TrainState) -> dict:
    if not ts.is_distributed:
        return ts.optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(ts.policy, ts.optimizer, options=opts)


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """Everything a checkpoint holds, copied off the live training state: CPU tensors and plain
    values that the next optimizer step cannot change, so a background thread can write them while
    the learner trains on (`CheckpointWriter`)."""

    directory: Path
    lm: PreTrainedModel  # for its config and file layout only: the weights written are `lm_state`'s
    tokenizer: Any
    lm_state: dict[str, torch.Tensor]  # with LoRA: the merged model's
    head_state: dict[str, torch.Tensor] | None
    adapter_state: dict[str, torch.Tensor] | None  # LoRA only
    optimizer_state: dict
    scheduler_state: dict
    rng: dict
    meta: dict[str, Any]  # state.json: policy_version, num_optimizer_steps, the learner config

    @property
    def policy_version(self) -> int:
        return int(self.meta["policy_version"])


def take_snapshot(ts: TrainState, directory: Path) -> Snapshot | None:
    """Copy the checkpoint's state off the live model and optimizer (every rank takes part in the
    gathers under FSDP; rank 0 gets the snapshot, other ranks None). Costs one copy of the weights,
    the value head and the optimizer state in host memory until the snapshot is written."""
    lm_state = _full_lm_state(ts)
    optimizer_state = _optimizer_state(ts)
    head = ts.policy.value_head
    head_state = None if head is None else {k: full_tensor(v).cpu() for k, v in head.state_dict().items()}
    if ts.rank != 0:
        return None
    # gathered full states (FSDP) are fresh host tensors already; a single process's are the live ones
    if ts.lora is not None:
        lm_state = _merged_copy(ts)
    elif lm_state is None:
        lm_state = _cloned(ts.policy.lm.state_dict())
    return Snapshot(
        directory=Path(directory),
        lm=ts.policy.lm,
        tokenizer=ts.tokenizer,
        lm_state=lm_state,
        head_state=None if head_state is None else _cloned(head_state),
        adapter_state=None if ts.lora is None else _cloned(ts.lora.adapter_state()),
        optimizer_state=optimizer_state if ts.is_distributed else _cloned(optimizer_state),
        scheduler_state=_cloned(ts.scheduler.state_dict()),
        rng=_rng_state(ts),
        meta={
            "policy_version": ts.policy_version,
            "num_optimizer_steps": ts.num_optimizer_steps,
            "config": ts.cfg.model_dump(mode="json"),
        },
    )


def _merged_copy(ts: TrainState) -> dict[str, torch.Tensor]:
    """The merged model's state dict sharing no storage with the live model: merged entries are new
    tensors already, the frozen rest is cloned (its tied weights still shared, as `_cloned` keeps them)."""
    state, merged = ts.lora.merged_state_dict()
    frozen = _cloned({k: v for k, v in state.items() if k not in merged})
    return {k: v if k in merged else frozen[k] for k, v in state.items()}


def _cloned(state: Any) -> Any:
    """A deep copy whose tensors are detached CPU clones; tensors that share storage (tied
    embeddings) stay shared, so the files written are those of the live state."""
    memo: dict[tuple, torch.Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            # state_dict() detaches each entry into a new tensor object: the storage tells tied ones
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape, value.stride(), value.dtype)
            if key not in memo:
                memo[key] = value.detach().to("cpu", copy=True)
            return memo[key]
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple):
            return tuple(copy(v) for v in value)
        return value

    return copy(state)


def write_snapshot(snap: Snapshot) -> Path:
    """Write and seal the snapshot's checkpoint folder (module doc); raises `CheckpointWriteError`."""

    def write(tmp: Path) -> None:
        out = tmp / CHECKPOINT_HF
        snap.lm.save_pretrained(out, state_dict=snap.lm_state, safe_serialization=True)
        snap.tokenizer.save_pretrained(out)
        if snap.adapter_state is not None:
            _save_pt(snap.adapter_state, tmp / ADAPTER_FILE)
        if snap.head_state is not None:
            _save_pt(snap.head_state, tmp / "value_head.pt")
        _save_pt(snap.optimizer_state, tmp / "optimizer.pt")
        _save_pt(snap.scheduler_state, tmp / "scheduler.pt")
        _save_pt(snap.rng, tmp / "rng.pt")
        write_file(tmp / CHECKPOINT_STATE, json.dumps(snap.meta, indent=2), log=f"{LOG}/{CHECKPOINT_STATE}")

    try:
        atomic_dir(snap.directory, write, sync=True, log=LOG)
    except WriteFailedError as e:
        raise CheckpointWriteError(
            e.errno,
            f"saving the checkpoint of policy_version={snap.policy_version} failed: {e.strerror}. The run stops "
            f"here; free or fix the disk, then restart the run with --resume (it starts from the newest "
            f"complete checkpoint; no acknowledged row is lost)",
        ) from e
    logger.info("saved checkpoint policy_version=%d to %s", snap.policy_version, snap.directory)
    return snap.directory


def save_checkpoint(ts: TrainState, directory: Path) -> Path:
    """Snapshot and write, on the caller's thread; every rank returns once the folder is sealed."""
    snap = take_snapshot(ts, directory)
    if snap is not None:
        write_snapshot(snap)
    _barrier(ts)
    return directory


class CheckpointWriter:
    """Writes snapshots on one background thread, one at a time, so the learner trains on while a
    checkpoint goes to disk (`trainer.async_checkpoint`).

    `start` takes the snapshot on the caller's thread (the training path pays for the copy only)
    and first waits for the previous write, so at most one snapshot is held besides the live state.
    `wait` returns the written folder, or raises the write's error (`CheckpointWriteError`): the
    caller records a checkpoint only after `wait` returned it, so a crash or a failed write leaves
    the run's records naming complete checkpoints only. A process that dies mid-write leaves an
    unsealed temporary sibling that nothing reads."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[Path] | None = None

    def start(self, ts: TrainState, directory: Path) -> None:
        self.wait()
        snap = take_snapshot(ts, directory)
        if snap is None:  # not rank 0: its part (the gathers) is done
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending = self._pool.submit(write_snapshot, snap)

    @property
    def busy(self) -> bool:
        """A write started and not yet collected by `wait` is still running."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> Path | None:
        """The folder of the write in flight once it is sealed (None when none is), or its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Finish the write in flight (its error is logged: closing is not the place to raise it)."""
        try:
            self.wait()
        except OSError:
            logger.exception("the last checkpoint write failed")
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _save_pt(obj: object, path: Path) -> None:
    """`torch.save` through the I/O plan (target `ckpt/<name>`): streamed, not buffered in memory."""
    with open_for_write(path, log=f"{LOG}/{path.name}") as f:
        # torch.save calls only write() and flush() of a file object; its annotation asks for IO[bytes]
        torch.save(obj, cast(IO[bytes], f))


def _rng_state(ts: TrainState) -> dict:
    """Every RNG's state as tensors and plain values (what `weights_only=True` loads)."""
    numpy_state = np.random.get_state(legacy=False)  # {bit_generator, state: {key: uint32[624], pos}, ...}
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),  # (version, tuple of ints, gauss): plain values
        "numpy": numpy_state,
        "generator": ts.generator.get_state(),
    }


def _set_rng_state(ts: TrainState, rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    numpy_state = rng["numpy"]
    numpy_state["state"]["key"] = numpy_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state(numpy_state)
    ts.generator.set_state(rng["generator"])


def _load(path: Path) -> Any:
    """A checkpoint's `.pt` file: tensors and plain values only; anything else is refused."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path} holds more than tensors and plain values; refused to load it: {exc}") from exc


def _load_lm_weights(ts: TrainState, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_checkpoint(ts: TrainState, directory: Path) -> tuple[int, int]:
    directory = Path(directory)
    if not (directory / CHECKPOINT_STATE).exists():
        raise ValueError(f"{directory} is not a learner checkpoint (no {CHECKPOINT_STATE})")
    meta = json.loads((directory / CHECKPOINT_STATE).read_text())
    lm_state = _load_lm_weights(ts, directory / CHECKPOINT_HF)
    head_state = _load(directory / "value_head.pt") if (directory / "value_head.pt").exists() else None
    if (head_state is None) != (ts.policy.value_head is None):
        raise ValueError("checkpoint and config disagree on the value head (algo ppo vs grpo)")
    has_adapter = (directory / ADAPTER_FILE).exists()
    if has_adapter != (ts.lora is not None):
        raise ValueError(
            f"checkpoint and config disagree on LoRA: {directory} {'holds' if has_adapter else 'has no'} "
            f"{ADAPTER_FILE}, learner.lora is {'unset' if ts.lora is None else 'set'}"
        )
    optim_state = _load(directory / "optimizer.pt")
    if ts.lora is not None:  # one process (LearnerConfig refuses LoRA with FSDP)
        _load_adapter(ts, directory, lm_state)
        if head_state is not None:
            ts.policy.value_head.load_state_dict(head_state)
        ts.optimizer.load_state_dict(optim_state)
    elif ts.is_distributed:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            ValueType,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full: dict[str, ValueType] = {f"lm.{k}": v for k, v in lm_state.items()}
        if head_state is not None:
            full.update({f"value_head.{k}": v for k, v in head_state.items()})
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(ts.policy, full, options=opts)
        set_optimizer_state_dict(ts.policy, ts.optimizer, optim_state, options=opts)
    else:
        missing, unexpected = ts.policy.lm.load_state_dict(lm_state, strict=False)
        tied = {"lm_head.weight"} if getattr(ts.policy.lm.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint weights do not match the model: missing={missing} unexpected={unexpected}")
        if head_state is not None:
            ts.policy.value_head.load_state_dict(head_state)
        ts.optimizer.load_state_dict(optim_state)
    ts.scheduler.load_state_dict(_load(directory / "scheduler.pt"))
    _set_rng_state(ts, _load(directory / "rng.pt"))
    logger.info("loaded checkpoint policy_version=%d from %s", int(meta["policy_version"]), directory)
    return int(meta["policy_version"]), int(meta["num_optimizer_steps"])


def _load_adapter(ts: TrainState, directory: Path, merged: dict[str, torch.Tensor]) -> None:
    """Restore the adapter from `adapter.pt` onto the base weights this engine loaded, and check that
    they merge to the checkpoint's `hf/` weights: a different base would serve wrong weights silently."""
    ts.lora.load_adapter_state(_load(directory / ADAPTER_FILE))
    for name, tensor in ts.lora.merged_parameters():
        saved = merged.get(name)
        if saved is None or not torch.allclose(saved.to(tensor.device), tensor, rtol=1e-5, atol=1e-6):
            raise ValueError(
                f"{directory}: base weights + adapter do not merge to the checkpoint's {CHECKPOINT_HF}/ weights "
                f"({name} {'is missing there' if saved is None else 'differs'}); resume a LoRA run on the base "
                "model it started from (learner.model)"
            )


def _barrier(ts: TrainState) -> None:
    if ts.is_distributed:
        torch.distributed.barrier()
