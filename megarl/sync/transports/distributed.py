"""``distributed``: one broadcast per bucket from each stage's sending rank to every engine.

One process group per pipeline stage (``{prefix}-pp{stage}``): the stage's sender is rank 0, the
engines' ranks follow (``engine_tp`` ranks per engine, joined through SGLang's
``/init_weights_update_group``). gloo on CPU, NCCL on GPU. Each bucket goes as SGLang's
``flattened_bucket`` load format (supported by SGLang 0.5.23's receive path,
``_receive_bucketed_weights_from_distributed``): the engine allocates one flat byte buffer from the
bucket's names/dtypes/shapes, receives it in one broadcast and loads the views. A delta-mode bucket
(``sync.delta``) goes the same way as load format ``megarl_delta``
(:mod:`megarl.engines.weight_delta`), which megarl's engine-side load decodes.

The sender joins with ``sglang.srt.utils.common.init_custom_process_group``, the rendezvous SGLang
uses itself (a plain ``torch.distributed.init_process_group`` does not match it and hangs).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import uuid
from typing import Any

import torch

from megarl.engines.weight_delta import LOAD_FORMAT as DELTA_LOAD_FORMAT
from megarl.sync.buckets import Bucket, BucketIndex
from megarl.sync.transports.base import EngineSide, Finish, Sender, SenderSpec, finish_fields

log = logging.getLogger(__name__)

LOAD_FORMAT = "flattened_bucket"


def group_name(prefix: str, stage: int) -> str:
    return f"{prefix}-pp{stage}"


def link_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class DistributedSender(Sender):
    """Rank 0 of its stage's group; joins it in the constructor (blocks until the engines join)."""

    def __init__(self, spec: SenderSpec, stage: int, host: str, port: int):
        from sglang.srt.utils.common import init_custom_process_group

        super().__init__()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.name = group_name(spec.group_prefix, stage)
        self.group = init_custom_process_group(
            backend=link_backend(), init_method=f"tcp://{host}:{port}", world_size=1 + spec.engine_ranks, rank=0,
            group_name=self.name, timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        log.info("weight-sync group %s joined (%d engine ranks, %s)", self.name, spec.engine_ranks, link_backend())

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return super().adopt(tensor) if tensor.device == self.device else None

    def prepare(self, bucket: Bucket) -> None:
        return None

    def transfer(self, bucket: Bucket) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.distributed.broadcast(bucket.buffer, group=self.group, group_src=0)

    def close(self) -> None:
        super().close()
        group, self.group = self.group, None
        if group is not None:
            torch.distributed.destroy_process_group(group)


class DistributedEngineSide(EngineSide):
    """Driver half: forms the groups and posts one ``/update_weights_from_distributed`` per bucket."""

    name = "distributed"

    def __init__(self, timeout_s: float, engine_tp: int = 1):
        self.timeout_s = timeout_s
        self.engine_tp = engine_tp
        self._prefix = ""
        self._groups: list[str] = []

    def sender_spec(self, num_engines: int = 0) -> SenderSpec:
        return SenderSpec(kind=self.name, group_prefix=self._prefix, engine_ranks=num_engines * self.engine_tp,
                          timeout_s=self.timeout_s, engine_tp=self.engine_tp)

    async def connect(self, trainer, engines: list) -> None:
        """Fresh groups (new names) between every stage's sender and ``engines``."""
        self._prefix = f"megarl-{uuid.uuid4().hex[:12]}"  # group names are never reused in a process
        addresses = [a for a in await trainer.weight_sync_address() if a is not None]
        spec = self.sender_spec(len(engines))
        world = 1 + spec.engine_ranks
        joins = [client.init_weights_update_group(
                     master_address=a["host"], master_port=a["port"], rank_offset=1 + i * self.engine_tp,
                     world_size=world, group_name=group_name(self._prefix, a["stage"]), backend=a["backend"])
                 for a in sorted(addresses, key=lambda a: a["stage"]) for i, client in enumerate(engines)]
        await asyncio.wait_for(asyncio.gather(trainer.weight_sync_connect(spec), *joins),
                               self.timeout_s)
        self._groups = [group_name(self._prefix, a["stage"]) for a in addresses]
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
        name = group_name(self._prefix, index.stage)
        load_format = DELTA_LOAD_FORMAT if index.delta else LOAD_FORMAT
        await asyncio.gather(*(client.update_weights_from_distributed(names, dtypes, shapes, group_name=name,
                                                                      load_format=load_format, **finish_fields(finish))
                               for client in engines))
