"""Continuation splicing: one sample from an aborted prefix and the rest generated after it."""
from __future__ import annotations

import numpy as np

from megarl.sample import RolloutSample, SamplingMask


def splice_continuation(prefix: RolloutSample, continuation: RolloutSample) -> RolloutSample:
    """One sample from an aborted ``prefix`` and the ``continuation`` generated for the prompt
    ``prefix.prompt_ids + prefix.response_ids``.

    Response, log-probs, per-token model versions, mixed-version flags, loss mask and sampling-mask
    rows (with their log-probs) are concatenated (the prefix's from the engine that made them); the routing
    keeps the prefix's rows for the prompt and prefix tokens it fed and takes the continuation's rows from the
    last prefix token on (the prefix's final token was never fed before the abort, so it has no row there).
    """
    p, m = len(prefix.prompt_ids), len(prefix.response_ids)
    if continuation.prompt_ids != prefix.prompt_ids + prefix.response_ids:
        raise ValueError("the continuation's prompt is not the prefix's prompt + response")
    routing = None
    if continuation.routed_experts is not None:
        if m == 0:
            routing = continuation.routed_experts
        elif prefix.routed_experts is None:
            raise ValueError("the continuation has routed experts, the prefix with tokens has none")
        else:
            routing = np.concatenate([prefix.routed_experts[: p + m - 1], continuation.routed_experts[p + m - 1:]])
    mask = None
    if continuation.sampling_mask is not None:
        if prefix.sampling_mask is None:
            raise ValueError("the continuation has a sampling mask, the prefix has none")
        a, b = prefix.sampling_mask, continuation.sampling_mask
        if (a.logprobs is None) != (b.logprobs is None) and a.ids.size:
            raise ValueError("the prefix's and the continuation's sampling masks disagree on carrying log-probs")
        logprobs = None if b.logprobs is None else np.concatenate(
            [a.logprobs if a.logprobs is not None else np.zeros(0, np.float32), b.logprobs])
        mask = SamplingMask(ids=np.concatenate([a.ids, b.ids]),
                            offsets=np.concatenate([a.offsets, b.offsets[1:] + a.offsets[-1]]).astype(np.int32),
                            logprobs=logprobs)
    return RolloutSample(
        prompt_ids=list(prefix.prompt_ids), response_ids=prefix.response_ids + continuation.response_ids,
        loss_mask=np.concatenate([prefix.loss_mask, continuation.loss_mask]),
        rollout_logprobs=np.concatenate([prefix.rollout_logprobs, continuation.rollout_logprobs]),
        model_version=np.concatenate([prefix.model_version, continuation.model_version]),
        routed_experts=routing, sampling_mask=mask, finish_reason=continuation.finish_reason,
        group_id=prefix.group_id, episode_id=prefix.episode_id,
        mixed_versions=joined_mixed_versions([prefix, continuation]),
        prefill_tokens=prefix.prefill_tokens + continuation.prefill_tokens,
        cached_tokens=prefix.cached_tokens + continuation.cached_tokens,
    )


def joined_mixed_versions(parts: list[RolloutSample]) -> np.ndarray | None:
    """The ``mixed_versions`` of the samples' responses back to back (bool [sum R]); None when none is mixed."""
    if all(p.mixed_versions is None for p in parts):
        return None
    return np.concatenate([np.zeros(len(p.response_ids), bool) if p.mixed_versions is None else p.mixed_versions
                           for p in parts])
