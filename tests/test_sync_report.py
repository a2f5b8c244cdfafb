"""A weight sync's report (megarl/sync/report.py): every sender's typed numbers merged into one sync's
(counts summed, the slowest sender's seconds, the largest sizes, bytes per engine rank summed over senders),
and the LoRA adapter sync's report of what it sent (megarl/sync/adapter.py)."""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import fields

import pytest
import torch

from megarl.sync.report import SenderStats, SyncReport

# the stand-ins' sleeps as the sync times them may come out a little short: a 0.2 s sleep once read 0.1997 s here
CLOCK_SLACK_S = 0.01

pytestmark = pytest.mark.unit


def test_every_sender_field_says_how_it_merges():
    assert [f.name for f in fields(SenderStats) if "merge" not in f.metadata] == []


def test_the_report_of_two_stage_senders_sums_counts_and_takes_the_slowest():
    """Two pipeline stages' senders (every engine rank receives every bucket): the report against the sums
    and maxima written out by hand."""
    first = SenderStats(stage=0, bytes=300, buckets=3, tensors=7, gather_s=0.5, convert_s=0.25, send_s=0.125,
                        peak_bucket_bytes=200, largest_tensor_bytes=150, capacity=100, delta=True, elements=70,
                        changed_elements=7, dense_bytes=280)
    second = SenderStats(stage=1, bytes=100, buckets=1, tensors=2, gather_s=0.75, convert_s=0.0625, send_s=0.25,
                         peak_bucket_bytes=100, largest_tensor_bytes=60, capacity=100, delta=False, elements=20,
                         changed_elements=20, dense_bytes=80)
    report = SyncReport.of(first.merge(second), version=5, transport="distributed", engines=2, load_s=1.5,
                           total_s=2.0)
    assert report == SyncReport(version=5, transport="distributed", engines=2, bytes=400, buckets=4, tensors=9,
                                gather_s=0.75, convert_s=0.25, send_s=0.25, load_s=1.5, total_s=2.0,
                                peak_bucket_bytes=200, largest_tensor_bytes=150, delta=True, elements=90,
                                changed_elements=27, dense_bytes=360, bytes_per_engine_rank=400)
    assert report.gbps == 400 / 2.0 / 1e9


def test_sharded_senders_merge_their_counts_per_engine_rank():
    """Three trainer ranks that each send slices to engine ranks 3 and 4: the most one engine rank received is
    the sum over the senders of their counts to it."""
    ranks = [SenderStats(stage=0, bytes=10, buckets=1, per_engine_rank={3: 6, 4: 4}),
             SenderStats(stage=0, bytes=8, per_engine_rank={3: 1, 4: 7}),
             SenderStats(stage=0, bytes=5, per_engine_rank={4: 5})]
    merged = functools.reduce(SenderStats.merge, ranks)
    assert merged.per_engine_rank == {3: 7, 4: 16} and merged.bytes == 23 and merged.buckets == 1
    assert SyncReport.of(merged, 1, "sharded", 1, 0.0, 1.0).bytes_per_engine_rank == 16
    assert ranks[0].per_engine_rank == {3: 6, 4: 4}  # merging leaves the senders' numbers as they were


class AdapterTrainer:
    """Writes a PEFT adapter of three float32 tensors (the export takes ``export_s``)."""

    TENSORS = {"base_model.model.q.lora_A.weight": torch.zeros(4, 8), "base_model.model.q.lora_B.weight":
               torch.ones(16, 4), "base_model.model.o.lora_A.weight": torch.zeros(2, 2)}

    def __init__(self, export_s: float):
        self.export_s = export_s

    async def save_hf_adapter(self, out_dir: str) -> str:
        from pathlib import Path

        from safetensors.torch import save_file

        await asyncio.sleep(self.export_s)
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "adapter_config.json").write_text("{}")
        save_file(self.TENSORS, str(Path(out_dir) / "adapter_model.safetensors"))
        return out_dir


class AdapterEngine:
    """An engine's client that takes ``load_s`` to load an adapter."""

    def __init__(self, url: str, load_s: float):
        self.base_url, self.load_s, self.adapter, self.loaded = url, load_s, None, []

    async def load_lora_adapter(self, name: str, path) -> None:
        await asyncio.sleep(self.load_s)
        self.loaded.append(name)

    async def set_weight_version(self, version: int, abort_all_requests: bool) -> None:
        self.version = version

    async def unload_lora_adapter(self, name: str) -> None:
        return None


def test_an_adapter_sync_reports_what_it_sent(tmp_path):
    """The adapter file's bytes, its tensors and the largest one, every engine rank reading it whole; the
    trainer's export as the gather, the slowest engine's load as the send."""
    from megarl.sync import AdapterSync, SyncSettings

    engines = [AdapterEngine("http://a", 0.02), AdapterEngine("http://b", 0.2)]
    sync = AdapterSync(SyncSettings(transport="distributed", work_dir=str(tmp_path)), AdapterTrainer(0.1), engines)

    async def run():
        t0 = time.perf_counter()
        report = await sync.update(3)
        return report, time.perf_counter() - t0

    report, elapsed = asyncio.run(run())
    file = tmp_path / "adapters" / "v3" / "adapter_model.safetensors"
    sizes = [t.numel() * t.element_size() for t in AdapterTrainer.TENSORS.values()]
    assert (report.transport, report.version, report.engines, report.buckets) == ("adapter", 3, 2, 1)
    assert report.bytes == file.stat().st_size > sum(sizes)  # the tensors and the safetensors header
    assert (report.tensors, report.largest_tensor_bytes) == (3, 256) and max(sizes) == 256
    assert report.bytes_per_engine_rank == report.bytes == report.peak_bucket_bytes
    # the export; the slower engine's load (not the faster's 0.02 s)
    assert report.gather_s >= 0.1 - CLOCK_SLACK_S and report.send_s >= 0.2 - CLOCK_SLACK_S
    assert report.send_s <= report.load_s and report.gather_s + report.load_s == pytest.approx(report.total_s)
    assert report.convert_s == 0.0 and report.total_s <= elapsed
    assert [e.loaded for e in engines] == [[sync.adapter_name(3)]] * 2
