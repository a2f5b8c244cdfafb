"""One trainer rank's part of a ``sharded`` weight sync: its own slices -> a plan -> point-to-point sends.

Every trainer rank takes part (``parallel.pp`` 1). The conversion tasks of the rank
(:func:`megarl.sync.local_export.local_tasks`, built once: they hold the parameters, whose values change
in place) are cut into buckets of at most ``capacity`` bytes of the model (:func:`bucket_runs`: a task
counts the bytes every rank's task at its place covers, so that the HF tensors an engine rank assembles for
one bucket stay within ``capacity``; the same cut on every rank: a parameter's local shard has the same
size on every rank). For a bucket, ``next`` converts the
rank's shards to HF slices, gathers every rank's list of slices (metadata only, over the trainer's own
group), and plans the transfers into every engine rank (:mod:`megarl.sync.slices`; the same plan on every
rank); ``send`` starts this rank's sends on the send thread and returns, on rank 0, the entries the driver
posts to each engine. Memory: a bucket's slices (views of the parameters, or their HF conversion) and one
send buffer per destination rank of this rank's share.

Delta mode (``sync.delta``, :class:`~megarl.sync.delta.DeltaPlan`): the rank keeps a host copy of every
slice it sends, once per distinct slice (engines at one version receive the same values; the slices' dtype,
the one they travel in): this rank's share of the model. When the engines' baseline is the version of that
copy, each slice travels as its changed elements (:func:`megarl.sync.delta.changed_pieces`), whole, or not
at all, and ``next`` gathers every rank's encoded parts (metadata) so that rank 0 can post them; a bucket
whose encoding on this rank exceeds ``max_fraction`` of its slices' bytes travels whole from this rank.
Otherwise (first sync, after a failure or recovery, a version gap) the slices travel whole and the engine
ranks keep them as their baseline (:mod:`megarl.engine_process.sharded_load`).
"""
from __future__ import annotations

import datetime
import threading
import time

import torch

from megarl.sync.abort import wait_unless_aborted
from megarl.sync.buckets import BucketIndex, TensorEntry
from megarl.sync.delta import DeltaPlan, KeptWeights, changed_pieces
from megarl.sync.errors import WeightSyncError, past_bound
from megarl.sync.link import RankContext, RankLink
from megarl.sync.local_export import LocalSlice, local_tasks, task_model_bytes, task_slices
from megarl.sync.report import SenderStats
from megarl.sync.slices import EngineRank, engine_piece, plan_transfers
from megarl.sync.transports.sharded import ShardedSpec, device, entries_by_engine, join_link
from megarl.wire.weight_delta import aligned_order
from megarl.wire.weight_shards import (
    BASE_FORMAT,
    DELTA_FORMAT,
    LOAD_FORMAT,
    Piece,
    Transfer,
    entry_name,
    exchange,
    join_all,
)


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


def bucket_runs(tasks: list, capacity: int) -> list[range]:
    """The buckets of ``tasks`` (:func:`cut`), each covering at most ``capacity`` bytes of the model
    (:func:`~megarl.sync.local_export.task_model_bytes`), not of this rank's shards (TP x EP times more)."""
    return cut([task_model_bytes(t) for t in tasks], capacity)


class SliceDelta:
    """A trainer rank's delta-mode state over the ``sharded`` link: a host copy of each distinct slice it
    sent (keyed by HF name and bounds, in the slices' dtype) and the version they all are of (None while a
    sync runs or after one failed)."""

    def __init__(self):
        self.kept = KeptWeights()
        self.plan: DeltaPlan | None = None
        self.delta = False  # the running sync sends changed elements (else whole)
        self.version = 0

    def begin(self, plan: DeltaPlan, version: int) -> bool:
        """Start a sync to ``version``; whether it sends changed elements (the engines' baseline ``plan.base``
        is the kept copy's version)."""
        self.plan, self.version = plan, version
        self.delta = plan.base is not None and plan.base == self.kept.version
        self.kept.version = None  # partly refreshed until finish
        return self.delta

    def encode(self, values: dict[Transfer, torch.Tensor], counted, stats: SenderStats) -> dict[Transfer, torch.Tensor]:
        """This rank's transfers of one bucket (transfer -> its slice) as they travel: each slice whole, as
        its changed elements (parts named by their entries: :mod:`megarl.wire.weight_shards`) or not at all;
        all whole when the parts exceed ``plan.max_fraction`` of the slices' bytes; ordered by element size,
        largest first (each pair's pieces are packed flat in this order). Refreshes the kept
        copies; counts elements, changed elements and whole bytes of the transfers to ranks ``counted(dst)``."""
        encoded: dict[str, tuple[int, list | None]] = {}
        wire: dict[Transfer, torch.Tensor] = {}
        for t, new in values.items():
            key = f"{t.piece.name}:{t.piece.dim}.{t.piece.start}.{t.piece.stop}"
            if key not in encoded:
                old = self.kept.tensors.get(key)
                encoded[key] = changed_pieces("", new, old) if self.delta else (new.numel(), None)
                self.kept.keep(key, new)
            changed, parts = encoded[key]
            if counted(t.dst):
                stats.elements += new.numel()
                stats.changed_elements += changed
                stats.dense_bytes += t.piece.nbytes
            for suffix, part in [("", new)] if parts is None else parts:
                piece = Piece.whole(entry_name(t) + suffix, str(part.dtype).removeprefix("torch."), tuple(part.shape))
                wire[t if parts is None else Transfer(t.src, t.dst, piece, piece)] = part
        sent = sum(p.numel() * p.element_size() for p in wire.values())
        if sent > self.plan.max_fraction * sum(t.piece.nbytes for t in values):
            return values
        return dict(aligned_order(list(wire.items())))  # each pair's flat buffer: every piece starts aligned

    def finish(self) -> None:
        self.kept.version = self.version


