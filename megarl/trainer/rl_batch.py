"""Rollout samples -> the ragged tensors one RL training step consumes.

A sample of T tokens (P prompt + R response) gives T-1 input positions; input position ``j``
predicts token ``j+1``, so response token ``r`` is predicted at position ``P-1+r``. The batch holds
the positions of all samples back to back (``cu_seqlens``); :mod:`megarl.trainer.packing` turns a
micro-batch of them into packed or padded model inputs.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megarl.algos.advantages import group_index
from megarl.sample import RolloutSample
from megarl.trainer.device import to_device
from megarl.trainer.logprobs import CsrMask


@dataclass
class RLBatch:
    """B samples, N positions in all. Per position: ``tokens``/``targets`` int64 [N],
    ``loss_mask`` float32 [N] (1 where the policy generated the target from one weight version),
    ``mixed_versions`` bool [N] or None (True where the policy generated the target from a forward
    that mixed two weight versions: left out of the loss, ``loss_mask`` 0 there, and counted by
    :attr:`mixed_tokens`), ``rollout_logprobs``
    float32 [N] (0 outside the response), ``staleness`` int32 [N] (the trainer's weight version
    minus the ``model_version`` of the target on response positions, 0 elsewhere),
    ``routed_experts`` uint8 (every sample's ids uint8) or int16 [N, L, k] or None, the sampling mask as CSR
    (int32 ids, int64 offsets) over the N positions
    (empty rows = full vocabulary) or None, ``token_advantages`` float32 [N] (added to the sample's
    advantage on response positions, 0 elsewhere) or None, ``old_logprobs`` float32 [N] (the trainer's
    log-probs before the step's first update, :func:`megarl.trainer.rl_step.policy_logprobs`; 0 off the
    trained positions) or None, ``old_values`` and ``returns`` float32 [N] (the critic's values before the
    step and the GAE returns, :mod:`megarl.algos.gae`; 0 off the trained positions) or None. Per sample:
    ``cu_seqlens`` int64 [B + 1], ``advantages`` float32 [B], ``group_ids`` int64 [B] (its prompt group, numbered
    in order of first appearance; :func:`megarl.algos.advantages.group_index`) or None. Unpickled on a trainer
    rank, ``routed_experts`` and the sampling mask's tensors may be read-only memory (:meth:`__setstate__`):
    never written in place."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    staleness: torch.Tensor
    cu_seqlens: torch.Tensor
    advantages: torch.Tensor
    routed_experts: Optional[torch.Tensor]
    sampling_mask: Optional[CsrMask]
    token_advantages: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    mixed_versions: Optional[torch.Tensor] = None
    old_values: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.advantages)

    @property
    def mixed_tokens(self) -> int:
        """Targets left out of the loss because their forward mixed two weight versions."""
        return 0 if self.mixed_versions is None else int(self.mixed_versions.sum())

    @property
    def lengths(self) -> torch.Tensor:
        """Positions per sample, int64 [B]."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def select(self, indices: Sequence[int]) -> RLBatch:
        """The samples ``indices``, in that order, as a batch of their own: each column's rows of a sample are
        one slice of it (a sample's positions, and their mask entries, lie side by side), copied once."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        lengths = self.lengths[idx]
        starts = self.cu_seqlens[:-1][idx]
        spans = _merged(zip(starts.tolist(), (starts + lengths).tolist()))
        cu = torch.zeros(len(idx) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=cu[1:])
        mask = None
        if self.sampling_mask is not None:
            offsets = self.sampling_mask.offsets.long()
            new_offsets = torch.zeros(int(cu[-1]) + 1, dtype=torch.long)
            torch.cumsum(_cut(offsets[1:] - offsets[:-1], spans), 0, out=new_offsets[1:])
            entries = _merged(zip(offsets[starts].tolist(), offsets[starts + lengths].tolist()))
            logprobs = self.sampling_mask.logprobs
            mask = CsrMask(_cut(self.sampling_mask.ids, entries), new_offsets,
                           None if logprobs is None else _cut(logprobs, entries))
        per_position = {name: None if getattr(self, name) is None else _cut(getattr(self, name), spans)
                        for name in _PER_POSITION}
        return RLBatch(**per_position, cu_seqlens=cu, advantages=self.advantages[idx], sampling_mask=mask,
                       group_ids=None if self.group_ids is None else self.group_ids[idx])

    def to(self, device: torch.device) -> RLBatch:
        """This batch with every tensor on ``device``."""
        mask = self.sampling_mask
        if mask is not None:
            mask = CsrMask(to_device(mask.ids, device), to_device(mask.offsets, device),
                           None if mask.logprobs is None else to_device(mask.logprobs, device))
        moved = {f.name: to_device(getattr(self, f.name), device) for f in dataclasses.fields(self)
                 if f.name != "sampling_mask"}
        return RLBatch(**moved, sampling_mask=mask)

    def __getstate__(self) -> dict:
        """Pickled (Ray's transfer to a trainer rank) with each host tensor as a numpy array, which pickle's
        protocol 5 hands over out of band, without a copy in the sender (torch pickles a tensor's bytes
        in band); :meth:`__setstate__` makes them tensors again."""
        state = {name: _as_numpy(value) for name, value in vars(self).items() if name != "sampling_mask"}
        mask = self.sampling_mask
        state["sampling_mask"] = None if mask is None else tuple(map(_as_numpy, (mask.ids, mask.offsets,
                                                                                 mask.logprobs)))
        return state

    def __setstate__(self, state: dict) -> None:
        """The batch :meth:`__getstate__` gave. The routes and the sampling mask (most of a step's bytes at MoE
        width, which a rank only reads) stay over the memory they arrived in, read-only where it is (Ray's object
        store); every other array becomes a tensor over writable memory (its own, or a copy)."""
        mask = state.pop("sampling_mask")
        vars(self).update({name: _as_tensor(value, shared=name == "routed_experts") for name, value in state.items()})
        self.sampling_mask = None if mask is None else CsrMask(*(_as_tensor(a, shared=True) for a in mask))

    def position_advantages(self) -> torch.Tensor:
        """The advantage at every position, float32 [N]: the sample's, plus its token advantage."""
        per_sample = torch.repeat_interleave(self.advantages, self.lengths, output_size=len(self.tokens))
        return per_sample if self.token_advantages is None else per_sample + self.token_advantages


_PER_POSITION = ("tokens", "targets", "loss_mask", "rollout_logprobs", "staleness", "routed_experts",
                 "token_advantages", "old_logprobs", "mixed_versions", "old_values", "returns")


def _as_numpy(value):
    """A host tensor's numpy view (anything else as it is)."""
    return value.numpy() if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value


def _as_tensor(value, shared: bool = False):
    """A numpy array as a tensor over its memory when writable or ``shared`` (read-only then: never written in
    place), else over a copy; anything else as it is."""
    if not isinstance(value, np.ndarray):
        return value
    if value.flags.writeable:
        return torch.from_numpy(value)
    if not shared:
        return torch.from_numpy(value.copy())
    with warnings.catch_warnings():  # torch's warning that it cannot mark the tensor read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(value)


def _merged(spans) -> list[tuple[int, int]]:
    """``spans`` ``[a, b)`` in order, each that begins where the one before ends joined to it (samples taken in
    the batch's order are one span, cut in one piece)."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _cut(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``[a, b)`` of ``tensor`` for each span, back to back (one copy)."""
    return torch.cat([tensor[a:b] for a, b in spans]) if spans else tensor[:0].clone()


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))`` without a Python loop."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - first, lengths, output_size=total) + torch.arange(total)


