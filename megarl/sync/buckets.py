"""Flat weight buckets: HF-named tensors of one dtype packed into one byte buffer, with an index.

A bucket is what one transport step moves: ``buffer`` is a 1-D ``torch.uint8`` tensor whose bytes
``[offset, offset + nbytes)`` hold each entry's tensor (row-major, no padding), in index order.
That is exactly the layout SGLang's ``FlattenedTensorBucket`` expects (its receive side recomputes
the offsets from names, dtypes and shapes) and, behind a JSON header, the data section of a
safetensors file.

:class:`BucketPacker` cuts a stream of ``(name, tensor)`` into buckets of at most ``capacity``
bytes: a dtype change closes the bucket, and a tensor larger than ``capacity`` travels alone (so a
bucket is at most ``max(capacity, largest tensor)`` bytes). ``capacity=0`` puts every tensor in a
bucket of its own (one engine call per tensor).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
               torch.uint8: "uint8"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a bucket: HF name, dtype name (``torch`` attribute, e.g. "bfloat16"),
    shape, and its byte offset in the bucket's buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class BucketIndex:
    """What a receiver needs to rebuild a bucket: its entries and total size in bytes.

    ``stage`` is the pipeline stage that sent it, ``seq`` its position in that stage's stream,
    ``last`` whether it is that stream's final bucket (the driver's last engine call carries the
    new weight version). ``delta``: a bucket of a delta-mode sync, whose entries may be encoded
    pieces (:mod:`megarl.wire.weight_delta`) and which the engine records as its baseline.
    """

    stage: int
    seq: int
    entries: tuple[TensorEntry, ...]
    nbytes: int
    last: bool = False
    delta: bool = False

    @property
    def dtype(self) -> str:
        return self.entries[0].dtype


@dataclass
class Bucket:
    """A packed bucket: ``buffer`` (uint8, ``index.nbytes`` long) and its index. ``held_bytes``:
    the memory it keeps alive; ``allocation``: the whole buffer it was packed into (None when the
    bucket is a tensor sent in place), which the sender may reuse once the bucket is sent."""

    index: BucketIndex
    buffer: torch.Tensor
    held_bytes: int = 0
    allocation: torch.Tensor | None = None

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) for every entry, as views into ``buffer`` (no copy)."""
        return unpack(self.index, self.buffer)


def unpack(index: BucketIndex, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (uint8, at least ``index.nbytes``) as the index's named tensors."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a bucket buffer is a 1-D uint8 tensor, got {buffer.dtype} of shape {tuple(buffer.shape)}")
    if buffer.numel() < index.nbytes:
        raise ValueError(f"buffer holds {buffer.numel()} bytes, the index needs {index.nbytes}")
    return [(e.name, buffer[e.offset: e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape))
            for e in index.entries]


def pack(named: list[tuple[str, torch.Tensor]], stage: int = 0, seq: int = 0,
         allocate: Callable[[int], torch.Tensor] | None = None) -> Bucket:
    """Pack tensors of one dtype into one new bucket (``allocate(nbytes)`` gives the uint8 buffer)."""
    if not named:
        raise ValueError("cannot pack an empty bucket")
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"a bucket holds one dtype, got {sorted(map(str, dtypes))}")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    buffer = (allocate or _plain)(nbytes)
    entries, offset = [], 0
    for name, tensor in named:
        offset = _copy_in(buffer, offset, tensor)
        entries.append(TensorEntry(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset - _nbytes(tensor)))
    return Bucket(BucketIndex(stage, seq, tuple(entries), nbytes), buffer, nbytes)


