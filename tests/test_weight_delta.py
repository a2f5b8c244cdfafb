"""The delta sync's wire format and the sender's encoding (megarl/wire/weight_delta.py,
megarl/sync/delta.py), on plain tensors: the encoding each case gets, bit-exact round trips through a
bucket and SGLang's flat layout, whole buckets on a full sync, a version gap or a large change."""
import math

import pytest
import torch

from megarl.sync.buckets import pack, unpack
from megarl.sync.delta import DeltaEncoder, DeltaPlan, KeptWeights
from megarl.wire.weight_delta import (
    BITMAP,
    GAPS,
    INDICES,
    VALUES,
    changed_mask,
    choose,
    decode,
    encode,
    encoded_sizes,
    largest_gap,
    pack_bits,
    unpack_bits,
)

pytestmark = pytest.mark.unit


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.int16)


def changed_copy(tensor: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """``tensor`` with ``count`` distinct elements given new values (bits differ)."""
    g = torch.Generator().manual_seed(seed)
    out = tensor.clone()
    flat = out.view(-1)
    where = torch.randperm(flat.numel(), generator=g)[:count]
    flat[where] = (flat[where].float() + 1.0).to(flat.dtype)
    return out


@pytest.mark.parametrize("changed, max_gap, expected", [
    (10, 2**17, "sparse"), (10, 2**16, "gaps"), (40, 100, "gaps"), (100, 30, "bitmap"), (1000, 2, "dense"),
    (1024, 1, "dense")])
def test_the_smallest_encoding_is_chosen(changed, max_gap, expected):
    """bf16, 1024 elements: gaps 4 bytes per change (steps up to 2**16), sparse 6, bitmap 128 + 2 per
    change, dense 2048."""
    by_hand = {"sparse": changed * 6, "bitmap": 128 + changed * 2, "dense": 2048}
    if max_gap <= 2**16:
        by_hand["gaps"] = changed * 4
    assert encoded_sizes(1024, changed, 2, max_gap) == by_hand
    assert choose(1024, changed, 2, max_gap) == expected == min(by_hand, key=by_hand.get)


def test_largest_gap_counts_from_minus_one():
    mask = torch.zeros(200_000, dtype=torch.bool)
    mask[[4, 70_000, 70_001]] = True
    assert largest_gap(mask) == 69_996 and largest_gap(torch.zeros(3, dtype=torch.bool)) == 0


def test_bitmap_packs_eight_elements_a_byte():
    mask = torch.tensor([True, False, False, True, False, False, False, False, True, True, False])
    bitmap = pack_bits(mask)
    assert bitmap.tolist() == [0b1001, 0b11] and torch.equal(unpack_bits(bitmap, mask.numel()), mask)


def test_changed_means_other_bits():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.5], dtype=torch.bfloat16)
    assert changed_mask(new, old).tolist() == [True, False, False, True]


@pytest.mark.parametrize("kind", ["gaps", "sparse", "bitmap", "dense"])
def test_each_encoding_round_trips_bit_exact(kind):
    old = torch.randn(300, 400, dtype=torch.bfloat16)  # 120,000 elements: steps past 2**15 (int16's sign bit)
    new = changed_copy(old, 50, seed=1)
    new.view(-1)[-1] = -old.view(-1)[-1]
    new.view(-1)[0] = -0.0 if old.view(-1)[0] == 0 else -old.view(-1)[0]
    pieces = encode("w", new, changed_mask(new, old), kind)
    suffixes = {"gaps": {GAPS, VALUES}, "sparse": {INDICES, VALUES}, "bitmap": {BITMAP, VALUES}, "dense": {""}}[kind]
    assert {name[1:] for name, _ in pieces} == suffixes
    baseline = {"w": old.clone()}
    (name, decoded), = decode(pieces, baseline)
    assert name == "w" and torch.equal(bits(decoded), bits(new)) and decoded is baseline["w"]


def test_a_delta_without_a_baseline_is_refused():
    new = torch.ones(8, dtype=torch.bfloat16)
    pieces = encode("w", new, torch.ones(8, dtype=torch.bool), "sparse")
    with pytest.raises(KeyError, match="needs a full sync"):
        decode(pieces, {})


def model_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (64, 32), "norm": (32,), "q": (32, 32), "down": (48, 32)}
    return [(name, torch.randn(shape, generator=g).to(torch.bfloat16)) for name, shape in shapes.items()]


def send(kept: KeptWeights, named, plan: DeltaPlan, version: int):
    """One bucket through a DeltaEncoder: (the bucket as sent, its stats)."""
    encoder = DeltaEncoder(kept, plan, version)
    bucket = encoder.encode(pack([(n, t.clone()) for n, t in named]))
    encoder.finish()
    return bucket, encoder.stats


def receive(bucket, baseline: dict) -> dict:
    """The engine's side: SGLang's flat layout of the index (its alignment checks), the views, the decode."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    index = bucket.index
    FlattenedTensorBucket.empty([e.name for e in index.entries], [e.dtype for e in index.entries],
                                [list(e.shape) for e in index.entries], device="meta")
    return {name: tensor.clone() for name, tensor in decode(unpack(index, bucket.buffer), baseline)}


def test_deltas_after_a_whole_sync_rebuild_the_weights_bit_exact():
    kept, baseline = KeptWeights(), {}
    v1 = model_tensors(0)
    first, stats = send(kept, v1, DeltaPlan(base=None, max_fraction=0.5), version=1)
    assert first.index.delta and [e.name for e in first.index.entries] == [n for n, _ in v1]
    assert first.index.nbytes == stats.dense_bytes and kept.version == 1
    receive(first, baseline)
    current = v1
    for version, count in [(2, 3), (3, 40), (4, 0)]:
        current = [(name, changed_copy(t, min(count, t.numel()), seed=version)) for name, t in current]
        bucket, stats = send(kept, current, DeltaPlan(base=version - 1, max_fraction=0.5), version)
        loaded = receive(bucket, baseline)
        assert stats.changed == sum(min(count, t.numel()) for _, t in current)
        assert bucket.index.nbytes < 0.5 * stats.dense_bytes
        for name, tensor in current:  # every tensor is on the engine as sent (a no-change bucket re-sends one value)
            assert torch.equal(bits(baseline[name]), bits(tensor))
            if count:
                assert torch.equal(bits(loaded[name]), bits(tensor))
    expected = math.ceil(sum(t.numel() for _, t in current) / 8)
    assert 0 < bucket.index.nbytes <= expected


def test_version_gap_and_large_delta_travel_whole():
    kept = KeptWeights()
    v1 = model_tensors(0)
    send(kept, v1, DeltaPlan(base=None, max_fraction=0.5), version=1)
    v2 = [(n, changed_copy(t, 2, seed=2)) for n, t in v1]
    gap, _ = send(kept, v2, DeltaPlan(base=0, max_fraction=0.5), version=2)  # the engines hold version 0, not 1
    assert [e.name for e in gap.index.entries] == [n for n, _ in v1] and gap.index.delta
    v3 = [(n, changed_copy(t, t.numel() // 2, seed=3)) for n, t in v2]
    large, stats = send(kept, v3, DeltaPlan(base=2, max_fraction=0.3), version=3)
    assert large.index.nbytes == stats.dense_bytes and [e.name for e in large.index.entries] == [n for n, _ in v1]
    for (_, tensor), (_, view) in zip(v3, unpack(large.index, large.buffer)):
        assert torch.equal(bits(view), bits(tensor))