def build_rl_batch(samples: Sequence[RolloutSample], with_routing: bool = True, with_sampling_mask: bool = True,
                   with_advantages: bool = True, trainer_version: int | None = None) -> RLBatch:
    """The :class:`RLBatch` of ``samples`` (advantages filled, or 0 without ``with_advantages``).
    ``trainer_version``: the weight version the trainer holds, for ``staleness`` (None: every token
    counts as fresh, staleness 0). Tokens a sample marks in ``mixed_versions`` get loss mask 0 (no
    weight version gives their log-prob or routes). Raises ValueError for a sample without advantage, with
    inconsistent per-token fields, or with a token newer than ``trainer_version``."""
    if not samples:
        raise ValueError("an RL batch needs at least one sample")
    for b, sample in enumerate(samples):
        _check_sample(b, sample, with_advantages)
    prompt = np.fromiter((len(s.prompt_ids) for s in samples), np.int64, len(samples))
    response = np.fromiter((len(s.response_ids) for s in samples), np.int64, len(samples))
    lengths = prompt + response - 1  # positions per sample
    n = int(lengths.sum())
    cu = torch.zeros(len(samples) + 1, dtype=torch.long)
    torch.cumsum(torch.from_numpy(lengths), 0, out=cu[1:])
    seq = np.fromiter(itertools.chain.from_iterable(itertools.chain(s.prompt_ids, s.response_ids) for s in samples),
                      np.int64, n + len(samples))
    ends = np.cumsum(lengths + 1)
    not_last, not_first = np.ones(len(seq), bool), np.ones(len(seq), bool)
    not_last[ends - 1], not_first[ends - (lengths + 1)] = False, False
    # response token r of sample b is predicted at position cu[b] + P_b - 1 + r
    at = _ranges(cu[:-1] + torch.from_numpy(prompt) - 1, torch.from_numpy(response)).numpy()
    per_position = _scatter_responses(samples, at, n, trainer_version, with_advantages=with_advantages)
    routed = _routing(samples, lengths) if with_routing else None
    mask = _sampling_mask(samples, at, n) if with_sampling_mask else None
    return RLBatch(
        tokens=torch.from_numpy(seq[not_last]), targets=torch.from_numpy(seq[not_first]), **per_position,
        cu_seqlens=cu, advantages=torch.tensor([float(s.advantage) if with_advantages else 0.0 for s in samples],
                                                dtype=torch.float32),
        routed_experts=routed, sampling_mask=mask, group_ids=group_index([s.group_id for s in samples]))


