"""Top-k sampling with sampling masks for SGLang's pytorch sampling backend (megarl's CPU path).

SGLang 0.5.23's ``top_k_top_p_min_p_sampling_from_probs_torch`` sorts only the ``max_top_k``
leading columns of each row (``torch.topk``), since the top-k mask zeroes every later column,
except when it must return the filtered probabilities, which the Keep Sampling Mask capture asks
for on every decode step: then it sorts the whole vocabulary and applies the top-p test to every
column. On the demo's rollout that sort was a tenth of the scheduler's time with masks on.

:func:`sample` keeps SGLang's function and hands it only the ``max_top_k`` largest probabilities
of each row (sorted, with their token ids), then maps the sampled positions and the returned
order back to token ids. Every column past ``max_top_k`` is zeroed by the top-k mask in both
forms, so the kept support, its weights (top-p and min-p are computed from the same leading
columns in the same order), the sampled token's weight and the sampling distribution are
SGLang's; the returned weights and ids are ``max_top_k`` columns wide instead of the vocabulary,
and SGLang's mask packing reads each row up to its support length, at most ``max_top_k``.
Seeded (deterministic) sampling and rows without a top-k bound go to SGLang's function unchanged.
"""
from __future__ import annotations

import torch

_original = None  # SGLang's function, kept by install()


def sample(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
           need_min_p_sampling: bool, sampling_seed, positions, return_filtered_probs: bool = False,
           max_top_k: int | None = None):
    """SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch`` (same arguments and results;
    ``probs`` [batch, vocab] float) with the filtered probabilities computed over the ``max_top_k``
    largest columns only (see the module docstring)."""
    if (not return_filtered_probs or sampling_seed is not None or max_top_k is None
            or max_top_k >= probs.shape[-1]):
        return _original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                         return_filtered_probs=return_filtered_probs, max_top_k=max_top_k)
    top_probs, top_ids = torch.topk(probs, k=max_top_k, dim=-1, sorted=True)
    positions_sampled, weights, order, selected = _original(
        top_probs, top_ks, top_ps, min_ps, need_min_p_sampling, None, positions, return_filtered_probs=True)
    token_ids = top_ids.gather(1, order.long()).to(torch.int32)
    sampled = top_ids.gather(1, positions_sampled.long().view(-1, 1)).view(-1).to(torch.int32)
    return sampled, weights, token_ids, selected


def install() -> None:
    """Route SGLang's pytorch top-k/top-p/min-p sampler in this process through :func:`sample` (idempotent)."""
    global _original
    from sglang.srt.layers import sampler

    if sampler.top_k_top_p_min_p_sampling_from_probs_torch is sample:
        return
    _original = sampler.top_k_top_p_min_p_sampling_from_probs_torch
    sampler.top_k_top_p_min_p_sampling_from_probs_torch = sample
