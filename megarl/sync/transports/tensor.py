"""``tensor`` (colocated): the engine maps the sender's bucket buffer and copies from it.

Each bucket buffer is allocated where another process on the same machine can map it: in CUDA
memory on GPU (serialised as a CUDA IPC handle) and in POSIX shared memory on CPU (torch's
``file_system`` sharing strategy: the handle is a file name; the default ``file_descriptor``
strategy sends descriptors over a socket that SGLang's HTTP path does not carry, and the server
rejects the payload). The payload is SGLang's ``flattened_bucket`` dict (``flattened_tensor`` +
``FlattenedTensorMetadata`` list) pickled with SGLang's ``MultiprocessingSerializer``, base64 over
HTTP to ``/update_weights_from_tensor``: only handles travel, the bytes are read in place. A
delta-mode bucket's dict also holds ``megarl_delta: True`` (:mod:`megarl.engines.weight_delta`). The
buffer stays alive until the engine has answered (the protocol reuses it for the bucket after next).
Each engine TP rank gets a serialisation of its own (SGLang's tp_worker deserialises the payload at
its rank's index): every serialisation of a CUDA tensor takes one reference in the sender's CUDA-IPC
reference counts (a shared-memory segment's count on the CPU), which the one rank that opens it gives
back; a payload opened by several ranks would give back more than it took.

On CPU the sender keeps its (at most two) shared-memory buffers from one sync to the next, and the
engine keeps them mapped (:mod:`megarl.engines.pipelined_load`): a new buffer costs a page fault
per 4 KiB on each side (~50 ms per 256 MiB here), about a third of a colocated sync. On GPU the
buffers are freed after each sync (device memory the training step needs).

A shared-memory segment's name goes when its last holder frees it (torch's refcount in the segment),
which a SIGKILLed holder never does: a run's trainer ranks (``ray.kill``) and engine servers (killed
with their process group) leave their segments in ``/dev/shm`` (64 MiB each in the tiny runs; 1.4 GB
on this machine after a day's tests). Each sender lists the segments it makes in a manifest
``/dev/shm/megarl-tensor-sync-<pid>``; :func:`remove_orphaned_segments`, run as a sender starts,
unlinks the segments of senders that are gone and that no live process maps.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

import psutil
import torch

from megarl.engines.pinning import shared_trainer_rank
from megarl.engines.shared_memory import SHARED_MEMORY, mapped_segments, unlink_unmapped
from megarl.engines.weight_delta import BUCKET_FLAG
from megarl.platform.description import Platform, detect
from megarl.sync.buckets import DTYPES, Bucket, BucketIndex
from megarl.sync.transports.base import EngineSide, Finish, Sender, SenderSpec, finish_fields

LOAD_FORMAT = "flattened_bucket"
MANIFEST_PREFIX = "megarl-tensor-sync-"  # + the sender's pid: the names of its segments, one a line


def tensor_feeds(num_engines: int, engine_tp: int) -> dict[int, tuple[int, int]]:
    """Trainer rank -> the (engine, engine rank) it serves the buckets to: the rank on that engine rank's
    device (:func:`megarl.engines.pinning.shared_trainer_rank`), so every engine rank opens the handles of a
    buffer on its own GPU (in its own node's shared memory on the CPU)."""
    return {shared_trainer_rank(e, r, engine_tp): (e, r) for e in range(num_engines) for r in range(engine_tp)}


class TensorSender(Sender):
    def __init__(self, spec: SenderSpec, platform: Platform | None = None):
        super().__init__()
        self.engine_tp = spec.engine_tp
        self.cuda = (detect() if platform is None else platform).is_cuda
        if self.cuda:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()  # IPC handles name the device by UUID, not by local index
        else:
            torch.multiprocessing.set_sharing_strategy("file_system")
            remove_orphaned_segments()

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        # Allocated in shared memory from the start: sharing a plain tensor would copy it there.
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
        if SHARED_MEMORY.is_dir():
            name = storage._share_filename_cpu_()[1].decode().lstrip("/")
            with open(SHARED_MEMORY / f"{MANIFEST_PREFIX}{os.getpid()}", "a") as manifest:
                manifest.write(name + "\n")
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))

    def adopt(self, tensor: torch.Tensor) -> None:
        return None  # the engine can map only buffers allocated for sharing

    def prepare(self, bucket: Bucket) -> list[str]:
        """One base64 payload per engine TP rank, each serialised on its own (all map the same buffer)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the packing copies land before the engine reads
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        metadata = [FlattenedTensorMetadata(name=e.name, shape=torch.Size(e.shape), dtype=DTYPES[e.dtype],
                                            start_idx=e.offset, end_idx=e.offset + e.nbytes, numel=e.nbytes)
                    for e in bucket.index.entries]
        payload = {"flattened_tensor": bucket.buffer, "metadata": metadata}
        if bucket.index.delta:
            payload[BUCKET_FLAG] = True
        return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(self.engine_tp)]

    def transfer(self, bucket: Bucket) -> None:
        """Nothing moves: the engine reads the buffer in place while it loads."""


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
    name = "tensor"

    def __init__(self, engine_tp: int = 1):
        self.engine_tp = engine_tp

    def sender_spec(self, num_engines: int) -> SenderSpec:
        return SenderSpec(kind=self.name, engine_tp=self.engine_tp)

    async def load(self, engines: list, index: BucketIndex, payload: Any, finish: Finish | None = None) -> None:
        await asyncio.gather(*(client.update_weights_from_tensor(payload, load_format=LOAD_FORMAT,
                                                                 **finish_fields(finish))
                               for client in engines))
