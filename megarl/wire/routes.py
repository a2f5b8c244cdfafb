"""A request's kept routes as they travel in its sampling parameters' ``custom_params``: written by the
client that resubmits a prefix, read by the engine that replays them
(:mod:`megarl.engine_process.kept_routes`). JSON scalars only, as SGLang's ``custom_params`` require."""
from __future__ import annotations

import numpy as np
import pybase64
import torch

ROUTES_PARAM = "megarl_replay_routes"  # the custom_params key a request's kept rows travel under


def encode_routes(routes: np.ndarray) -> dict:
    """The :data:`ROUTES_PARAM` entry of ``routes`` (integer [n, L, k]): shape and base64 int32 ids
    (JSON scalars only, as SGLang's ``custom_params`` require)."""
    n, layers, topk = routes.shape
    ids = np.ascontiguousarray(routes, dtype=np.int32)
    return {"rows": n, "layers": layers, "topk": topk, "ids": pybase64.b64encode(ids.tobytes()).decode()}


def decode_routes(entry, shape: tuple[int, int], num_experts: int, max_rows: int) -> torch.Tensor:
    """int32 [n, L, k] from an :func:`encode_routes` entry; ValueError naming what is wrong for a
    malformed one: ``shape`` (L, k) is the engine's, ids within ``[0, num_experts)``, at most
    ``max_rows`` rows (a prompt's tokens but its last)."""
    if not isinstance(entry, dict) or set(entry) != {"rows", "layers", "topk", "ids"}:
        raise ValueError(f"custom_params[{ROUTES_PARAM!r}] must hold rows, layers, topk and ids")
    n = entry["rows"]
    if (entry["layers"], entry["topk"]) != tuple(shape) or not isinstance(n, int) or not 0 < n <= max_rows:
        raise ValueError(f"custom_params[{ROUTES_PARAM!r}]: {n} rows of {entry['layers']} x {entry['topk']} "
                         f"where the engine routes {shape[0]} x {shape[1]} for at most {max_rows} rows")
    try:
        flat = np.frombuffer(pybase64.b64decode(entry["ids"]), dtype=np.int32)
    except (ValueError, TypeError):  # not base64, or not whole int32s
        flat = np.zeros(0, np.int32)
    if flat.size != n * shape[0] * shape[1] or (flat.size and flat.view(np.uint32).max() >= num_experts):
        raise ValueError(f"custom_params[{ROUTES_PARAM!r}]: ids are not {n} x {shape[0]} x {shape[1]} experts "
                         f"in [0, {num_experts})")
    return torch.from_numpy(flat.copy()).view(n, *shape)
