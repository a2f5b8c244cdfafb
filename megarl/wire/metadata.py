"""Per-token metadata of a ``/generate`` answer as binary arrays, out of its JSON: the format both sides share
(the engine's HTTP process packs it, :mod:`megarl.engine_process.compact_metadata`; the client unpacks it).

SGLang 0.5.23 answers a request's per-token metadata as JSON: ``routed_experts`` as base64 int32 ids
(4 bytes an id, 752 ids a token for 94 MoE layers x top-8), the sampling mask as one JSON list of kept ids
a token (``output_token_sampling_mask``), and the log-probs as JSON numbers. At the width of a large MoE
this is the largest data stream of an RL step, and a client parsing it spends its CPU on every id.

A ``/generate`` request sent with the header :data:`HEADER` naming the expert ids' dtype (``uint8``,
``int16`` or ``int32``: :func:`expert_dtype` of the served model's experts; streamed requests excepted)
gets a binary answer (:func:`pack_answer`): :data:`MAGIC`, the JSON answer's length (uint64, little
endian), the JSON answer without those fields, then the arrays back to back (each at a multiple of 8
bytes). Each ``meta_info`` names its arrays under :data:`COMPACT` as ``{name: [dtype, offset, count]}``
(offset into the array section):

- ``routed_experts``: the ids in that dtype, [T-1, L, k] row-major, as SGLang orders them;
- ``logprobs``: float32 [R], each response token's log-prob (``output_token_logprobs``' values);
- ``mask_lengths``: uint8 (uint16 past 255 kept ids) [R], each response token's kept-id count;
  ``mask_ids``: int32 [nnz], the kept ids row after row; ``mask_logprobs``: float32,
  ``output_token_sampling_logprobs`` ([R] selected, [nnz] support).

The values are SGLang's own, unchanged: the float32 log-probs SGLang holds (its JSON numbers are their
exact float64 widening) and the ids. :func:`unpack_answer` and :func:`compact_arrays` give them back as
numpy views of the answer's bytes, without a copy or a pass over the ids. The conversion runs in the
engine's HTTP process, where the answer is made, not in the client.
"""
from __future__ import annotations

import functools

import numpy as np
import orjson
import pybase64

HEADER = "X-Megarl-Metadata"  # request header: the expert ids' dtype name; absent: SGLang's JSON fields
COMPACT = "megarl_compact"  # the meta_info key naming the answer's arrays
MAGIC = b"MEGARL-METADATA\x01"  # how a binary answer begins (a JSON one begins with [ or {)
EXPERT_DTYPES = ("uint8", "int16", "int32")

@functools.cache
def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest of uint8, int16, int32 that holds expert ids ``[0, num_experts)``."""
    for name in EXPERT_DTYPES:
        if num_experts - 1 <= np.iinfo(name).max:
            return np.dtype(name)
    raise ValueError(f"{num_experts} experts do not fit int32 ids")


def _b64_ids(b64: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(b64, validate=True), dtype=np.int32)


def metadata_arrays(meta: dict, output_ids: list[int], routes_dtype: np.dtype) -> dict[str, np.ndarray]:
    """Take ``meta``'s per-token fields (those present) out of it, as the arrays of :data:`COMPACT`.
    ValueError when an expert id does not fit ``routes_dtype`` or the log-probs' ids are not ``output_ids``."""
    arrays = {}
    if "routed_experts" in meta:
        ids = _b64_ids(meta.pop("routed_experts"))
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(routes_dtype).max):
            raise ValueError(f"routed expert ids {ids.min()}..{ids.max()} do not fit {routes_dtype}")
        arrays["routed_experts"] = ids.astype(routes_dtype)
    if "output_token_logprobs" in meta:
        pairs = meta.pop("output_token_logprobs")
        if [p[1] for p in pairs] != list(output_ids):
            raise ValueError("output_token_logprobs ids disagree with output_ids")
        arrays["logprobs"] = np.array([p[0] for p in pairs], dtype=np.float32)
    if "output_token_sampling_mask" in meta:
        rows = meta.pop("output_token_sampling_mask")
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        arrays["mask_lengths"] = lengths.astype(np.uint8 if not lengths.size or lengths.max() <= 255 else np.uint16)
        arrays["mask_ids"] = np.fromiter((i for row in rows for i in row), np.int32, int(lengths.sum()))
        values = meta.pop("output_token_sampling_logprobs", [])
        flat = values if not values or not isinstance(values[0], list) else [v for row in values for v in row]
        arrays["mask_logprobs"] = np.array(flat, dtype=np.float32)
        meta.pop("output_token_sampling_mask_length", None)
    return arrays


def pack_answer(answer, routes_dtype: np.dtype) -> bytes:
    """The binary answer (module docstring) of a generate ``answer`` (one dict or a list of them)."""
    section, at = [], 0
    for one in answer if isinstance(answer, list) else [answer]:
        if not (isinstance(one, dict) and isinstance(one.get("meta_info"), dict)):
            continue
        entry = {}
        for name, array in metadata_arrays(one["meta_info"], one.get("output_ids", []), routes_dtype).items():
            entry[name] = [array.dtype.str, at, int(array.size)]
            padded = -array.nbytes % 8
            section += [array.tobytes(), bytes(padded)]
            at += array.nbytes + padded
        one["meta_info"][COMPACT] = entry
    header = orjson.dumps(answer)
    return b"".join([MAGIC, len(header).to_bytes(8, "little"), header, bytes(-len(header) % 8), *section])


def unpack_answer(body: bytes) -> tuple[object, memoryview | None]:
    """(the JSON answer, the array section or None) of an engine's answer ``body``: binary
    (:func:`pack_answer`) or plain JSON. The section is a view of ``body``, not a copy (read-only)."""
    if not body.startswith(MAGIC):
        return orjson.loads(body), None
    start = len(MAGIC) + 8
    end = start + int.from_bytes(body[len(MAGIC):start], "little")
    view = memoryview(body)
    return orjson.loads(view[start:end]), view[end + -end % 8:]


def compact_arrays(entry: dict, section: memoryview) -> dict[str, np.ndarray]:
    """The arrays a :data:`COMPACT` ``entry`` names, views of ``section`` (read-only for a read-only section: a
    consumer that writes copies). ValueError for a malformed entry."""
    try:
        return {name: np.frombuffer(section, dtype=np.dtype(dtype), count=count, offset=offset)
                for name, (dtype, offset, count) in entry.items()}
    except (ValueError, TypeError) as e:  # a dtype that is none, an array past the section's end
        raise ValueError(f"malformed {COMPACT} metadata: {e}") from None
