"""The wire format of sharded resharding: HF tensor slices moved point to point, trainer rank -> engine rank.

Both halves use it: the trainer ranks send (:mod:`megarl.sync.transports.sharded`), each engine rank
receives the slices it loads and nothing else. One bucket is a list of :class:`~megarl.sync.slices.Transfer`
(which trainer rank sends which :class:`~megarl.sync.slices.Piece` to which engine rank, ranks of the
link's one process group); every rank that takes part in it exchanges one flat byte buffer with each
peer (the pieces of that pair concatenated in plan order, row-major, no padding), all pairs at once
through ``torch.distributed.batch_isend_irecv`` (gloo on CPU, NCCL on GPU).

Over ``/update_weights_from_distributed`` a bucket travels as load format :data:`LOAD_FORMAT`: one entry per
transfer to that engine, its name ``{hf_name}:shard.{src}.{dst}.{dim}.{start}.{stop}`` (``dim`` -1: the
whole tensor), its dtype and the full HF shape. Each engine rank keeps the entries whose ``dst`` is its own
rank in the group.

Delta mode (``sync.delta``): a bucket travels as :data:`BASE_FORMAT` (a full sync: every slice whole, which
the engine rank keeps as its baseline) or :data:`DELTA_FORMAT`, where a slice travels whole, not at all
(unchanged), or as its changed elements in :mod:`megarl.wire.weight_delta`'s encodings: one entry per
encoded part, named ``{slice entry}{suffix}`` (e.g. ``...:shard.0.4.0.0.64:delta.values``), its dtype and
flat 1-D shape. A part's :class:`Piece` is whole and named by that entry.
"""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

import torch

from megarl.wire.weight_delta import base_name

