"""Flat per-dtype buckets: plan the layout, pack tensors, checksum, and unpack views.

Both sides of a sync use these functions: the learner plans and packs, engine workers allocate the
same buffers from the manifest, receive into them and hand out zero-copy views for loading.
The checksum is a position-weighted wrapping sum of a bucket's 64-bit words, sum of (2i + 1) * w_i
mod 2**64: one streaming pass in cache-sized chunks (a multiply and two adds per word). The weights
are odd, so any single changed word changes it (an odd number is invertible mod 2**64), and distinct,
so words or whole tensors that swapped places change it too (a plain sum is blind to order: two
tensors' slots exchanged by an offset bug would pass). On CPU it is numpy's single-threaded reduces
(GIL released): torch's reduction fans out over its intra-op thread pool, and on a loaded 2-core
host that team waits for its slowest thread (measured 1-3 GB/s while gloo's threads hold the
cores). Wrapping arithmetic is associative, so both give the same value.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from streamrl.weight_sync.types import SLOT_ALIGN, BucketMeta, TensorMeta

if TYPE_CHECKING:
    import torch

_U64 = (1 << 64) - 1
_CHUNK_WORDS = 1 << 16  # CPU: 512 KiB of weighted words stay in cache between the multiply and the sum
_CHUNK_WORDS_DEVICE = 1 << 22  # GPU: 32 MiB of temporaries per step, a few launches per GiB


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in weight-sync manifest")
    return dtype


def _aligned(nbytes: int) -> int:
    return (nbytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def wire_dtype_of(tensor: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` travels in: a floating tensor in `wire_dtype` when one is given (the engines'
    dtype: bf16 engines get half the bytes of the learner's fp32 master weights, cast exactly as the
    engine's own load would cast them), everything else as it is."""
    return wire_dtype if wire_dtype is not None and tensor.is_floating_point() else tensor.dtype


def plan_buckets(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    alone_bytes: int | None = None,
    wire_dtype: torch.dtype | None = None,
) -> list[BucketMeta]:
    """Group tensors by (wire) dtype, first-seen order, into buckets of at most `bucket_bytes` each.

    A tensor of at least `alone_bytes` (default `bucket_bytes / 4`) gets a bucket of its own: such a
    bucket is the tensor's own memory (`pack_bucket` does not copy it), so big matrices travel
    zero-copy and only the many small tensors (norms, biases) pay for packing. Names must be unique.
    """
    alone_bytes = bucket_bytes // 4 if alone_bytes is None else min(alone_bytes, bucket_bytes)
    if bucket_bytes < SLOT_ALIGN:
        raise ValueError(f"bucket_bytes must be >= {SLOT_ALIGN}, got {bucket_bytes}")
    seen: set[str] = set()
    by_dtype: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r} in weights to sync")
        seen.add(name)
        by_dtype.setdefault(dtype_name(wire_dtype_of(tensor, wire_dtype)), []).append((name, tensor))
    buckets: list[BucketMeta] = []
    for dtype, items in by_dtype.items():
        current: list[TensorMeta] = []
        offset = 0
        itemsize = to_dtype(dtype).itemsize
        for name, tensor in items:
            nbytes = tensor.numel() * itemsize
            slot = _aligned(nbytes)
            if slot >= alone_bytes:
                meta = TensorMeta(name=name, shape=list(tensor.shape), dtype=dtype, offset=0, nbytes=nbytes)
                buckets.append(BucketMeta(index=len(buckets), dtype=dtype, nbytes=slot, tensors=[meta]))
                continue
            if current and offset + slot > bucket_bytes:
                buckets.append(BucketMeta(index=len(buckets), dtype=dtype, nbytes=offset, tensors=current))
                current, offset = [], 0
            current.append(TensorMeta(name=name, shape=list(tensor.shape), dtype=dtype, offset=offset, nbytes=nbytes))
            offset += slot
        if current:
            buckets.append(BucketMeta(index=len(buckets), dtype=dtype, nbytes=offset, tensors=current))
    return buckets


