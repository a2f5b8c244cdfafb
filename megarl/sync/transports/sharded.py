"""``sharded``: each engine rank receives only the HF slices it loads, point to point from the trainer
ranks that hold them; no rank gathers the model.

One process group (``{prefix}-sharded``, marked with ``sync.timeout_s`` for the engines:
:func:`megarl.wire.group_timeout.timed_name`) holds every trainer rank (group rank = trainer rank) and every
engine rank (``trainer_ranks + i * engine_tp + r`` for rank ``r`` of engine ``i``, joined through SGLang's
``/init_weights_update_group``); it meets at trainer rank 0's address, with
``sglang.srt.utils.common.init_custom_process_group`` as SGLang does. gloo on CPU, NCCL on GPU. One group
rather than one per pair: a bucket's transfers run as one ``batch_isend_irecv`` per rank, every pair at
once, and NCCL batches the point-to-point calls of one group into one launch. Bounds as ``distributed``'s:
the group's formation and each bucket's exchange fail after ``sync.timeout_s`` with
:class:`~megarl.sync.errors.WeightSyncError`; a trainer rank aborts its group locally on close.

Each bucket (:mod:`megarl.sync.sharded_rank` on the trainer ranks) is a plan of transfers
(:mod:`megarl.sync.slices`); the driver posts each engine the entries addressed to its ranks as one
``/update_weights_from_distributed`` call in load format ``megarl_sharded`` (in delta mode, ``sync.delta``:
``megarl_sharded_base`` or ``megarl_sharded_delta``, the changed elements of each slice;
:mod:`megarl.wire.weight_shards`, served by :mod:`megarl.engine_process.sharded_load`), while the trainer
ranks send.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megarl.platform.description import detect
from megarl.sync.buckets import BucketIndex
from megarl.sync.engine_layout import EngineLayout, layout_from_server_info
from megarl.sync.errors import WeightSyncError, past_bound
from megarl.sync.transports.base import EngineSide, Finish, LinkSpec, finish_fields
from megarl.sync.transports.groups import group_environment, link_backend, made_in
from megarl.wire.group_timeout import timed_name

log = logging.getLogger(__name__)


def group_name(prefix: str, timeout_s: float) -> str:
    """The sharded group of the link ``prefix``, marked with its bound for the engines."""
    return timed_name(f"{prefix}-sharded", timeout_s)


@dataclass(frozen=True)
class ShardedSpec(LinkSpec):
    """The ``sharded`` link: one group of the ``trainer_ranks`` trainer ranks and the ``engine_ranks`` engine
    ranks (``engine_tp`` per engine), named ``{group_prefix}-sharded`` with ``timeout_s`` marked for the engines
    (:func:`group_name`), meeting at trainer rank 0's ``rendezvous`` (``host:port``); each engine's weights
    split over its ranks as ``engine_layout`` says (read from the engines at connect)."""

    kind: ClassVar[str] = "sharded"
    group_prefix: str
    engine_ranks: int
    timeout_s: float
    engine_tp: int
    engine_layout: EngineLayout | None
    rendezvous: str
    trainer_ranks: int


def join_link(spec: ShardedSpec, rank: int):
    """Join the sharded group as trainer rank ``rank`` (blocks until every member joins, at most
    ``spec.timeout_s``: WeightSyncError); the group."""
    from sglang.srt.utils.common import init_custom_process_group

    backend, name = link_backend(), group_name(spec.group_prefix, spec.timeout_s)
    try:
        with made_in(group_environment(backend)):
            return init_custom_process_group(
                backend=backend, init_method=f"tcp://{spec.rendezvous}", rank=rank, group_name=name,
                world_size=spec.trainer_ranks + spec.engine_ranks, timeout=datetime.timedelta(seconds=spec.timeout_s))
    except Exception as e:
        what = f"weight-sync group {name} ({spec.trainer_ranks} trainer, {spec.engine_ranks} engine ranks)"
        raise WeightSyncError(f"{past_bound(what, spec.timeout_s)}: {e}") from e


class ShardedEngineSide(EngineSide):
    """Driver half: forms the group, posts each engine its entries of every bucket."""

    name = "sharded"

    def __init__(self, timeout_s: float, engine_tp: int = 1):
        self.timeout_s = timeout_s
        self.engine_tp = engine_tp
        self.engine_layout: EngineLayout | None = None  # how the engines split their weights, read at connect
        self._prefix = ""
        self._group = ""
        self._rendezvous = ""
        self._trainer_ranks = 0
        self._linked = False

    def link_spec(self, num_engines: int = 0) -> ShardedSpec:
        return ShardedSpec(group_prefix=self._prefix, engine_ranks=num_engines * self.engine_tp,
                           timeout_s=self.timeout_s, engine_tp=self.engine_tp, engine_layout=self.engine_layout,
                           rendezvous=self._rendezvous, trainer_ranks=self._trainer_ranks)

    async def connect(self, trainer, engines: list) -> None:
        """A fresh group (new name) of every trainer rank and every rank of ``engines``."""
        self._prefix = f"megarl-{uuid.uuid4().hex[:12]}"
        self._group = group_name(self._prefix, self.timeout_s)
        self.engine_layout = await self._engine_layout(engines)
        addresses = await trainer.weight_sync_address()
        if addresses[0] is None or any(a is not None for a in addresses[1:]):
            raise RuntimeError("sync.transport=sharded: trainer rank 0 must be the only sender (parallel.pp=1)")
        first = addresses[0]
        self._rendezvous, self._trainer_ranks = f"{first['host']}:{first['port']}", len(addresses)
        spec = self.link_spec(len(engines))
        world = spec.trainer_ranks + spec.engine_ranks
        joins = [client.init_weights_update_group(
                     master_address=first["host"], master_port=first["port"],
                     rank_offset=spec.trainer_ranks + i * self.engine_tp, world_size=world,
                     group_name=self._group, backend=first["backend"])
                 for i, client in enumerate(engines)]
        await asyncio.wait_for(asyncio.gather(trainer.weight_sync_connect(spec), *joins), self.timeout_s)
        self._linked = True
        log.info("sharded weight-sync group %s: %d trainer ranks, %d engines of %d ranks", self._group,
                 spec.trainer_ranks, len(engines), self.engine_tp)

    async def _engine_layout(self, engines: list) -> EngineLayout:
        """How the engines split their weights, from their resolved server arguments
        (:func:`~megarl.sync.engine_layout.layout_from_server_info`); ValueError naming a setting the slice map
        does not handle, or unless every engine has ``engine_tp`` ranks and the same layout."""
        layouts = set()
        for client in engines:
            try:
                layouts.add(layout_from_server_info(await client.server_info()))
            except ValueError as e:
                raise ValueError(f"sync.transport=sharded: {client.base_url}: {e}") from e
        if len(layouts) != 1 or next(iter(layouts)).tp != self.engine_tp:
            raise ValueError(f"sync.transport=sharded: engines of layouts {sorted(map(str, layouts))}, expected one "
                             f"with tp = rollout.engine_tp = {self.engine_tp}")
        return next(iter(layouts))

    async def disconnect(self, trainer, engines: list) -> None:
        linked, self._linked = self._linked, False
        await trainer.weight_sync_disconnect(self.name)
        if not linked:
            return
        for client in engines:
            try:
                await asyncio.wait_for(client.destroy_weights_update_group(self._group), 30)
            except Exception as e:  # a dead or stuck engine keeps nothing we could free
                log.warning("%s: destroying group %s failed: %s", client.base_url, self._group, e)

    async def load(self, engines: list, index: BucketIndex, payload: Any, finish: Finish | None = None) -> None:
        """``payload``: (load format, per engine the (names, dtypes, shapes) of its entries of this bucket)."""
        load_format, entries = payload
        await asyncio.gather(*(client.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self._group, load_format=load_format,
            **finish_fields(finish)) for client, (names, dtypes, shapes) in zip(engines, entries, strict=True)))


def entries_by_engine(transfers: list, trainer_ranks: int, engine_tp: int, num_engines: int) -> list[tuple]:
    """Per engine, the (names, dtypes, full shapes) of the transfers to its ranks, in plan order."""
    from megarl.wire.weight_shards import entry_name

    out = [([], [], []) for _ in range(num_engines)]
    for t in transfers:
        names, dtypes, shapes = out[(t.dst - trainer_ranks) // engine_tp]
        names.append(entry_name(t))
        dtypes.append(t.piece.dtype)
        shapes.append(list(t.piece.shape))
    return out


def device() -> torch.device:
    """The link's buffers' device on this process's platform: its current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if detect().is_cuda else torch.device("cpu")
