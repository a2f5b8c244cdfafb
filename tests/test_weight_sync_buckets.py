"""Weight-sync buckets without an engine: packing, the index, safetensors shards, settings, and the
sending rank's peak memory during a real gather (RSS sampled in the rank's process)."""
import dataclasses
import threading
import time

import pytest
import torch

from megarl.config import load_config
from megarl.sync import SyncReport, SyncSettings
from megarl.sync.buckets import BucketPacker, pack, unpack
from megarl.sync.transports.disk import write_safetensors

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


def stream():
    """Mixed sizes and dtypes, including one tensor larger than a 4 KiB bucket."""
    gen = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(8, 16, generator=gen)),  # 512 B
        ("b", torch.randn(300, generator=gen)),  # 1200 B
        ("c", torch.randn(40, 40, generator=gen)),  # 6400 B > capacity: travels alone
        ("d", torch.randn(100, generator=gen).to(torch.bfloat16)),  # dtype change closes the bucket
        ("e", torch.randn(7, 3, generator=gen).to(torch.bfloat16)),
        ("f", torch.randn(900, generator=gen)),  # 3600 B
        ("g", torch.randn(200, generator=gen)),  # 800 B: does not fit after f
    ]


def test_packer_round_trip_is_bit_exact_and_respects_capacity():
    tensors = stream()
    buckets = []
    packer = BucketPacker(tensors, capacity=4096)
    while (bucket := packer.next_bucket()) is not None:
        buckets.append(bucket)
    assert [[e.name for e in b.index.entries] for b in buckets] == [["a", "b"], ["c"], ["d", "e"], ["f"], ["g"]]
    assert [b.index.last for b in buckets] == [False] * 4 + [True]  # the driver's last load carries the version
    for seq, bucket in enumerate(buckets):
        assert bucket.index.seq == seq and len({e.dtype for e in bucket.index.entries}) == 1
        assert bucket.buffer.numel() == bucket.index.nbytes
        assert bucket.index.nbytes <= 4096 or len(bucket.index.entries) == 1
        offsets = [e.offset for e in bucket.index.entries]
        assert offsets == sorted(offsets) and offsets[0] == 0  # contiguous, in index order
        assert offsets[1:] == [e.offset + e.nbytes for e in bucket.index.entries[:-1]]
    got = dict(view for bucket in buckets for view in bucket.views())
    for name, tensor in tensors:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert packer.stats.tensors == len(tensors) and packer.stats.largest_tensor_bytes == 6400


def test_planning_without_buffers_gives_the_same_indices():
    sender = BucketPacker(stream(), capacity=4096)
    planner = BucketPacker(stream(), capacity=4096, keep=False)
    while (bucket := sender.next_bucket()) is not None:
        assert planner.next_bucket() == bucket.index
    assert planner.next_bucket() is None


def test_a_tensor_larger_than_a_bucket_can_travel_without_a_copy():
    tensors = stream()
    packer = BucketPacker(tensors, capacity=4096, adopt=lambda t: t.reshape(-1).view(torch.uint8))
    buckets = [packer.next_bucket() for _ in range(3)]
    assert [e.name for e in buckets[1].index.entries] == ["c"]
    assert buckets[1].buffer.data_ptr() == tensors[2][1].data_ptr() and buckets[1].held_bytes == 6400
    assert buckets[0].held_bytes == 4096  # an allocated bucket holds its whole capacity


def test_capacity_zero_is_one_tensor_per_bucket():
    packer = BucketPacker(stream(), capacity=0)
    sizes, last = [], []
    while (bucket := packer.next_bucket()) is not None:
        sizes.append(len(bucket.index.entries))
        last.append(bucket.index.last)
    assert sizes == [1] * len(stream())
    assert last == [False] * (len(stream()) - 1) + [True]


def test_only_the_final_bucket_is_marked_last():
    """Also when the final bucket ends full or is a tensor sent in place (the packer looks ahead)."""
    full, large = [("a", torch.ones(1024))], [("a", torch.ones(8)), ("b", torch.ones(2000))]
    for tensors in (full, large, stream()):
        for adopt in (lambda t: None, lambda t: t.reshape(-1).view(torch.uint8)):
            for keep in (True, False):
                packer = BucketPacker(tensors, capacity=4096, adopt=adopt, keep=keep)
                last = []
                while (item := packer.next_bucket()) is not None:
                    last.append((item.index if keep else item).last)
                assert last and last == [False] * (len(last) - 1) + [True]
    assert BucketPacker([], capacity=4096).next_bucket() is None


