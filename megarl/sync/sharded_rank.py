"""One trainer rank's part of a ``sharded`` weight sync: its own slices -> a plan -> point-to-point sends.

Every trainer rank takes part (``parallel.pp`` 1). The conversion tasks of the rank
(:func:`megarl.sync.local_export.local_tasks`, built once: they hold the parameters, whose values change
in place) are cut into buckets of at most ``capacity`` bytes of Megatron parameters (the same cut on every
rank: a parameter's local shard has the same size on every rank). For a bucket, ``next`` converts the
rank's shards to HF slices, gathers every rank's list of slices (metadata only, over the trainer's own
group), and plans the transfers into every engine rank (:mod:`megarl.sync.slices`; the same plan on every
rank); ``send`` starts this rank's sends on the send thread and returns, on rank 0, the entries the driver
posts to each engine. Memory: a bucket's slices (views of the parameters, or their HF conversion) and one
send buffer per destination rank of this rank's share.
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import asdict

import torch

from megarl.engines.weight_shards import exchange, join_all
from megarl.sync.buckets import BucketIndex, TensorEntry
from megarl.sync.errors import WeightSyncError, past_bound
from megarl.sync.local_export import LocalSlice, local_tasks, task_slices
from megarl.sync.report import SenderStats
from megarl.sync.slices import EngineRank, engine_piece, plan_transfers
from megarl.sync.transports.base import SenderSpec
from megarl.sync.transports.sharded import device, entries_by_engine, join_link


def cut(sizes: list[int], capacity: int) -> list[range]:
    """Consecutive runs of items of ``sizes`` bytes, each at most ``capacity`` bytes unless one item is
    larger (alone then); ``capacity`` 0: one item each."""
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > capacity:
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        runs.append(range(start, len(sizes)))
    return runs


class ShardedRank:
    """The ``sharded`` link and sync state of one trainer rank over its :class:`megarl.models.bridge.MegatronModel`."""

    def __init__(self, model, spec: SenderSpec):
        self.model = model
        self.spec = spec
        self.rank = torch.distributed.get_rank()
        self.group = join_link(spec, self.rank)
        self.device = device()
        config = model.bridge.hf_pretrained.config
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
        self.engine_ranks = [(spec.trainer_ranks + i, EngineRank(i % spec.engine_tp, spec.engine_tp, spec.expert_ranks))
                             for i in range(spec.engine_ranks)]
        self._tasks: list | None = None
        self._runs: list[range] = []
        self._ready = None
        self._inflight: tuple[threading.Thread, list] | None = None
        self._stats: SenderStats | None = None
        self._seq = 0
        self._joined = False  # join_all ran on the link (before its first exchange)

    def begin(self, capacity: int) -> None:
        if self._tasks is None:
            self._tasks = local_tasks(self.model)
        self._runs = cut([t.param_weight.numel() * t.param_weight.element_size() for t in self._tasks], capacity)
        self._stats = SenderStats(stage=0, capacity=capacity)
        self._seq = 0

    def next(self) -> BucketIndex | None:
        """Plan the next bucket; its index on rank 0 (None elsewhere, and everywhere at the end)."""
        if self._ready is not None:
            raise RuntimeError("a sharded bucket was planned but never sent")
        if not self._runs:
            return None
        t0 = time.perf_counter()
        run = self._runs.pop(0)
        slices = [s for i in run for s in task_slices(self._tasks[i], self.kv_heads)]
        self._stats.convert_s += time.perf_counter() - t0
        transfers, shapes = self._plan(slices)
        self._stats.gather_s += time.perf_counter() - t0
        self._ready = (transfers, {s.piece: s for s in slices})
        self._count(transfers, len(shapes))
        if self.rank != 0:
            return None
        entries = tuple(TensorEntry(name, dtype, shape, 0) for name, (dtype, shape) in shapes.items())
        nbytes = sum(t.piece.nbytes for t in transfers if self._into_first_engine(t.dst))
        self._seq += 1
        return BucketIndex(0, self._seq - 1, entries, nbytes, last=not self._runs)

    def _into_first_engine(self, dst: int) -> bool:
        return dst < self.spec.trainer_ranks + self.spec.engine_tp

    def _plan(self, slices: list[LocalSlice]):
        """Every rank's holdings of this bucket (gathered) -> the transfers into every engine rank; and the
        bucket's HF tensors as name -> (dtype, full shape)."""
        mine = [(s.piece, s.split) for s in slices]
        everyone: list = [None] * self.spec.trainer_ranks
        torch.distributed.all_gather_object(everyone, mine)
        holdings = [(rank, piece) for rank, held in enumerate(everyone) for piece, _ in held]
        splits = {piece.name: (piece, split) for held in everyone for piece, split in held}
        wants = [(dst, want) for dst, engine in self.engine_ranks for piece, split in splits.values()
                 if (want := engine_piece(piece.name, piece.dtype, piece.shape, split, engine, self.num_experts))]
        shapes = {name: (piece.dtype, piece.shape) for name, (piece, _) in splits.items()}
        return plan_transfers(holdings, wants), shapes

    def _count(self, transfers: list, tensors: int) -> None:
        """This rank's counters: bytes it sends to each engine rank and into the first engine (what each
        engine receives from it), its largest send of one bucket; buckets and tensors on rank 0 only (the
        driver sums every rank's)."""
        stats, sent = self._stats, 0
        stats.buckets += 1 if self.rank == 0 else 0
        stats.tensors += tensors if self.rank == 0 else 0
        for t in transfers:
            if t.src == self.rank:
                stats.per_engine_rank[t.dst] = stats.per_engine_rank.get(t.dst, 0) + t.piece.nbytes
                stats.bytes += t.piece.nbytes if self._into_first_engine(t.dst) else 0
                sent += t.piece.nbytes
        stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, sent)
        stats.largest_tensor_bytes = max([stats.largest_tensor_bytes] + [t.piece.nbytes for t in transfers])

    def send(self):
        """Start this rank's sends of the planned bucket; rank 0 returns each engine's entries."""
        self._join()
        if self._ready is None:
            raise RuntimeError("no planned sharded bucket to send: call next first")
        (transfers, held), self._ready = self._ready, None
        errors: list = []

        def outgoing(transfer):
            return transfer.piece.narrow(held[transfer.held].tensor, transfer.held)

        def run():
            t0 = time.perf_counter()
            try:
                bound = datetime.timedelta(seconds=self.spec.timeout_s)
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                if not self._joined:
                    join_all(self.group, self.device, bound)
                    self._joined = True
                exchange(self.rank, transfers, outgoing, self.group, self.device, bound)
            except BaseException as e:  # re-raised on the rank's main thread by _join
                errors.append(e)
            finally:
                self._stats.send_s += time.perf_counter() - t0

        thread = threading.Thread(target=run, name="weight-sync-sharded", daemon=True)
        self._inflight = (thread, errors)
        thread.start()
        if self.rank != 0:
            return None
        return entries_by_engine(transfers, self.spec.trainer_ranks, self.spec.engine_tp,
                                 self.spec.engine_ranks // self.spec.engine_tp)

    def _join(self) -> None:
        if self._inflight is None:
            return
        (thread, errors), self._inflight = self._inflight, None
        thread.join()
        if errors:
            what = f"sharded weight-sync exchange on trainer rank {self.rank}"
            raise WeightSyncError(f"{past_bound(what, self.spec.timeout_s)} or failed: {errors[0]}") from errors[0]

    def finish(self) -> dict:
        """Wait for the last sends; this rank's :class:`SenderStats` as a dict."""
        try:
            self._join()
            if self._ready is not None or self._runs:
                raise RuntimeError("sharded weight sync finished before every bucket was sent")
            return asdict(self._stats)
        finally:
            self._ready, self._runs, self._stats = None, [], None

    def abort(self) -> None:
        """Drop the running sync at once: an exchange in progress is left to its thread, which the link's
        bound ends."""
        if self._inflight is not None and self._inflight[0].is_alive():
            self._inflight = None
        try:
            self._join()
        finally:
            self._ready, self._runs, self._stats = None, [], None

    def close(self) -> None:
        """Abort the group locally (never waits for engines, which may be gone)."""
        group, self.group = self.group, None
        if group is not None:
            torch.distributed.distributed_c10d._abort_process_group(group)
