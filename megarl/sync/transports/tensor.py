"""``tensor`` (colocated): each engine rank maps a bucket buffer on its own device and copies from it.

The route (:func:`tensor_feeds`): the trainer rank on an engine rank's device feeds it. Each pipeline
stage's sending rank packs the stage's bucket (the stage path, :mod:`megarl.sync.stage_link`) and broadcasts
it, over a process group of the trainer's own (NCCL on GPU, gloo on CPU), to every trainer rank that feeds an
engine rank (:class:`TensorFanout`; the stage sender keeps its own buffer for the engine rank it feeds;
:class:`TensorLink` is a rank's half: the stage path plus this fan-out). Each of
those ranks serialises the buffer it holds for its one engine rank: a CUDA IPC handle of a buffer on that
rank's GPU (no engine process opens another GPU's memory, so none creates a CUDA context there, and an
engine rank on another node than a stage sender still gets its handle from its own node), or on CPU a
POSIX shared-memory file of its node (torch's ``file_system`` sharing strategy: the handle is a file
name; the default ``file_descriptor`` strategy sends descriptors over a socket that SGLang's HTTP path
does not carry, and the server rejects the payload). The driver assembles, per bucket, each engine's list
of per-rank payloads (:meth:`TensorEngineSide.payload`) and posts it to that engine alone. A payload is
SGLang's ``flattened_bucket`` dict (``flattened_tensor`` + ``FlattenedTensorMetadata`` list) pickled with
SGLang's ``MultiprocessingSerializer``, base64 over HTTP to ``/update_weights_from_tensor``, whose
tp_worker deserialises the entry at its rank's index: only handles travel, the bytes are read in place.
A delta-mode bucket's dict also holds ``megarl_delta: True`` (:mod:`megarl.wire.weight_delta`). A
buffer stays alive until the engines have answered (the next bucket reuses it).

Every serialisation of a CUDA tensor takes one reference in the producer's CUDA-IPC reference counts (a
shared-memory segment's count on the CPU), which the one engine rank that opens it gives back: one
serialisation per (engine, engine rank), never one shared by several engines or ranks.

On CPU the ranks keep their shared-memory buffers from one sync to the next, and the engine keeps them
mapped (:mod:`megarl.engine_process.pipelined_load`): a new buffer costs a page fault per 4 KiB on each side,
a large part of a colocated sync. On GPU the buffers are freed after each
sync (device memory the training step needs).

A shared-memory segment's name goes when its last holder frees it (torch's refcount in the segment),
which a SIGKILLed holder never does: a run's trainer ranks (``ray.kill``) and engine servers (killed
with their process group) leave their segments in ``/dev/shm``, one bucket's size each, adding up
over runs. Each rank lists the segments it makes in a manifest
``/dev/shm/megarl-tensor-sync-<pid>``; :func:`remove_orphaned_segments`, run as a rank joins the route,
unlinks the segments of ranks that are gone and that no live process maps.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import ClassVar

import psutil
import torch

from megarl.engines.pinning import shared_trainer_rank
from megarl.engines.shared_memory import SHARED_MEMORY, mapped_segments, unlink_unmapped
from megarl.platform.description import Platform, detect
from megarl.sync.buckets import DTYPES, Bucket, BucketIndex
from megarl.sync.link import RankContext
from megarl.sync.report import SenderStats
from megarl.sync.stage_link import StageLink
from megarl.sync.transports.base import EngineSide, Finish, LinkSpec, Sender, finish_fields
from megarl.wire.weight_delta import BUCKET_FLAG

LOAD_FORMAT = "flattened_bucket"
MANIFEST_PREFIX = "megarl-tensor-sync-"  # + the sender's pid: the names of its segments, one a line


@dataclass(frozen=True)
class TensorSpec(LinkSpec):
    """The ``tensor`` link: the colocated engines it feeds, ``engines`` of ``engine_tp`` ranks each (each rank
    from the trainer rank on its device, :func:`tensor_feeds`)."""

    kind: ClassVar[str] = "tensor"
    engine_tp: int = 1
    engines: int = 0


def tensor_feeds(num_engines: int, engine_tp: int) -> dict[int, tuple[int, int]]:
    """Trainer rank -> the (engine, engine rank) it serves the buckets to: the rank on that engine rank's
    device (:func:`megarl.engines.pinning.shared_trainer_rank`), so every engine rank opens the handles of a
    buffer on its own GPU (in its own node's shared memory on the CPU)."""
    return {shared_trainer_rank(e, r, engine_tp): (e, r) for e in range(num_engines) for r in range(engine_tp)}


def prepare_sharing(cuda: bool) -> None:
    """Make this process's buffers openable by the engines: CUDA IPC handles naming the device by UUID
    (SGLang's reductions), or on CPU shared-memory files (``file_system``), after removing the segments of
    ranks that are gone."""
    if cuda:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # IPC handles name the device by UUID, not by local index
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
        remove_orphaned_segments()


def new_buffer(nbytes: int, cuda: bool) -> torch.Tensor:
    """A 1-D uint8 buffer of ``nbytes`` that an engine on this device can map: on the current GPU, or in
    shared memory from the start (sharing a plain tensor would copy it there), listed in this process's
    manifest."""
    if cuda:
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    if SHARED_MEMORY.is_dir():
        name = storage._share_filename_cpu_()[1].decode().lstrip("/")
        with open(SHARED_MEMORY / f"{MANIFEST_PREFIX}{os.getpid()}", "a") as manifest:
            manifest.write(name + "\n")
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def serialise(buffer: torch.Tensor, index: BucketIndex) -> str:
    """The base64 payload of one engine rank for the bucket ``index`` held in ``buffer`` (one IPC reference)."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metadata = [FlattenedTensorMetadata(name=e.name, shape=torch.Size(e.shape), dtype=DTYPES[e.dtype],
                                        start_idx=e.offset, end_idx=e.offset + e.nbytes, numel=e.nbytes)
                for e in index.entries]
    payload = {"flattened_tensor": buffer[:index.nbytes], "metadata": metadata}
    if index.delta:
        payload[BUCKET_FLAG] = True
    return MultiprocessingSerializer.serialize(payload, output_str=True)


class TensorSender(Sender):
    """A stage sender's buffers, where the engines can map them; the payloads come from :class:`TensorFanout`."""

    def __init__(self, platform: Platform | None = None):
        super().__init__()
        self.cuda = (detect() if platform is None else platform).is_cuda
        prepare_sharing(self.cuda)

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return new_buffer(nbytes, self.cuda)

    def adopt(self, tensor: torch.Tensor) -> None:
        return None  # the engine can map only buffers allocated for sharing

    def prepare(self, bucket: Bucket) -> None:
        """The packing copies land before the bucket is broadcast and read (the route serialises it)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def transfer(self, bucket: Bucket) -> None:
        """Nothing moves here: the route broadcasts the bucket and the engines read it in place."""


class TensorFanout:
    """One trainer rank's part in the route (module docstring), built on every rank when the link forms
    (collective: the groups are made on every rank of the trainer). Its members are the stage senders and
    the ranks that feed an engine rank; each stage's link group is that stage's sender and the feeding ranks.

    :meth:`round`, called on every rank once per bucket round (the driver's ``weight_sync_send``): the
    stage senders' bucket indices go round the members (gloo), each stage's bucket is broadcast over its
    link group in stage order, and each feeding rank returns ``{stage: (engine, engine rank, payload)}``."""

    def __init__(self, spec: TensorSpec, stage: int, is_sender: bool, platform: Platform | None = None):
        import torch.distributed as dist

        self.cuda = (detect() if platform is None else platform).is_cuda
        self.rank = dist.get_rank()
        feeds = tensor_feeds(spec.engines, spec.engine_tp)
        self.feed = feeds.get(self.rank)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, stage if is_sender else None)
        self.senders = {s: r for r, s in enumerate(every) if s is not None}  # stage -> its sending rank
        self.members = sorted(set(feeds) | set(self.senders.values()))
        self.control = dist.new_group(self.members, backend="gloo")
        self.links = {}  # stage -> (its sender, the link group's ranks, the group)
        for s, r in sorted(self.senders.items()):
            ranks = sorted({r} | set(feeds))
            self.links[s] = (r, ranks, dist.new_group(ranks))
        self._buffers: dict[int, torch.Tensor] = {}  # stage -> this rank's receive buffer
        if self.feed is not None:
            prepare_sharing(self.cuda)

    def round(self, bucket: Bucket | None) -> dict[int, tuple[int, int, str]]:
        """This rank's payloads of one round (``bucket``: the one this stage sender sends now, else None)."""
        import torch.distributed as dist

        if self.rank not in self.members:
            return {}
        indices = [bucket.index if bucket is not None else None]
        if len(self.members) > 1:
            indices = [None] * len(self.members)
            dist.all_gather_object(indices, bucket.index if bucket is not None else None, group=self.control)
        held = {index.stage: self._exchange(index, bucket) for index in sorted(
            (i for i in indices if i is not None), key=lambda i: i.stage)}
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the broadcasts landed before an engine reads
        if self.feed is None:
            return {}
        return {stage: (*self.feed, serialise(buffer, index)) for stage, (index, buffer) in held.items()}

    def _exchange(self, index: BucketIndex, bucket: Bucket | None) -> tuple[BucketIndex, torch.Tensor | None]:
        """Stage ``index.stage``'s bucket over its link group: sent from its sender, received by the feeding
        ranks into their buffer for that stage; the index and the buffer this rank now holds it in."""
        import torch.distributed as dist

        sender, ranks, group = self.links[index.stage]
        if self.rank == sender:
            buffer = bucket.buffer
        elif self.rank in ranks:
            buffer = self._buffer(index.stage, index.nbytes)
        else:
            return index, None
        if len(ranks) > 1:
            dist.broadcast(buffer[:index.nbytes], src=sender, group=group)
        return index, buffer

    def _buffer(self, stage: int, nbytes: int) -> torch.Tensor:
        """This rank's receive buffer for ``stage``, at least ``nbytes`` (kept and reused while big enough)."""
        kept = self._buffers.get(stage)
        if kept is None or kept.numel() < nbytes:
            kept = self._buffers[stage] = new_buffer(nbytes, self.cuda)
        return kept

    def finish(self) -> None:
        """A sync ended: GPU buffers are freed (the training step needs the memory), host ones kept."""
        if self.cuda:
            self._buffers.clear()

    def close(self) -> None:
        import torch.distributed as dist

        self._buffers.clear()
        for group in [self.control, *(g for _, _, g in self.links.values())]:
            if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                dist.destroy_process_group(group)
        self.links = {}


class TensorLink(StageLink):
    """A trainer rank's half of the ``tensor`` link: the stage path (the stage senders pack into
    :class:`TensorSender` buffers) plus the route (:class:`TensorFanout`, made on every rank: collective),
    through which every rank takes part in each ``send`` and returns the payloads it made."""

    def __init__(self, rank: RankContext, spec: TensorSpec):
        super().__init__(rank, TensorSender)
        self.fanout = TensorFanout(spec, rank.stage, rank.is_sender)

    def send(self) -> dict[int, tuple[int, int, str]]:
        """One round of the route with the bucket this rank's stage sender sends now (none elsewhere, or
        when its stage has sent its last); this rank's payloads (:meth:`TensorFanout.round`)."""
        started = self.start_transfer()
        return self.fanout.round(None if started is None else started[0])

    def finish(self) -> SenderStats | None:
        stats = super().finish()
        self.fanout.finish()
        return stats

    def close(self) -> None:
        self.fanout.close()
        super().close()


def remove_orphaned_segments() -> list[str]:
    """Unlink the shared-memory segments listed by tensor senders that are gone (and their manifests),
    except those a live process still maps; returns the names unlinked. A live sender's manifest stays."""
    if not SHARED_MEMORY.is_dir():
        return []
    manifests = [m for m in SHARED_MEMORY.glob(MANIFEST_PREFIX + "*")
                 if m.name.removeprefix(MANIFEST_PREFIX).isdigit()
                 and not psutil.pid_exists(int(m.name.removeprefix(MANIFEST_PREFIX)))]
    if not manifests:
        return []
    mapped = mapped_segments()
    removed = []
    for manifest in manifests:
        try:
            names = set(manifest.read_text().split())
        except FileNotFoundError:  # another sender starting at the same time (one per stage) removed it
            continue
        removed += unlink_unmapped(names, mapped)
        if not names & mapped:
            manifest.unlink(missing_ok=True)
    return removed


class TensorEngineSide(EngineSide):
    """The driver's half: per bucket, each engine's list of per-rank payloads from the ranks that feed it.
    Engines are known by their URL, numbered in the order the link first formed with them (the pool's: the
    placement's engine order, which the feeding ranks follow); a recovered engine keeps its number."""

    name = "tensor"

    def __init__(self, engine_tp: int = 1):
        self.engine_tp = engine_tp
        self._numbers: dict[str, int] = {}  # engine URL -> its number in the route

    def link_spec(self, num_engines: int) -> TensorSpec:
        return TensorSpec(engine_tp=self.engine_tp, engines=num_engines)

    async def connect(self, trainer, engines: list) -> None:
        if not self._numbers:
            self._numbers = {client.base_url: i for i, client in enumerate(engines)}
        unknown = [c.base_url for c in engines if c.base_url not in self._numbers]
        if unknown:
            raise ValueError(f"the tensor transport feeds the engines placed with the trainer ranks, not {unknown}")
        await trainer.weight_sync_connect(self.link_spec(len(self._numbers)))

    def payload(self, rank: int, index: BucketIndex, sent: list) -> list[list[str]]:
        """Each engine's payloads of bucket ``index``, by engine number then rank, from every trainer rank's
        :meth:`TensorFanout.round` result (``sent``, by trainer rank)."""
        out = [[None] * self.engine_tp for _ in self._numbers]
        for payloads in sent:
            if payloads and index.stage in payloads:
                engine, engine_rank, payload = payloads[index.stage]
                out[engine][engine_rank] = payload
        missing = [(e, r) for e, ranks in enumerate(out) for r, p in enumerate(ranks) if p is None]
        if missing:
            raise RuntimeError(f"no trainer rank fed engine ranks {missing} bucket {index.seq} of stage {index.stage}")
        return out

    async def load(self, engines: list, index: BucketIndex, payload: list[list[str]],
                   finish: Finish | None = None) -> None:
        await asyncio.gather(*(client.update_weights_from_tensor(payload[self._numbers[client.base_url]],
                                                                 load_format=LOAD_FORMAT, **finish_fields(finish))
                               for client in engines))
