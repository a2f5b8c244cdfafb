"""The wire format of a delta weight sync: a tensor travels as the elements that changed, or whole.

Both halves use it: the trainer's senders encode (:mod:`megarl.sync.delta`), the engines decode
(:mod:`megarl.engine_process.pipelined_load`). An element changed when its bits differ (so ``-0.0`` vs ``0.0``
and NaN payloads count, and the engine ends bit-identical to a full sync). A tensor of ``n`` elements,
``k`` of them changed, of ``s`` bytes each, travels as the smallest of

- gaps: ``{name}:delta.gaps`` (``k`` 16-bit steps from one changed flat row-major index to the next,
  the first from -1, each stored minus one as int16 bits; only when every step is at most 2**16) and
  ``{name}:delta.values`` (its dtype, ``k`` values): ``k * (2 + s)`` bytes;
- sparse: ``{name}:delta.indices`` (int32, or int64 past 2**31 elements; ``k`` flat indices) and
  ``{name}:delta.values``: ``k * (4 + s)`` bytes;
- bitmap: ``{name}:delta.bitmap`` (uint8, ``ceil(n / 8)``, bit ``i % 8`` of byte ``i // 8`` set when
  element ``i`` changed) and ``{name}:delta.values``: ``ceil(n / 8) + k * s`` bytes;
- dense: the tensor under its own name and shape: ``n * s`` bytes;

and does not travel at all when nothing changed. Values are the new values (not differences): the
decode is a scatter, with no arithmetic to round. A bucket's pieces are ordered by element size,
largest first, so that every piece starts aligned in the flat bucket (SGLang's
``FlattenedTensorBucket`` requires it). Every bucket of a delta-mode sync, whole or encoded, travels
marked (:data:`LOAD_FORMAT`, :data:`BUCKET_FLAG`), so that the engine records what it loads as the
baseline the next delta applies to.
"""
from __future__ import annotations

import math

import torch

LOAD_FORMAT = "megarl_delta"  # a delta-mode bucket over /update_weights_from_distributed (flat, like flattened_bucket)
BUCKET_FLAG = "megarl_delta"  # the key marking a delta-mode bucket dict over /update_weights_from_tensor
INDICES, GAPS, VALUES, BITMAP = ":delta.indices", ":delta.gaps", ":delta.values", ":delta.bitmap"
SUFFIXES = (INDICES, GAPS, VALUES, BITMAP)
MAX_GAP = 2**16
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ (same shape and dtype; on ``new``'s device)."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"cannot compare {new.dtype}{tuple(new.shape)} with {old.dtype}{tuple(old.shape)}")
    bits = _BITS[new.element_size()]
    return new.reshape(-1).view(bits) != old.to(new.device, non_blocking=True).reshape(-1).view(bits)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def encoded_sizes(numel: int, changed: int, element_size: int, max_gap: int | None = None) -> dict[str, int]:
    """Bytes of each encoding of a tensor of ``numel`` elements with ``changed`` of them changed, the
    largest step between changed indices being ``max_gap`` (None: unknown, no gaps encoding)."""
    sizes = {"dense": numel * element_size,
             "sparse": changed * (index_dtype(numel).itemsize + element_size),
             "bitmap": math.ceil(numel / 8) + changed * element_size}
    if max_gap is not None and max_gap <= MAX_GAP:
        sizes["gaps"] = changed * (2 + element_size)
    return sizes


def largest_gap(mask: torch.Tensor) -> int:
    """The largest step between successive changed indices of flat ``mask`` (the first from -1)."""
    indices = mask.nonzero().reshape(-1)
    return int(torch.diff(indices, prepend=indices.new_tensor([-1])).max()) if indices.numel() else 0


def choose(numel: int, changed: int, element_size: int, max_gap: int | None = None) -> str:
    """The smallest encoding (dense on a tie: no decode work)."""
    sizes = encoded_sizes(numel, changed, element_size, max_gap)
    return min(sizes, key=lambda kind: (sizes[kind], kind != "dense"))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """uint8 bitmap of a flat bool ``mask`` (bit ``i % 8`` of byte ``i // 8``)."""
    padded = torch.zeros(math.ceil(mask.numel() / 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat bool mask of ``numel`` elements that :func:`pack_bits` packed."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    return ((bitmap.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()


def encode(name: str, new: torch.Tensor, mask: torch.Tensor, kind: str) -> list[tuple[str, torch.Tensor]]:
    """The pieces of ``new`` in encoding ``kind`` (see :func:`choose`); ``mask``: its changed elements."""
    if kind == "dense":
        return [(name, new)]
    flat = new.reshape(-1)
    values = flat[mask]
    if kind == "sparse":
        return [(name + INDICES, mask.nonzero().reshape(-1).to(index_dtype(flat.numel()))), (name + VALUES, values)]
    if kind == "gaps":
        indices = mask.nonzero().reshape(-1)
        steps = torch.diff(indices, prepend=indices.new_tensor([-1])) - 1
        return [(name + GAPS, steps.to(torch.int32).to(torch.int16)), (name + VALUES, values)]
    if kind == "bitmap":
        return [(name + BITMAP, pack_bits(mask)), (name + VALUES, values)]
    raise ValueError(f"unknown delta encoding {kind!r}")


def aligned_order(pieces: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``pieces`` by element size, largest first (stable): each then starts aligned when packed flat."""
    return sorted(pieces, key=lambda piece: -piece[1].element_size())


def base_name(piece: str) -> str:
    for suffix in SUFFIXES:
        if piece.endswith(suffix):
            return piece[: -len(suffix)]
    return piece


def decode(pieces: list[tuple[str, torch.Tensor]], baseline: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Apply a bucket's ``pieces`` to ``baseline`` (HF name -> the tensor last loaded, on the host;
    changed in place, dense pieces copied in) and return (name, new full tensor) for each tensor the
    bucket carries, in first-piece order. KeyError names a tensor changed without a baseline."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for piece, tensor in pieces:
        name = base_name(piece)
        parts.setdefault(name, {})[piece[len(name):]] = tensor
    out = []
    for name, part in parts.items():
        if "" in part:  # dense
            dense, held = part[""], baseline.get(name)
            if held is not None and held.shape == dense.shape and held.dtype == dense.dtype:
                held.copy_(dense)
            else:
                baseline[name] = dense.to("cpu", copy=True)
            out.append((name, baseline[name]))
            continue
        held = baseline.get(name)
        if held is None:
            raise KeyError(f"{name}: a delta arrived for a tensor this engine holds no baseline of "
                           "(the engine needs a full sync)")
        flat = held.view(-1)
        values = part[VALUES].to("cpu")
        if INDICES in part:
            flat[part[INDICES].to("cpu").long()] = values
        elif GAPS in part:
            flat[torch.cumsum((part[GAPS].to("cpu").long() & 0xFFFF) + 1, 0) - 1] = values
        else:
            flat[unpack_bits(part[BITMAP].to("cpu"), flat.numel())] = values
        out.append((name, held))
    return out
