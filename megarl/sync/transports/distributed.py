"""``distributed``: one broadcast per bucket from each stage's sending rank to every engine.

One process group per pipeline stage (``{prefix}-pp{stage}`` with its bound, :func:`group_name`): the
stage's sender is rank 0, the engines' ranks follow (``engine_tp`` ranks per engine, joined through
SGLang's ``/init_weights_update_group``). gloo on CPU, NCCL on GPU. Each bucket goes as SGLang's
``flattened_bucket`` load format (supported by SGLang 0.5.23's receive path,
``_receive_bucketed_weights_from_distributed``): the engine allocates one flat byte buffer from the
bucket's names/dtypes/shapes, receives it in one broadcast and loads the views. A delta-mode bucket
(``sync.delta``) goes the same way as load format ``megarl_delta``
(:mod:`megarl.wire.weight_delta`), which megarl's engine-side load decodes.

The sender joins with ``sglang.srt.utils.common.init_custom_process_group``, the rendezvous SGLang
uses itself (a plain ``torch.distributed.init_process_group`` does not match it and hangs).

Bounds (``sync.timeout_s``, carried in the group name to the engines: :mod:`megarl.engine_process.update_group`):
either side may start first, and the group forms once both have, or both fail after the bound; the
sender waits for each bucket's broadcast at most the bound (``Work.wait`` with a timeout blocks the
CPU on gloo and NCCL alike) and then raises :class:`~megarl.sync.errors.WeightSyncError`, as does a
group that does not form. A gloo broadcast cannot be cancelled: its worker thread ends at the group's
own timeout, the same bound. On NCCL the sender's group is made with the watchdog's error handling
off (:func:`~megarl.sync.transports.groups.group_environment`), so a timed-out weight-sync collective does
not end the trainer's process; the sender aborts the communicator itself (:meth:`DistributedSender.close`).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megarl.platform.description import Platform, detect
from megarl.sync.buckets import Bucket, BucketIndex
from megarl.sync.errors import WeightSyncError, past_bound
from megarl.sync.transports.base import EngineSide, Finish, LinkSpec, Sender, finish_fields
from megarl.sync.transports.groups import group_environment, link_backend, made_in
from megarl.wire.group_timeout import timed_name
from megarl.wire.weight_delta import LOAD_FORMAT as DELTA_LOAD_FORMAT

log = logging.getLogger(__name__)

LOAD_FORMAT = "flattened_bucket"


def group_name(prefix: str, stage: int, timeout_s: float) -> str:
    """Stage ``stage``'s group of the link ``prefix``, marked with its bound for the engines."""
    return timed_name(f"{prefix}-pp{stage}", timeout_s)


@dataclass(frozen=True)
class DistributedSpec(LinkSpec):
    """The ``distributed`` link: one group per pipeline stage, named ``{group_prefix}-pp{stage}`` with
    ``timeout_s`` marked for the engines (:func:`group_name`); the stage's sender is rank 0 and the
    ``engine_ranks`` ranks of the engines follow; ``timeout_s`` bounds the group's formation and each
    broadcast."""

    kind: ClassVar[str] = "distributed"
    group_prefix: str
    engine_ranks: int
    timeout_s: float