def empty_bucket(bucket: BucketMeta, device: torch.device | str) -> torch.Tensor:
    """Uninitialized receive buffer (the broadcast overwrites every byte, padding included)."""
    import torch

    return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)


def slot_view(flat: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """Zero-copy view of one tensor inside a packed bucket."""
    dtype = to_dtype(meta.dtype)
    return flat[meta.offset : meta.offset + meta.nbytes].view(dtype).view(meta.shape)


def pack_bucket(bucket: BucketMeta, tensors: dict[str, torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The bucket as one flat uint8 buffer on `device`, padding zeroed.

    A bucket of one contiguous tensor with no padding, already on `device` in its wire dtype, is
    returned as a view of that tensor (zero-copy): callers must not write into the result. A floating
    tensor planned in another floating dtype is cast while it is copied in.
    """
    import torch

    for meta in bucket.tensors:
        src = tensors[meta.name]
        same = dtype_name(src.dtype) == meta.dtype
        if list(src.shape) != meta.shape or not (
            same or (src.is_floating_point() and to_dtype(meta.dtype).is_floating_point)
        ):
            raise ValueError(f"tensor {meta.name!r} changed shape/dtype between planning and packing")
    if len(bucket.tensors) == 1:
        src = tensors[bucket.tensors[0].name].detach()
        aligned = src.data_ptr() % SLOT_ALIGN == 0
        same = dtype_name(src.dtype) == bucket.dtype
        if (
            same
            and aligned
            and src.is_contiguous()
            and src.device == torch.device(device)
            and src.nbytes == bucket.nbytes
        ):
            return src.reshape(-1).view(torch.uint8)
    flat = empty_bucket(bucket, device)
    with torch.no_grad():
        for meta in bucket.tensors:
            slot_view(flat, meta).copy_(tensors[meta.name].detach())
            flat[meta.offset + meta.nbytes : meta.offset + _aligned(meta.nbytes)].zero_()
    return flat


def unpack_bucket(bucket: BucketMeta, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for meta in bucket.tensors:
        yield meta.name, slot_view(flat, meta)


def checksum(flat: torch.Tensor) -> int:
    """sum of (2i + 1) * word_i mod 2**64 over the buffer's 64-bit words (the module docstring says why),
    as an unsigned Python int: the same value on any device."""
    import torch

    if not flat.is_contiguous():
        raise ValueError("checksum needs a contiguous buffer")
    raw = flat.detach().reshape(-1).view(torch.uint8)
    if raw.numel() % SLOT_ALIGN:
        raise ValueError(f"bucket of {raw.numel()} bytes is not a multiple of {SLOT_ALIGN}")
    if raw.device.type == "cpu":
        return _weighted_sum_numpy(raw)
    return _weighted_sum_torch(raw.view(torch.int64), _CHUNK_WORDS_DEVICE)


def _weighted_sum_numpy(raw: torch.Tensor) -> int:
    """The chunk at word j adds sum((2k + 1) * w[j + k]) + 2j * sum(w[j + k]) (Python ints, then wrapped)."""
    import numpy as np

    words = raw.numpy().view(np.uint64)
    weights = 2 * np.arange(min(_CHUNK_WORDS, len(words)), dtype=np.uint64) + 1
    weighted = np.empty_like(weights)
    total = 0
    for j in range(0, len(words), _CHUNK_WORDS):
        chunk = words[j : j + _CHUNK_WORDS]
        n = len(chunk)
        np.multiply(weights[:n], chunk, out=weighted[:n])
        total += int(np.add.reduce(weighted[:n], dtype=np.uint64)) + 2 * j * int(np.add.reduce(chunk, dtype=np.uint64))
    return total & _U64


def _weighted_sum_torch(words: torch.Tensor, chunk_words: int) -> int:
    """The same sum in wrapping int64 on the words' device, one host sync at the end."""
    import torch

    weights = 2 * torch.arange(min(chunk_words, words.numel()), dtype=torch.int64, device=words.device) + 1
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for j in range(0, words.numel(), chunk_words):
        chunk = words[j : j + chunk_words]
        total += (weights[: chunk.numel()] * chunk).sum() + 2 * j * chunk.sum()
    return int(total.item()) & _U64