def test_pack_and_unpack_reject_bad_input():
    a, b = torch.ones(4), torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        pack([("a", a), ("b", b)])
    with pytest.raises(ValueError, match="empty"):
        pack([])
    bucket = pack([("a", a), ("c", torch.arange(6.0).view(2, 3))])
    assert [(n, t.tolist()) for n, t in bucket.views()] == [("a", [1.0] * 4), ("c", [[0, 1, 2], [3, 4, 5]])]
    with pytest.raises(ValueError, match="needs 40"):
        unpack(bucket.index, bucket.buffer[:20])
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack(bucket.index, bucket.buffer.view(torch.float32))
    with pytest.raises(ValueError, match=">= 0"):
        BucketPacker([], capacity=-1)
    with pytest.raises(ValueError, match="cannot travel"):
        BucketPacker([("z", torch.ones(2, dtype=torch.complex64))], capacity=64).next_bucket()


def test_shard_is_a_valid_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    packer = BucketPacker(stream(), capacity=4096)
    written = {}
    while (bucket := packer.next_bucket()) is not None:
        write_safetensors(tmp_path / f"{bucket.index.seq}.safetensors", bucket)
        written.update(load_file(tmp_path / f"{bucket.index.seq}.safetensors"))
    for name, tensor in stream():
        assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_settings_and_report():
    cfg = load_config(["recipe=tiny_moe_cpu", "sync.transport=tensor", "sync.bucket_mb=64", "sync.work_dir=/tmp/x"])
    s = SyncSettings.from_config(cfg.sync, engine_tp=2)
    assert (s.transport, s.bucket_bytes, s.work_dir, s.timeout_s, s.engine_tp) == ("tensor", 64 * 2**20, "/tmp/x",
                                                                                   600.0, 2)
    with pytest.raises(ValueError, match="one of"):
        dataclasses.replace(s, transport="nccl")
    with pytest.raises(ValueError, match="bucket_mb"):
        dataclasses.replace(s, bucket_mb=-1)
    report = SyncReport(version=3, transport="disk", engines=1, bytes=2_000_000_000, buckets=4, tensors=9,
                        gather_s=0.1, convert_s=0.1, send_s=0.5, load_s=0.5, total_s=2.0, peak_bucket_bytes=0,
                        largest_tensor_bytes=0)
    assert report.gbps == pytest.approx(1.0) and report.metrics()["sync/gbps"] == pytest.approx(1.0)


# --- peak memory on a sending rank ------------------------------------------------------------------

def measure_sync_memory(rank, layout, hf_path, out_dir, capacity):
    """Two disk syncs of the model through RankSync (one process: it is the sender); RSS sampled
    during the second. Returns (baseline RSS, peak RSS, sender stats)."""
    import os

    import psutil

    assert os.environ.get("MALLOC_MMAP_THRESHOLD_") == "65536", "the rank started without the malloc tunable"

    from dataclasses import asdict

    from megarl.models.bridge import ModelSettings, build_megatron_model
    from megarl.sync.rank import RankSync
    from megarl.sync.transports.disk import DiskSpec

    model = build_megatron_model(hf_path, layout, ModelSettings(transformer_impl="local"))
    sync = RankSync(model)
    sync.connect(DiskSpec(work_dir=out_dir))

    def run(version):
        sync.begin("disk", version, capacity)
        while sync.next() is not None:
            sync.send()
        return asdict(sync.finish())

    run(1)  # first export: conversion tasks, caches, the writer's first allocations
    process = psutil.Process()
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.0005)

    baseline = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    stats = run(2)
    stop.set()
    sampler.join()
    return baseline, peak[0], stats


def test_sending_rank_peak_memory_is_two_buckets_plus_the_largest_tensor(tmp_path):
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe
    from megarl.parallel import Layout
    from megarl.trainer.launch import run_ranks

    # glibc returns every allocation above 64 KiB to the system when freed (no dynamic threshold
    # that would park freed buckets in the heap), so RSS follows live memory.
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    spec = TinyMoeSpec(hidden_size=256, num_layers=2, num_experts=16, moe_ffn_hidden_size=512, vocab_size=4096)
    hf_path = make_tiny_moe(tmp_path / "model", spec)
    capacity = 2 * 2**20
    [(baseline, peak, stats)] = run_ranks(measure_sync_memory, Layout(), str(hf_path), str(tmp_path / "out"), capacity,
                                           env=malloc)
    bound = 2 * capacity + stats["largest_tensor_bytes"]
    extra = peak - baseline
    assert stats["bytes"] > 20 * capacity  # the model is much larger than the bound
    assert stats["peak_bucket_bytes"] <= 2 * max(capacity, stats["largest_tensor_bytes"])
    assert extra <= bound, f"peak extra RSS {extra / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"
    print(f"\n[measured] sending rank: {stats['bytes'] / 2**20:.0f} MiB synced in {stats['buckets']} buckets; "
          f"peak extra RSS {extra / 2**20:.1f} MiB <= 2 x {capacity / 2**20:.0f} MiB + largest tensor "
          f"{stats['largest_tensor_bytes'] / 2**20:.1f} MiB = {bound / 2**20:.1f} MiB")