class DistributedSender(Sender):
    """Rank 0 of its stage's group; joins it in the constructor (blocks until the engines join, at
    most ``spec.timeout_s``: WeightSyncError)."""

    def __init__(self, spec: DistributedSpec, stage: int, host: str, port: int, platform: Platform | None = None):
        from sglang.srt.utils.common import init_custom_process_group

        super().__init__()
        platform = detect() if platform is None else platform
        backend = link_backend(platform)
        self.device = torch.device("cuda", torch.cuda.current_device()) if platform.is_cuda else torch.device("cpu")
        self.name = group_name(spec.group_prefix, stage, spec.timeout_s)
        self.timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.group = None
        try:
            with made_in(group_environment(backend)):
                self.group = init_custom_process_group(
                    backend=backend, init_method=f"tcp://{host}:{port}", world_size=1 + spec.engine_ranks, rank=0,
                    group_name=self.name, timeout=self.timeout)
        except Exception as e:
            what = f"weight-sync group {self.name} ({spec.engine_ranks} engine ranks at {host}:{port})"
            raise WeightSyncError(f"{past_bound(what, spec.timeout_s)}: {e}") from e
        log.info("weight-sync group %s joined (%d engine ranks, %s)", self.name, spec.engine_ranks, backend)

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return super().adopt(tensor) if tensor.device == self.device else None

    def prepare(self, bucket: Bucket) -> None:
        return None

    def transfer(self, bucket: Bucket) -> None:
        """Broadcast the bucket; WeightSyncError when it is not done within the bound."""
        group = self.group  # held here until the broadcast ends (see close)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        work = torch.distributed.broadcast(bucket.buffer, group=group, group_src=0, async_op=True)
        try:
            work.wait(self.timeout)
        except Exception as e:
            what = f"broadcast of bucket {bucket.index.seq} on group {self.name}"
            raise WeightSyncError(f"{past_bound(what, self.timeout.total_seconds())}: {e}") from e

    def close(self) -> None:
        """Abort the group: local (never waits for the engines, which may be gone) and, on NCCL,
        the end of a collective still queued on it. Returns at once during a transfer: the transfer's
        thread holds the group until its broadcast ends, so that the group's destruction (on gloo it
        joins the worker threads, one of them in the broadcast) happens there, not here."""
        super().close()
        group, self.group = self.group, None
        if group is not None:
            torch.distributed.distributed_c10d._abort_process_group(group)


class DistributedEngineSide(EngineSide):
    """Driver half: forms the groups and posts one ``/update_weights_from_distributed`` per bucket."""

    name = "distributed"

    def __init__(self, timeout_s: float, engine_tp: int = 1):
        self.timeout_s = timeout_s
        self.engine_tp = engine_tp
        self._prefix = ""
        self._groups: list[str] = []

    def link_spec(self, num_engines: int = 0) -> DistributedSpec:
        return DistributedSpec(group_prefix=self._prefix, engine_ranks=num_engines * self.engine_tp,
                               timeout_s=self.timeout_s)

    async def connect(self, trainer, engines: list) -> None:
        """Fresh groups (new names) between every stage's sender and ``engines``."""
        self._prefix = f"megarl-{uuid.uuid4().hex[:12]}"  # group names are never reused in a process
        addresses = [a for a in await trainer.weight_sync_address() if a is not None]
        spec = self.link_spec(len(engines))
        world = 1 + spec.engine_ranks
        joins = [client.init_weights_update_group(
                     master_address=a["host"], master_port=a["port"], rank_offset=1 + i * self.engine_tp,
                     world_size=world, group_name=group_name(self._prefix, a["stage"], self.timeout_s),
                     backend=a["backend"])
                 for a in sorted(addresses, key=lambda a: a["stage"]) for i, client in enumerate(engines)]
        try:
            await asyncio.wait_for(asyncio.gather(trainer.weight_sync_connect(spec), *joins), self.timeout_s)
        except asyncio.TimeoutError:
            what = f"forming the weight-sync groups of {len(addresses)} stages with {len(engines)} engines"
            raise WeightSyncError(past_bound(what, self.timeout_s)) from None
        self._groups = [group_name(self._prefix, a["stage"], self.timeout_s) for a in addresses]
        log.info("weight-sync groups %s: %d stage senders, %d engines", self._groups, len(addresses), len(engines))

    async def disconnect(self, trainer, engines: list) -> None:
        groups, self._groups = self._groups, []
        await trainer.weight_sync_disconnect(self.name)
        for client in engines:
            for name in groups:
                try:
                    await asyncio.wait_for(client.destroy_weights_update_group(name), 30)
                except Exception as e:  # a dead or stuck engine keeps nothing we could free
                    log.warning("%s: destroying group %s failed: %s", client.base_url, name, e)

    async def load(self, engines: list, index: BucketIndex, payload: Any, finish: Finish | None = None) -> None:
        names = [e.name for e in index.entries]
        dtypes = [e.dtype for e in index.entries]
        shapes = [list(e.shape) for e in index.entries]
        name = group_name(self._prefix, index.stage, self.timeout_s)
        load_format = DELTA_LOAD_FORMAT if index.delta else LOAD_FORMAT
        await asyncio.gather(*(client.update_weights_from_distributed(names, dtypes, shapes, group_name=name,
                                                                      load_format=load_format, **finish_fields(finish))
                               for client in engines))
