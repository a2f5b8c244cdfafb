"""``disk``: every bucket becomes one safetensors shard; the engines load the directory.

The fallback for engines that cannot join a group or map memory, and the recovery path that
brings a restarted engine to the current version. A sync to version ``v`` writes
``{work_dir}/v{v}.partial/`` (shards ``model-pp{stage}-{seq}.safetensors``, the HF
``config.json`` and ``model.safetensors.index.json``), renames it to ``{work_dir}/v{v}`` only when
complete, and has each engine load it with ``/update_weights_from_disk``. Only the newest complete
version is kept. ``work_dir`` must be visible to the trainer's senders and to the engines.

A bucket's buffer already is the data section of a safetensors file (contiguous tensors, no
gaps), so a shard is written as the JSON header plus the buffer, without another copy.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from megarl.sync.buckets import Bucket, BucketIndex
from megarl.sync.transports.base import EngineSide, Finish, LinkSpec, Sender, finish_fields

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
                      "int64": "I64", "int32": "I32", "int16": "I16", "uint8": "U8"}
INDEX_NAME = "model.safetensors.index.json"


def version_dir(work_dir: str | Path, version: int) -> Path:
    return Path(work_dir) / f"v{version}"


def partial_dir(work_dir: str | Path, version: int) -> Path:
    return Path(work_dir) / f"v{version}.partial"


def shard_name(index: BucketIndex) -> str:
    return f"model-pp{index.stage:02d}-{index.seq:05d}.safetensors"


def write_safetensors(path: Path, bucket: Bucket) -> None:
    """Write ``bucket`` as one safetensors file (header + the buffer's bytes, CPU buffers only)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for e in bucket.index.entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [e.offset, e.offset + e.nbytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(memoryview(bucket.buffer[: bucket.index.nbytes].numpy()))


@dataclass(frozen=True)
class DiskSpec(LinkSpec):
    """The ``disk`` link: the directory the shards are written to (seen by the senders and the engines)."""

    kind: ClassVar[str] = "disk"
    work_dir: str


class DiskSender(Sender):
    """Writes this stage's shards; the stage-0 sender also writes the HF ``config.json``."""

    def __init__(self, spec: DiskSpec, stage: int, hf_config):
        super().__init__()
        self.work_dir = Path(spec.work_dir)
        self.stage = stage
        self.hf_config = hf_config
        self.dir: Path | None = None

    def begin(self, version: int) -> None:
        self.dir = partial_dir(self.work_dir, version)
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.stage == 0:
            self.hf_config.to_json_file(str(self.dir / "config.json"))

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return super().adopt(tensor) if tensor.device.type == "cpu" else None

    def prepare(self, bucket: Bucket) -> str:
        return shard_name(bucket.index)

    def transfer(self, bucket: Bucket) -> None:
        write_safetensors(self.dir / shard_name(bucket.index), bucket)


class DiskEngineSide(EngineSide):
    name = "disk"
    loads_per_bucket = False

    def __init__(self, work_dir: str | Path):
        self.work_dir = Path(work_dir)

    def link_spec(self, num_engines: int) -> DiskSpec:
        return DiskSpec(work_dir=str(self.work_dir))

    def before_sync(self, version: int) -> None:
        """Start version ``version`` from an empty partial directory."""
        partial = partial_dir(self.work_dir, version)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def checkpoint(self, version: int) -> Path | None:
        """The complete checkpoint of ``version``, if one was written."""
        path = version_dir(self.work_dir, version)
        return path if (path / INDEX_NAME).is_file() else None

    async def load(self, engines: list, index: BucketIndex, payload: Any, finish: Finish | None = None) -> None:
        """Nothing per bucket: the shards are loaded as one checkpoint in :meth:`commit`."""

    def finalize(self, version: int, indices: list[BucketIndex], payloads: list) -> Path:
        """Write the index, publish ``v{version}`` atomically and drop older versions."""
        partial = partial_dir(self.work_dir, version)
        weight_map = {e.name: name for index, name in zip(indices, payloads) for e in index.entries}
        total = sum(index.nbytes for index in indices)
        (partial / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=1))
        final = version_dir(self.work_dir, version)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self.work_dir.glob("v*"):
            if old != final and old.is_dir() and not old.name.endswith(".partial"):
                shutil.rmtree(old, ignore_errors=True)
        log.info("weights of version %d written to %s (%d shards, %.1f MB)", version, final, len(indices), total / 1e6)
        return final

    async def commit(self, engines: list, version: int, indices: list[BucketIndex], payloads: list,
                     finish: Finish | None = None) -> None:
        path = self.finalize(version, indices, payloads)
        await asyncio.gather(*(client.load_weights_from_disk(path, **finish_fields(finish)) for client in engines))