LOAD_FORMAT = "megarl_sharded"
BASE_FORMAT = "megarl_sharded_base"  # delta mode, a full sync: the slices become the engine ranks' baselines
DELTA_FORMAT = "megarl_sharded_delta"  # delta mode: slices whole or as encoded parts, applied to the baselines
FORMATS = (LOAD_FORMAT, BASE_FORMAT, DELTA_FORMAT)
ENTRY = re.compile(r"^(?P<name>.+):shard\.(?P<src>\d+)\.(?P<dst>\d+)\.(?P<dim>-?\d+)\.(?P<start>\d+)\.(?P<stop>\d+)$")


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` along ``dim`` of the HF tensor ``name`` of full ``shape`` and dtype
    ``dtype`` (a ``torch`` attribute name); ``dim`` None: the whole tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim: int | None
    start: int = 0
    stop: int = 0

    @classmethod
    def whole(cls, name: str, dtype: str, shape: tuple[int, ...]) -> Piece:
        return cls(name, dtype, tuple(shape), None, 0, 0)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return self.shape[: self.dim] + (self.stop - self.start,) + self.shape[self.dim + 1:]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.slice_shape:
            numel *= size
        return numel * getattr(torch, self.dtype).itemsize

    def bounds(self, dim: int) -> tuple[int, int]:
        """[start, stop) of this piece along ``dim`` (the whole extent when it is not split there)."""
        return (self.start, self.stop) if self.dim == dim else (0, self.shape[dim])

    def narrow(self, tensor, held: Piece | None = None):
        """This piece of ``tensor``, which holds ``held`` (None: the whole tensor)."""
        if self.dim is None:
            return tensor
        start = self.start - (held.bounds(self.dim)[0] if held is not None else 0)
        return tensor.narrow(self.dim, start, self.stop - self.start)



@dataclass(frozen=True)
class Transfer:
    """``piece`` goes from trainer rank ``src`` (which holds ``held``) to engine rank ``dst``."""

    src: int
    dst: int
    piece: Piece
    held: Piece




def entry_name(transfer: Transfer) -> str:
    """The request entry name of ``transfer`` (see the module docstring)."""
    p = transfer.piece
    if base_name(p.name) != p.name:  # a delta part, named by its entry
        return p.name
    dim = -1 if p.dim is None else p.dim
    return f"{p.name}:shard.{transfer.src}.{transfer.dst}.{dim}.{p.start}.{p.stop}"


def parse_entries(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[int, int, Piece]]:
    """(src, dst, piece) of each request entry; ValueError naming an entry not in the format."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        match = ENTRY.match(base_name(name))
        if match is None:
            raise ValueError(f"{name!r} is not a {LOAD_FORMAT} entry (name:shard.src.dst.dim.start.stop, "
                             "optionally followed by a delta suffix)")
        dim = int(match["dim"])
        piece = (Piece.whole(name, dtype, tuple(shape)) if base_name(name) != name else
                 Piece(match["name"], dtype, tuple(shape), None if dim < 0 else dim, int(match["start"]),
                       int(match["stop"])))
        out.append((int(match["src"]), int(match["dst"]), piece))
    return out


def hf_name(entry: str) -> str:
    """The HF tensor name of a slice entry (or of a delta part's)."""
    return ENTRY.match(base_name(entry))["name"]


def peers(transfers: list[Transfer], rank: int) -> dict[int, list[Transfer]]:
    """The transfers ``rank`` takes part in, by peer (ascending), in plan order."""
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        if rank in (t.src, t.dst) and t.src != t.dst:
            out.setdefault(t.dst if t.src == rank else t.src, []).append(t)
    return dict(sorted(out.items()))


def pack_pair(pieces: list[torch.Tensor], device) -> torch.Tensor:
    """One flat uint8 buffer of ``pieces`` (row-major, back to back) on ``device``."""
    nbytes = sum(p.numel() * p.element_size() for p in pieces)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    offset = 0
    for p in pieces:
        n = p.numel() * p.element_size()
        buffer[offset: offset + n].view(p.dtype).view(p.shape).copy_(p)
        offset += n
    return buffer


def unpack_pair(buffer: torch.Tensor, pieces: list[Piece]) -> list[torch.Tensor]:
    """Views of a received pair buffer as ``pieces`` (their slice shapes, in order)."""
    out, offset = [], 0
    for p in pieces:
        out.append(buffer[offset: offset + p.nbytes].view(getattr(torch, p.dtype)).view(p.slice_shape))
        offset += p.nbytes
    return out


def join_all(group, device, timeout: datetime.timedelta | None = None) -> None:
    """One all-reduce of one element over ``group``, bounded by ``timeout`` (None: the group's): every rank
    of the group calls it once before its first :func:`exchange` (NCCL creates the group's communicator in
    a call every rank takes part in; a ``batch_isend_irecv`` of only some ranks must not be that call)."""
    work = torch.distributed.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
    work.wait() if timeout is None else work.wait(timeout)


def exchange(rank: int, transfers: list[Transfer], outgoing, group, device,
             timeout: datetime.timedelta | None = None) -> list[tuple[Piece, torch.Tensor]]:
    """Run ``rank``'s part of one bucket: send each peer its pieces (``outgoing(transfer)``: the piece's
    values, from what this rank holds) and receive this rank's, all pairs at once, each wait bounded by
    ``timeout`` (None: the group's). Returns (piece, values) of every piece received, in plan order;
    ranks of ``group``'s own numbering."""
    ops, received = [], []
    for peer, pair in peers(transfers, rank).items():
        if pair[0].src == rank:
            buffer = pack_pair([outgoing(t) for t in pair], device)
            ops.append(torch.distributed.P2POp(torch.distributed.isend, buffer, group=group, group_peer=peer))
        else:
            buffer = torch.empty(sum(t.piece.nbytes for t in pair), dtype=torch.uint8, device=device)
            ops.append(torch.distributed.P2POp(torch.distributed.irecv, buffer, group=group, group_peer=peer))
            received.append((pair, buffer))
    for work in torch.distributed.batch_isend_irecv(ops) if ops else []:
        work.wait() if timeout is None else work.wait(timeout)
    return [(t.piece, values) for pair, buffer in received
            for t, values in zip(pair, unpack_pair(buffer, [t.piece for t in pair]))]


def assemble(received: list[tuple[Piece, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor of the full HF shape) per tensor of ``received``, its pieces at their rows: what
    SGLang's weight loader of the receiving rank narrows to the rows it owns, which must be the pieces' (the
    pieces of one tensor, from several senders, go into one tensor: loaded one by one, each would overwrite
    the others' rows). A whole piece is its own tensor. The rows this rank did not receive are NaN (a loader
    that reads them leaves NaN in its parameter: :func:`unreceived_parameters`); a tensor of another dtype
    must be received whole (ValueError naming it otherwise)."""
    by_name: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for piece, values in received:
        by_name.setdefault(piece.name, []).append((piece, values))
    out = []
    for name, parts in by_name.items():
        if len(parts) == 1 and parts[0][0].dim is None:
            out.append((name, parts[0][1]))
            continue
        piece, values = parts[0]
        if values.is_floating_point():
            full = torch.full(piece.shape, float("nan"), dtype=values.dtype, device=values.device)
        elif sum(p.nbytes for p, _ in parts) == Piece.whole(name, piece.dtype, piece.shape).nbytes:
            full = torch.empty(piece.shape, dtype=values.dtype, device=values.device)
        else:
            raise ValueError(f"{name}: a {piece.dtype} tensor arrived in part ({len(parts)} pieces): only "
                             "floating-point tensors may arrive in slices")
        for piece, values in parts:
            piece.narrow(full).copy_(values)
        out.append((name, full))
    return out


def unreceived_parameters(model: torch.nn.Module) -> list[str]:
    """The floating-point parameters of ``model`` holding a NaN: loaded from rows this rank never received
    (:func:`assemble`), or from NaN weights. One pass over the parameters (``amax`` propagates NaN; one
    device synchronisation)."""
    params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point() and p.numel()]
    if not params:
        return []
    peaks = torch.stack([p.detach().amax().float() for _, p in params]).isnan().tolist()
    return [name for (name, _), nan in zip(params, peaks, strict=True) if nan]
