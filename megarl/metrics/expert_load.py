"""How a step's tokens spread over the experts of each MoE layer, as run metrics.

The counts are tokens per expert (a token routed to k experts counts once at each), per model layer:
``engine`` from the routes the engine generated with (the ones Keep Routing replays), ``trainer`` from
the trainer's own router on the same tokens (its top-k beside the replay, or its choice when routing is
not replayed; :mod:`megarl.trainer.expert_load`). Per layer ``L<n>`` (megatron's 1-based layer number):

- ``experts/<side>/L<n>/max_over_mean``: the busiest expert's tokens over the mean per expert (1: even);
- ``experts/<side>/L<n>/idle_frac``: the share of experts that got no token;
- ``experts/<side>/L<n>/entropy``: the entropy of the load's distribution over experts, in units of
  ``ln E`` (1: even, 0: one expert took every token);
- ``experts/L<n>/load_tv``: the total variation distance between the two loads, half the summed
  absolute difference of their shares: the share of token-expert assignments the trainer's router would
  have sent to other experts, in load terms (what Keep Routing hides);

and over the layers ``experts/<side>/max_over_mean`` (the worst layer's), ``experts/<side>/idle_frac``,
``experts/<side>/entropy`` and ``experts/load_tv`` (their means).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def route_counts(routes: Iterable[np.ndarray], num_experts: int) -> np.ndarray:
    """Tokens per expert and layer, int64 [L, E], of ``routes`` (each a sample's routed experts
    [T-1, L, k], the rows the engine fed)."""
    total = None
    for routed in routes:
        layers = routed.shape[1]
        flat = routed.astype(np.int64).transpose(1, 0, 2).reshape(layers, -1) + \
            num_experts * np.arange(layers)[:, None]
        counts = np.bincount(flat.ravel(), minlength=layers * num_experts).reshape(layers, num_experts)
        total = counts if total is None else total + counts
    if total is None:
        raise ValueError("no routes to count")
    return total


def load_stats(counts: np.ndarray) -> dict[str, float]:
    """``max_over_mean``, ``idle_frac`` and ``entropy`` (module docstring) of one layer's counts [E]."""
    counts = np.asarray(counts, dtype=np.float64)
    experts, total = len(counts), float(counts.sum())
    if total == 0:
        return {}
    shares = counts[counts > 0] / total
    entropy = float(-(shares * np.log(shares)).sum())
    return {"max_over_mean": float(counts.max()) * experts / total, "idle_frac": float((counts == 0).mean()),
            "entropy": entropy / math.log(experts) if experts > 1 else 1.0}


def load_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Total variation distance between two loads [E] (their shares): 0 equal, 1 disjoint."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


def expert_load_metrics(engine: np.ndarray, trainer: np.ndarray | None, layers: Sequence[int]) -> dict[str, float]:
    """The metrics of the module docstring from the counts [L, E] (row ``n - 1``: layer ``n``) of the MoE
    ``layers``; ``trainer`` None: the engine's alone."""
    out: dict[str, float] = {}
    per_side: dict[str, list[dict[str, float]]] = {"engine": [], "trainer": []}
    distances = []
    for n in layers:
        for side, counts in (("engine", engine), ("trainer", trainer)):
            if counts is None or counts[n - 1].sum() == 0:
                continue
            stats = load_stats(counts[n - 1])
            per_side[side].append(stats)
            out |= {f"experts/{side}/L{n}/{k}": v for k, v in stats.items()}
        if trainer is not None and engine[n - 1].sum() > 0 and trainer[n - 1].sum() > 0:
            distances.append(load_distance(engine[n - 1], trainer[n - 1]))
            out[f"experts/L{n}/load_tv"] = distances[-1]
    for side, rows in per_side.items():
        if rows:
            out[f"experts/{side}/max_over_mean"] = max(r["max_over_mean"] for r in rows)
            out |= {f"experts/{side}/{k}": sum(r[k] for r in rows) / len(rows) for k in ("idle_frac", "entropy")}
    if distances:
        out["experts/load_tv"] = sum(distances) / len(distances)
    return out
