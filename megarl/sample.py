"""The rollout sample: one prompt + one response with everything training needs (docs/architecture.md, "The sample").

Shapes, for P prompt tokens, R response tokens and T = P + R:
``loss_mask`` uint8 [R], ``rollout_logprobs`` float32 [R], ``model_version`` int32 [R],
``routed_experts`` uint8/int16/int32 [T-1, L, k] (the engine's compact expert ids are the smallest of them
that holds the model's experts) (L = the model's layers, k = experts per token) or None
(not requested, or the request was aborted before the engine ran it),
``sampling_mask`` CSR over the R response positions or None (None = full vocabulary),
``token_advantages`` float32 [R] or None (added to ``advantage`` at each response token: on-policy
distillation, per-turn rewards), ``teacher_logprobs`` float32 [R] or None (a teacher's log-prob of each
response token), ``mixed_versions`` bool [R] or None (True where the token was sampled from a forward
that mixed two weight versions: new weights over the KV cache the previous ones computed, after an
``in_place`` pause with a weight update; None = no token mixed), ``turn_ends`` the response offsets
(exclusive) where each policy turn of a multi-turn episode ends (empty for a single turn).
"""
from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_INT32_MAX = int(np.iinfo(np.int32).max)


class FinishReason(str, enum.Enum):
    """Why a response ended."""

    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_new_tokens (or the context) reached
    ABORTED = "aborted"  # cut off by pause/abort; the tokens so far are kept
    ERROR = "error"  # generation or scoring failed


@dataclass(frozen=True)
class SamplingMask:
    """Vocab ids kept by top-k/top-p at each response position, as CSR.

    Row ``i`` (response position i) is ``ids[offsets[i]:offsets[i + 1]]``.
    ids: int32 [nnz]; offsets: int32 [R + 1], offsets[0] == 0, non-decreasing, offsets[-1] == nnz;
    logprobs: float32 [nnz] or None, the engine's log-probability of each kept id under its sampling
    distribution (renormalised over the row), when the engine was asked for them (score centering).
    """

    ids: np.ndarray
    offsets: np.ndarray
    logprobs: np.ndarray | None = None

    def __post_init__(self):
        if self.ids.dtype != np.int32 or self.ids.ndim != 1:
            raise ValueError(f"SamplingMask.ids must be int32 [nnz], got {self.ids.dtype} {self.ids.shape}")
        if self.offsets.dtype != np.int32 or self.offsets.ndim != 1 or self.offsets.size == 0:
            raise ValueError(
                f"SamplingMask.offsets must be int32 [R+1], got {self.offsets.dtype} {self.offsets.shape}"
            )
        if self.offsets[0] != 0 or self.offsets[-1] != self.ids.size or (self.offsets[1:] < self.offsets[:-1]).any():
            raise ValueError(
                f"SamplingMask.offsets must start at 0, never decrease and end at nnz={self.ids.size}; "
                f"got first={self.offsets[0]} last={self.offsets[-1]}"
            )
        if self.logprobs is not None and (self.logprobs.dtype != np.float32 or self.logprobs.shape != self.ids.shape):
            raise ValueError(f"SamplingMask.logprobs must be float32 [nnz={self.ids.size}], got "
                             f"{self.logprobs.dtype} {self.logprobs.shape}")

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]],
                  logprob_rows: Sequence[Sequence[float]] | None = None) -> SamplingMask:
        """CSR from one list of kept vocab ids per response position (and, given, their log-probs, one list
        of the same length per position)."""
        lengths = list(map(len, rows))
        nnz = sum(lengths)
        if nnz > _INT32_MAX:
            raise ValueError(f"sampling mask has {nnz} entries, more than int32 offsets can index")
        offsets = np.fromiter(itertools.accumulate(lengths, initial=0), dtype=np.int32, count=len(rows) + 1)
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=nnz)
        if logprob_rows is None:
            return cls(ids=ids, offsets=offsets)
        if list(map(len, logprob_rows)) != lengths:
            raise ValueError("sampling mask log-probs must have one value per kept id of each row")
        logprobs = np.fromiter(itertools.chain.from_iterable(logprob_rows), dtype=np.float32, count=nnz)
        return cls(ids=ids, offsets=offsets, logprobs=logprobs)

    @property
    def num_rows(self) -> int:
        return self.offsets.size - 1

    def row(self, i: int) -> np.ndarray:
        """Kept vocab ids (int32) at response position ``i``."""
        return self.ids[self.offsets[i] : self.offsets[i + 1]]


