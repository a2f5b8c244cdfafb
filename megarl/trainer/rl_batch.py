"""Rollout samples -> the padded tensors one RL training step consumes.

A sample of T tokens (P prompt + R response) gives T-1 input positions; input position ``j``
predicts token ``j+1``, so response token ``r`` is predicted at position ``P-1+r``. Rows are
right-padded to S positions (a multiple of ``length_multiple``: sequence parallel needs S % TP == 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megarl.sample import RolloutSample
from megarl.trainer.logprobs import CsrMask


@dataclass
class RLBatch:
    """B samples as [B, S] tensors; ``routed_experts`` [B, S, L, k] int64 or None; the sampling
    mask as CSR over the B*S positions in row-major order (empty rows = full vocabulary)."""

    tokens: torch.Tensor  # int64 [B, S] inputs
    targets: torch.Tensor  # int64 [B, S] the next token at each position
    loss_mask: torch.Tensor  # float32 [B, S] 1 where the policy generated the target (sample.loss_mask)
    advantages: torch.Tensor  # float32 [B]
    num_positions: torch.Tensor  # int64 [B], T-1 of each sample (the rest of the row is padding)
    rollout_logprobs: torch.Tensor  # float32 [B, S], 0 outside the response
    routed_experts: Optional[torch.Tensor]
    sampling_mask: Optional[CsrMask]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1]).expand_as(self.tokens)

    def rows(self, start: int, stop: int) -> "RLBatch":
        """Samples ``start:stop`` (the CSR mask re-based to the slice's positions)."""
        S = self.tokens.shape[1]
        mask = None
        if self.sampling_mask is not None:
            offsets = self.sampling_mask.offsets[start * S: stop * S + 1]
            mask = CsrMask(self.sampling_mask.ids[int(offsets[0]): int(offsets[-1])], offsets - offsets[0])
        return RLBatch(
            self.tokens[start:stop], self.targets[start:stop], self.loss_mask[start:stop], self.advantages[start:stop],
            self.num_positions[start:stop], self.rollout_logprobs[start:stop],
            None if self.routed_experts is None else self.routed_experts[start:stop], mask,
        )


def build_rl_batch(samples: Sequence[RolloutSample], pad_id: int, length_multiple: int = 1,
                   with_routing: bool = True, with_sampling_mask: bool = True) -> RLBatch:
    """Pad ``samples`` (advantages filled) into an :class:`RLBatch`.

    Padding positions replay experts ``0..k-1`` (valid and distinct, as megatron's dispatchers need).
    Raises ValueError for a sample without advantage or with inconsistent per-token fields.
    """
    if not samples:
        raise ValueError("an RL batch needs at least one sample")
    longest = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    S = -(-longest // length_multiple) * length_multiple
    B = len(samples)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    targets = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    rollout_logprobs = torch.zeros(B, S)
    advantages = torch.zeros(B)
    num_positions = torch.tensor([len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples])
    routing = [s.routed_experts for s in samples] if with_routing else [None]
    routed = None
    if with_routing and all(r is not None for r in routing):
        _, L, k = routing[0].shape
        routed = torch.arange(k, dtype=torch.long).expand(B, S, L, k).clone()
    mask_rows: list[list[int]] = [[] for _ in range(B * S)]
    use_mask = with_sampling_mask and any(s.sampling_mask is not None for s in samples)
    for b, sample in enumerate(samples):
        P, R = len(sample.prompt_ids), len(sample.response_ids)
        if sample.advantage is None:
            raise ValueError(f"sample {b} ({sample.group_id}) has no advantage")
        if len(sample.loss_mask) != R or len(sample.rollout_logprobs) != R:
            raise ValueError(f"sample {b}: loss_mask/rollout_logprobs must have one entry per response token ({R})")
        if P < 1 or R < 1:
            raise ValueError(f"sample {b}: needs at least one prompt and one response token (got {P}, {R})")
        seq = torch.tensor(list(sample.prompt_ids) + list(sample.response_ids), dtype=torch.long)
        tokens[b, : P + R - 1] = seq[:-1]
        targets[b, : P + R - 1] = seq[1:]
        response = slice(P - 1, P - 1 + R)
        loss_mask[b, response] = torch.as_tensor(sample.loss_mask, dtype=torch.float32)
        rollout_logprobs[b, response] = torch.as_tensor(sample.rollout_logprobs, dtype=torch.float32)
        advantages[b] = float(sample.advantage)
        if routed is not None:
            r = torch.as_tensor(sample.routed_experts, dtype=torch.long)
            if r.shape[0] != P + R - 1 or r.shape[1:] != routed.shape[2:]:
                raise ValueError(f"sample {b}: routed_experts {tuple(r.shape)} must be [T-1={P + R - 1}, {routed.shape[2]}, {routed.shape[3]}]")
            routed[b, : P + R - 1] = r
        if use_mask and sample.sampling_mask is not None:
            ids, offsets = sample.sampling_mask.ids, sample.sampling_mask.offsets
            for i in range(R):
                mask_rows[b * S + P - 1 + i] = ids[offsets[i]: offsets[i + 1]].tolist()
    mask = None
    if use_mask:
        counts = torch.tensor([len(r) for r in mask_rows])
        offsets = torch.zeros(B * S + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=offsets[1:])
        mask = CsrMask(torch.tensor([i for r in mask_rows for i in r], dtype=torch.long), offsets)
    return RLBatch(tokens, targets, loss_mask, advantages, num_positions, rollout_logprobs, routed, mask)


def check_routing(routed: torch.Tensor, num_layers: int, num_experts: int) -> None:
    """Raise ValueError unless ``routed`` [B, S, L, k] has one row per model layer and valid,
    distinct expert ids per token."""
    if routed.shape[2] != num_layers:
        raise ValueError(f"routed_experts has {routed.shape[2]} layers, the model has {num_layers}")
    low, high = int(routed.min()), int(routed.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"routed_experts holds expert id {low if low < 0 else high}, outside 0..{num_experts - 1}")
    ordered = routed.sort(dim=-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("routed_experts repeats an expert within one token's top-k")