class ShardedLink(RankLink):
    """The ``sharded`` link and sync state of one trainer rank (:class:`~megarl.sync.link.RankContext`)."""

    def __init__(self, rank: RankContext, spec: ShardedSpec):
        self.model = rank.model
        self.aborting = rank.aborting  # the owning RankSync's: set, a wait for the exchange gives up
        self.spec = spec
        self.rank = torch.distributed.get_rank()
        self.group = join_link(spec, self.rank)
        self.device = device()
        config = self.model.bridge.hf_pretrained.config
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_experts = next((n for key in ("num_experts", "num_local_experts", "n_routed_experts")
                                 if (n := getattr(config, key, None))), 0)
        self.engine_ranks = [(spec.trainer_ranks + i, EngineRank(i % spec.engine_tp, spec.engine_layout))
                             for i in range(spec.engine_ranks)]
        self._tasks: list | None = None
        self._runs: list[range] = []
        self._ready = None
        self._inflight: tuple[threading.Thread, list] | None = None
        self._stats: SenderStats | None = None
        self._seq = 0
        self._joined = False  # join_all ran on the link (before its first exchange)
        self._delta = SliceDelta()  # delta mode: what this rank last sent
        self._plan_delta: DeltaPlan | None = None

    def begin(self, version: int, capacity: int, delta: DeltaPlan | None) -> None:
        """Start a sync to ``version`` in buckets of ``capacity`` bytes of parameters; with a ``delta`` plan,
        in delta mode (see the module docstring)."""
        if self._tasks is None:
            self._tasks = local_tasks(self.model)
        self._runs = bucket_runs(self._tasks, capacity)
        self._stats = SenderStats(stage=0, capacity=capacity)
        self._seq = 0
        self._plan_delta = delta
        if delta is not None:
            self._stats.delta = self._delta.begin(delta, version)

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
        held = {s.piece: s for s in slices}
        outgoing = {t: t.piece.narrow(held[t.held].tensor, t.held) for t in transfers if t.src == self.rank}
        if self._plan_delta is not None:
            outgoing = self._delta.encode(outgoing, self._into_first_engine, self._stats)
        everyone = transfers if self._plan_delta is None else self._gather_wire(list(outgoing))
        self._stats.gather_s += time.perf_counter() - t0
        self._ready = (outgoing, everyone)
        self._count(list(outgoing), len(shapes))
        if self.rank != 0:
            return None
        entries = tuple(TensorEntry(name, dtype, shape, 0) for name, (dtype, shape) in shapes.items())
        nbytes = sum(t.piece.nbytes for t in everyone if self._into_first_engine(t.dst))
        self._seq += 1
        return BucketIndex(0, self._seq - 1, entries, nbytes, last=not self._runs, delta=self._plan_delta is not None)

    def _gather_wire(self, mine: list[Transfer]) -> list[Transfer]:
        """Every rank's transfers of the bucket as they travel (rank order; metadata gathered over the
        trainer's group)."""
        everyone: list = [None] * self.spec.trainer_ranks
        torch.distributed.all_gather_object(everyone, [(t.src, t.dst, t.piece) for t in mine])
        return [Transfer(src, dst, piece, piece) for held in everyone for src, dst, piece in held]

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
        (outgoing, everyone), self._ready = self._ready, None
        transfers, errors, group = list(outgoing), [], self.group  # the thread holds the group (see close)

        def run():
            t0 = time.perf_counter()
            try:
                bound = datetime.timedelta(seconds=self.spec.timeout_s)
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                if not self._joined:
                    join_all(group, self.device, bound)
                    self._joined = True
                exchange(self.rank, transfers, outgoing.__getitem__, group, self.device, bound)
            except BaseException as e:  # re-raised on the rank's main thread by _join
                errors.append(e)
            finally:
                self._stats.send_s += time.perf_counter() - t0

        thread = threading.Thread(target=run, name="weight-sync-sharded", daemon=True)
        self._inflight = (thread, errors)
        thread.start()
        if self.rank != 0:
            return None
        fmt = LOAD_FORMAT if self._plan_delta is None else DELTA_FORMAT if self._stats.delta else BASE_FORMAT
        return fmt, entries_by_engine(everyone, self.spec.trainer_ranks, self.spec.engine_tp,
                                      self.spec.engine_ranks // self.spec.engine_tp)

    def _join(self) -> None:
        if self._inflight is None:
            return
        (thread, errors), self._inflight = self._inflight, None
        if not wait_unless_aborted(thread, self.aborting):
            raise WeightSyncError(f"sharded weight sync aborted during an exchange on trainer rank {self.rank}")
        if errors:
            what = f"sharded weight-sync exchange on trainer rank {self.rank}"
            raise WeightSyncError(f"{past_bound(what, self.spec.timeout_s)} or failed: {errors[0]}") from errors[0]

    def finish(self) -> SenderStats:
        """Wait for the last sends; this rank's :class:`SenderStats` (every rank sends)."""
        try:
            self._join()
            if self._ready is not None or self._runs:
                raise RuntimeError("sharded weight sync finished before every bucket was sent")
            if self._plan_delta is not None:
                self._delta.finish()
            return self._stats
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
        """Abort the group locally (never waits for engines, which may be gone); an exchange's thread holds
        the group until it ends, so the group's destruction (gloo joins its workers) happens there."""
        group, self.group = self.group, None
        if group is not None:
            torch.distributed.distributed_c10d._abort_process_group(group)