@dataclass
class RolloutSample:
    """One prompt + one response; see the module docstring for shapes."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    model_version: np.ndarray
    routed_experts: np.ndarray | None
    sampling_mask: SamplingMask | None
    finish_reason: FinishReason
    reward: float | None = None  # filled by the reward step
    advantage: float | None = None  # filled by the advantage estimator
    group_id: str = ""
    episode_id: str = ""
    turn_ends: tuple[int, ...] = ()
    turn_rewards: tuple[float, ...] = ()  # per-turn (process) rewards, one per turn_ends entry, or empty
    episode_end: str = ""  # why a multi-turn episode ended: done | max_turns | max_tokens | length | error: ...
    token_advantages: np.ndarray | None = None  # filled by token-level estimators (opd, per-turn rewards)
    teacher_logprobs: np.ndarray | None = None  # filled by a teacher's scoring (on-policy distillation)
    role: str = ""  # multi-agent episodes: the role whose turns these are ("" = the one policy)
    # agent episodes: the episode's answers whose text held tool calls, "parsed" / "unparsable" -> count
    tool_calls: dict[str, int] | None = None
    mixed_versions: np.ndarray | None = None  # per token: sampled from a forward mixing two weight versions
    # prompt tokens sent to the engines for this sample (each request's, summed over turns and continuations),
    # and how many of them the engine served from its prefix cache (SGLang's ``cached_tokens``)
    prefill_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self):
        r = len(self.response_ids)
        for name, dtype in (("loss_mask", np.uint8), ("rollout_logprobs", np.float32), ("model_version", np.int32)):
            value = getattr(self, name)
            if value.dtype != dtype or value.shape != (r,):
                raise ValueError(f"{name} must be {np.dtype(dtype)} [{r}], got {value.dtype} {value.shape}")
        if self.routed_experts is not None:
            t = len(self.prompt_ids) + r
            re = self.routed_experts
            if re.dtype not in (np.uint8, np.int16, np.int32) or re.ndim != 3 or re.shape[0] != t - 1:
                raise ValueError(f"routed_experts must be uint8/int16/int32 [T-1={t - 1}, L, k], "
                                 f"got {re.dtype} {re.shape}")
        if self.sampling_mask is not None and self.sampling_mask.num_rows != r:
            raise ValueError(f"sampling_mask has {self.sampling_mask.num_rows} rows, response has {r} tokens")
        for name in ("token_advantages", "teacher_logprobs"):
            value = getattr(self, name)
            if value is not None and (value.dtype != np.float32 or value.shape != (r,)):
                raise ValueError(f"{name} must be float32 [{r}], got {value.dtype} {value.shape}")
        mixed = self.mixed_versions
        if mixed is not None and (mixed.dtype != np.bool_ or mixed.shape != (r,)):
            raise ValueError(f"mixed_versions must be bool [{r}], got {mixed.dtype} {mixed.shape}")
        if any(b <= a for a, b in zip((0, *self.turn_ends), self.turn_ends)) or any(e > r for e in self.turn_ends):
            raise ValueError(f"turn_ends must increase within the response of {r} tokens, got {self.turn_ends}")
        if self.turn_rewards and len(self.turn_rewards) != len(self.turn_ends):
            raise ValueError(f"{len(self.turn_rewards)} turn_rewards for {len(self.turn_ends)} turns")

    @property
    def num_tokens(self) -> int:
        """T = prompt + response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)


# RolloutSample fields stored as arrays by samples_to_bytes (the rest are JSON scalars and lists)
_ARRAYS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "model_version", "routed_experts",
           "token_advantages", "teacher_logprobs", "mixed_versions")
_JSON = ("reward", "advantage", "group_id", "episode_id", "turn_ends", "turn_rewards", "episode_end", "role",
         "tool_calls", "prefill_tokens", "cached_tokens")


def samples_to_bytes(samples: Sequence[RolloutSample]) -> bytes:
    """``samples`` as one compressed ``.npz`` (no pickled objects): every per-token record (ids, loss
    mask, log-probs, versions, routes, sampling mask with its kept ids' log-probs, mixed flags,
    advantages) and the scalar fields, so that :func:`samples_from_bytes` gives equal samples back."""
    import io
    import json

    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, s in enumerate(samples):
        for name in _ARRAYS:
            value = getattr(s, name)
            if value is not None:
                arrays[f"{i}.{name}"] = np.asarray(value, np.int64) if name.endswith("_ids") else value
        if s.sampling_mask is not None:
            arrays[f"{i}.mask_ids"], arrays[f"{i}.mask_offsets"] = s.sampling_mask.ids, s.sampling_mask.offsets
            if s.sampling_mask.logprobs is not None:
                arrays[f"{i}.mask_logprobs"] = s.sampling_mask.logprobs
        meta.append({name: getattr(s, name) for name in _JSON} | {"finish_reason": s.finish_reason.value})
    arrays["meta"] = np.array(json.dumps(meta))
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def samples_from_bytes(data: bytes) -> list[RolloutSample]:
    """The samples :func:`samples_to_bytes` stored, equal to those given to it."""
    import io
    import json

    with np.load(io.BytesIO(data), allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    samples = []
    for i, meta in enumerate(json.loads(str(arrays.pop("meta")))):
        fields = {name: arrays.get(f"{i}.{name}") for name in _ARRAYS}
        fields["prompt_ids"], fields["response_ids"] = fields["prompt_ids"].tolist(), fields["response_ids"].tolist()
        mask = (SamplingMask(arrays[f"{i}.mask_ids"], arrays[f"{i}.mask_offsets"], arrays.get(f"{i}.mask_logprobs"))
                if f"{i}.mask_ids" in arrays else None)
        meta = meta | {"turn_ends": tuple(meta["turn_ends"]), "turn_rewards": tuple(meta["turn_rewards"]),
                       "finish_reason": FinishReason(meta["finish_reason"])}
        samples.append(RolloutSample(**fields, sampling_mask=mask, **meta))
    return samples
