"""Bucket layout, packing, checksums and the manifest wire format (pure, milliseconds)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.weight_sync.buckets import checksum, pack_bucket, plan_buckets, unpack_bucket
from streamrl.weight_sync.types import SLOT_ALIGN, SyncManifest
from tests.weight_sync.fakes import toy_weights


def test_buckets_group_by_dtype_and_respect_size_bound():
    weights = toy_weights()
    buckets = plan_buckets(weights, bucket_bytes=512)
    for bucket in buckets:
        assert {t.dtype for t in bucket.tensors} == {bucket.dtype}
        assert bucket.nbytes % SLOT_ALIGN == 0
        assert all(t.offset % SLOT_ALIGN == 0 for t in bucket.tensors)
        assert bucket.nbytes <= 512 or len(bucket.tensors) == 1  # oversize tensors travel alone
    assert sorted(t.name for b in buckets for t in b.tensors) == sorted(n for n, _ in weights)
    assert len(buckets) > len({b.dtype for b in buckets})  # the bound actually split float32


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])  # 64: most tensors travel alone, zero-copy
def test_pack_unpack_round_trip_is_exact(bucket_bytes):
    weights = toy_weights()
    by_name = dict(weights)
    for bucket in plan_buckets(weights, bucket_bytes=bucket_bytes):
        flat = pack_bucket(bucket, by_name, "cpu")
        assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
        received = flat.clone()  # what a receiver holds after the broadcast
        assert checksum(received) == checksum(flat)
        for name, view in unpack_bucket(bucket, received):
            assert view.dtype == by_name[name].dtype
            assert torch.equal(view, by_name[name])


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_a_wire_dtype_casts_floating_tensors_only_and_never_aliases_the_learner(bucket_bytes):
    weights = toy_weights()
    by_name = dict(weights)
    buckets = plan_buckets(weights, bucket_bytes=bucket_bytes, wire_dtype=torch.bfloat16)
    planned = {t.name: t for b in buckets for t in b.tensors}
    assert {n: m.dtype for n, m in planned.items()} == {n: "int64" if n == "count" else "bfloat16" for n in by_name}
    for bucket in buckets:
        flat = pack_bucket(bucket, by_name, "cpu")
        for name, view in unpack_bucket(bucket, flat.clone()):
            assert torch.equal(view, by_name[name].to(view.dtype))  # copy_'s cast = the engine's load cast
            assert planned[name].nbytes == by_name[name].numel() * view.element_size()
        if bucket.dtype != "int64":  # a cast bucket is a fresh buffer, never a view of a learner tensor
            assert all(flat.data_ptr() != by_name[t.name].data_ptr() for t in bucket.tensors)


def test_checksum_detects_a_flipped_value_and_swapped_tensors():
    """Two tensors of one size whose slots exchanged contents (an offset bug in a transport) keep
    every word, so a plain word sum passed them; the position-weighted sum does not."""
    weights = [(n, t) for n, t in toy_weights() if t.dtype == torch.float32]
    weights.append(("layer.1.weight", torch.randn(8, 8, generator=torch.Generator().manual_seed(1))))
    by_name = dict(weights)
    (bucket,) = plan_buckets(weights, bucket_bytes=1 << 20)
    flat = pack_bucket(bucket, by_name, "cpu")
    corrupted = flat.clone()
    corrupted[17] ^= 0x01
    assert checksum(corrupted) != checksum(flat)
    a, b = by_name["layer.0.weight"], by_name["layer.1.weight"]
    swapped = pack_bucket(bucket, {**by_name, "layer.0.weight": b, "layer.1.weight": a}, "cpu")
    assert not torch.equal(swapped, flat) and checksum(swapped) != checksum(flat)


@pytest.mark.parametrize("i, j", [(0, 1), (3, 4098), (0, 64), (1, 1 << 16)])  # 1 << 16: across chunks
def test_checksum_detects_two_swapped_words(i, j):
    g = torch.Generator().manual_seed(7)
    words = torch.randint(-(2**62), 2**62, ((1 << 16) + 5,), generator=g, dtype=torch.int64)
    swapped = words.clone()
    swapped[i], swapped[j] = words[j], words[i]
    assert checksum(swapped) != checksum(words)


def _reference_checksum(flat: torch.Tensor) -> int:
    """sum((2i + 1) * w_i) mod 2**64 in Python ints: what both paths (numpy on CPU, torch on a GPU)
    must compute bit for bit."""
    words = flat.view(torch.int64).tolist()
    return sum((2 * i + 1) * w for i, w in enumerate(words)) & ((1 << 64) - 1)


def test_cpu_and_device_checksums_equal_the_reference_and_accept_any_dtype():
    from streamrl.weight_sync.buckets import _weighted_sum_torch

    g = torch.Generator().manual_seed(3)
    words = torch.randint(-(2**62), 2**62, ((1 << 16) + 4099,), generator=g, dtype=torch.int64) * 3  # wraps
    flat = words.view(torch.uint8)
    assert checksum(flat) == _reference_checksum(flat)
    assert _weighted_sum_torch(words, 1000) == _weighted_sum_torch(words, 1 << 22) == checksum(flat)
    assert checksum(words) == checksum(flat) == checksum(words.view(torch.float64))
    assert checksum(torch.zeros(0, dtype=torch.uint8)) == 0
    assert checksum(flat[1:9]) == _reference_checksum(flat[1:9].clone())  # an unaligned slice


@settings(max_examples=60, deadline=None)
@given(
    nwords=st.integers(min_value=1, max_value=512),
    position=st.integers(min_value=0),
    xor=st.integers(min_value=1, max_value=255),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_any_single_corrupted_byte_changes_the_checksum(nwords, position, xor, seed):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (nwords * SLOT_ALIGN,), dtype=torch.uint8, generator=g)
    corrupted = flat.clone()
    corrupted[position % flat.numel()] ^= xor
    assert checksum(corrupted) != checksum(flat)


def test_different_weights_give_different_bucket_checksums():
    layout = plan_buckets(toy_weights(1), bucket_bytes=256)
    sums = [[checksum(pack_bucket(b, dict(toy_weights(seed)), "cpu")) for b in layout] for seed in (1, 2)]
    # every float bucket differs; the int64 `count` tensor is the same in both
    assert [a != b for a, b in zip(*sums, strict=True)] == [b.dtype != "int64" for b in layout]


def test_bad_input_raises_value_error():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([("a", t), ("a", t)], bucket_bytes=1024)
    (bucket,) = plan_buckets([("a", t)], bucket_bytes=1024)
    with pytest.raises(ValueError, match="changed shape"):
        pack_bucket(bucket, {"a": torch.zeros(3)}, "cpu")
    bucket.tensors[0].dtype = "nonsense"
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        list(unpack_bucket(bucket, torch.zeros(bucket.nbytes, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="multiple of 8"):
        checksum(torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        checksum(torch.zeros(4, 8, dtype=torch.uint8).t())


def test_manifest_json_round_trip():
    buckets = plan_buckets(toy_weights(), bucket_bytes=256)
    buckets[0].checksum = (1 << 64) - 3
    manifest = SyncManifest(policy_version=7, buckets=buckets)
    again = SyncManifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.num_bytes == sum(b.nbytes for b in buckets)
    assert again.num_tensors == len(toy_weights())