def _plain(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _copy_in(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> int:
    """Copy ``tensor`` into ``buffer`` at ``offset``; returns the offset after it."""
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {tensor.dtype} cannot travel in a bucket")
    n = _nbytes(tensor)
    buffer[offset: offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return offset + n


@dataclass
class PackStats:
    """Seconds spent pulling tensors from the stream (``gather``) and copying them in (``convert``)."""

    gather_s: float = 0.0
    convert_s: float = 0.0
    tensors: int = 0
    largest_tensor_bytes: int = 0


@dataclass
class BucketPacker:
    """Cuts a ``(name, tensor)`` stream into buckets of at most ``capacity`` bytes, one at a time.

    ``allocate(nbytes)`` returns the uint8 buffer (plain, shared memory or device memory: the
    transport decides). A tensor larger than ``capacity`` travels alone, and when
    ``adopt(tensor)`` returns a byte view of it, as its own buffer (no second copy of the largest
    tensors). With ``keep=False`` the packer only plans (same boundaries and indices, no
    buffers): ranks that take part in the gather collectives but do not send use it that way.
    The packer holds at most one stream tensor between buckets: it pulls the tensor after a
    bucket before returning it (the one that did not fit, or a look-ahead), so every bucket
    knows whether it is the last.
    """

    stream: Iterable[tuple[str, torch.Tensor]]
    capacity: int
    stage: int = 0
    allocate: Callable[[int], torch.Tensor] = _plain
    adopt: Callable[[torch.Tensor], torch.Tensor | None] = lambda tensor: None
    keep: bool = True
    stats: PackStats = field(default_factory=PackStats)

    def __post_init__(self):
        if self.capacity < 0:
            raise ValueError(f"bucket capacity must be >= 0 bytes, got {self.capacity}")
        self._iter: Iterator = iter(self.stream)
        self._pending: tuple[str, torch.Tensor] | None = None
        self._seq = 0
        self._done = False

    def _pull(self) -> tuple[str, torch.Tensor] | None:
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        if self._done:
            return None
        t0 = time.perf_counter()
        try:
            name, tensor = next(self._iter)
        except StopIteration:
            self._done = True
            return None
        finally:
            self.stats.gather_s += time.perf_counter() - t0
        self.stats.tensors += 1
        self.stats.largest_tensor_bytes = max(self.stats.largest_tensor_bytes, _nbytes(tensor))
        return name, tensor

    @property
    def exhausted(self) -> bool:
        """Whether :meth:`next_bucket` has returned the stream's last bucket (it returns None from now on)."""
        return self._done and self._pending is None

    def next_bucket(self) -> Bucket | BucketIndex | None:
        """The next bucket (a :class:`Bucket`, or only its :class:`BucketIndex` when ``keep`` is
        False), or None when the stream is exhausted."""
        first = self._pull()
        if first is None:
            return None
        dtype = first[1].dtype
        if _nbytes(first[1]) > self.capacity:
            adopted = self.adopt(first[1]) if self.keep else None
            if adopted is not None:
                name, tensor = first
                entry = TensorEntry(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), 0)
                return self._finish([entry], adopted, adopted.numel(), None)
        size = max(self.capacity, _nbytes(first[1]))
        buffer = self.allocate(size) if self.keep else None
        entries, offset, item = [], 0, first
        while item is not None:
            name, tensor = item
            n = _nbytes(tensor)
            if entries and (tensor.dtype != dtype or offset + n > size):
                self._pending = item
                break
            if tensor.dtype not in DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {tensor.dtype} cannot travel in a bucket")
            t0 = time.perf_counter()
            if buffer is not None:
                _copy_in(buffer, offset, tensor)
            self.stats.convert_s += time.perf_counter() - t0
            entries.append(TensorEntry(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset))
            offset += n
            del tensor, item
            item = self._pull() if offset < size else None
        return self._finish(entries, None if buffer is None else buffer[:offset], size, buffer)

    def _finish(self, entries: list[TensorEntry], buffer: torch.Tensor | None, held: int,
                allocation: torch.Tensor | None) -> Bucket | BucketIndex:
        if self._pending is None:
            self._pending = self._pull()  # look ahead: is this the stream's last bucket?
        index = BucketIndex(self.stage, self._seq, tuple(entries), sum(e.nbytes for e in entries),
                            last=self._pending is None)
        self._seq += 1
        return index if buffer is None else Bucket(index, buffer, held, allocation)