def _check_sample(b: int, sample: RolloutSample, with_advantages: bool) -> None:
    """ValueError naming sample ``b`` if it cannot be trained on."""
    P, R = len(sample.prompt_ids), len(sample.response_ids)
    if with_advantages and sample.advantage is None:
        raise ValueError(f"sample {b} ({sample.group_id}) has no advantage")
    if len(sample.loss_mask) != R or len(sample.rollout_logprobs) != R:
        raise ValueError(f"sample {b}: loss_mask/rollout_logprobs must have one entry per response token ({R})")
    if P < 1 or R < 1:
        raise ValueError(f"sample {b}: needs at least one prompt and one response token (got {P}, {R})")


def _scatter_responses(samples: Sequence[RolloutSample], at: np.ndarray, n: int, trainer_version: int | None, *,
                       with_advantages: bool) -> dict[str, Optional[torch.Tensor]]:
    """The per-position fields that come from the response tokens, placed at positions ``at`` of ``n``."""
    def placed(values: np.ndarray, dtype) -> np.ndarray:
        out = np.zeros(n, dtype)
        out[at] = values
        return out

    response_mask = np.concatenate([s.loss_mask for s in samples])
    loss_mask = placed(response_mask, np.float32)
    staleness = np.zeros(n, np.int32)
    if trainer_version is not None:
        stale = trainer_version - np.concatenate([s.model_version for s in samples]).astype(np.int64)
        if stale.min() < 0:
            first = int(np.flatnonzero(stale < 0)[0])  # the first sample holding a token from the future
            b = int(np.searchsorted(np.cumsum([len(s.response_ids) for s in samples]), first, side="right"))
            raise ValueError(f"sample {b} has tokens of weight version {int(samples[b].model_version.max())}, "
                             f"newer than the trainer's {trainer_version}")
        staleness[at] = stale
    mixed = None
    if any(s.mixed_versions is not None for s in samples):
        flags = np.concatenate([s.mixed_versions if s.mixed_versions is not None
                                else np.zeros(len(s.response_ids), bool) for s in samples])
        mixed = placed(flags & (response_mask != 0), bool)
        loss_mask[mixed] = 0.0
    extra = None
    if with_advantages and any(s.token_advantages is not None for s in samples):
        extra = placed(np.concatenate([s.token_advantages if s.token_advantages is not None
                                       else np.zeros(len(s.response_ids), np.float32) for s in samples]), np.float32)
    logprobs = placed(np.concatenate([s.rollout_logprobs for s in samples]), np.float32)
    fields = {"loss_mask": loss_mask, "rollout_logprobs": logprobs, "staleness": staleness, "mixed_versions": mixed,
              "token_advantages": extra}
    return {name: None if value is None else torch.from_numpy(value) for name, value in fields.items()}


def _routing(samples: Sequence[RolloutSample], lengths: np.ndarray) -> Optional[torch.Tensor]:
    """The samples' routed experts back to back, [N, L, k] (sample b: ``lengths[b]`` rows), uint8 when every
    sample's are (the engine's compact ids), else int16; None unless every sample has them."""
    if any(s.routed_experts is None for s in samples):
        return None
    shape = samples[0].routed_experts.shape[1:]
    for b, (sample, t) in enumerate(zip(samples, lengths)):
        if sample.routed_experts.shape != (t, *shape):
            raise ValueError(f"sample {b}: routed_experts {tuple(sample.routed_experts.shape)} must be "
                             f"[T-1={t}, {shape[0]}, {shape[1]}]")
    dtype = np.uint8 if all(s.routed_experts.dtype == np.uint8 for s in samples) else np.int16
    return torch.from_numpy(np.concatenate([s.routed_experts for s in samples]).astype(dtype, copy=False))


def _sampling_mask(samples: Sequence[RolloutSample], at: np.ndarray, n: int) -> Optional[CsrMask]:
    """The samples' sampling masks as one CSR over the ``n`` positions (rows of the prompt positions and of
    samples without a mask empty), with the engine's log-probs of the kept ids when every mask has them;
    None when no sample has one."""
    masks = [s.sampling_mask for s in samples]
    if all(m is None for m in masks):
        return None
    counts = np.zeros(n, np.int64)
    counts[at] = np.concatenate([np.diff(m.offsets) if m is not None else np.zeros(len(s.response_ids), np.int64)
                                 for s, m in zip(samples, masks)])
    offsets = torch.zeros(n + 1, dtype=torch.long)
    torch.cumsum(torch.from_numpy(counts), 0, out=offsets[1:])
    present = [m for m in masks if m is not None]
    ids = np.concatenate([m.ids for m in present])
    logprobs = None
    if all(m.logprobs is not None for m in present):
        logprobs = torch.from_numpy(np.concatenate([m.logprobs for m in present]))
    return CsrMask(torch.from_numpy(ids), offsets, logprobs)


def check_routing(routed: torch.Tensor, num_layers: int, num_experts: int) -> None:
    """Raise ValueError unless ``routed`` [N, L, k] has one row per model layer and valid,
    distinct expert ids per token."""
    if routed.shape[1] != num_layers:
        raise ValueError(f"routed_experts has {routed.shape[1]} layers, the model has {num_layers}")
    low, high = int(routed.min()), int(routed.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"routed_experts holds expert id {low if low < 0 else high}, outside 0..{num_experts - 1}")
    ordered = routed.sort(dim=-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("routed_experts repeats an expert within one token's top-k")
