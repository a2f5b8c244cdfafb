"""Supervised token batches: sequences held ragged, with the loss on a suffix of each."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megarl.trainer.device import to_device


@dataclass
class TokenBatch:
    """``B`` sequences, ``N`` input positions in all, back to back: ``tokens`` int64 [N] input ids,
    ``labels`` int64 [N] the next token at each position, ``loss_mask`` float32 [N] 1 where the
    prediction of ``labels`` counts, ``cu_seqlens`` int64 [B + 1] where each sequence starts."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor

    def __len__(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def to(self, device: torch.device) -> TokenBatch:
        """This batch with every tensor on ``device``."""
        return TokenBatch(*(to_device(t, device) for t in (self.tokens, self.labels, self.loss_mask, self.cu_seqlens)))

    def select(self, indices: Sequence[int]) -> TokenBatch:
        """The sequences ``indices``, in that order."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        lengths = self.lengths[idx]
        positions = torch.repeat_interleave(self.cu_seqlens[:-1][idx] - (torch.cumsum(lengths, 0) - lengths), lengths,
                                            output_size=int(lengths.sum())) + torch.arange(int(lengths.sum()))
        cu = torch.zeros(len(idx) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=cu[1:])
        return TokenBatch(self.tokens[positions], self.labels[positions], self.loss_mask[positions], cu)


def token_batch(sequences: list[list[int]], loss_starts: list[int]) -> TokenBatch:
    """The :class:`TokenBatch` of ``sequences``; the loss covers the predictions of
    ``seq[loss_starts[i]:]`` (e.g. the answer after a prompt)."""
    if len(sequences) != len(loss_starts):
        raise ValueError(f"{len(sequences)} sequences but {len(loss_starts)} loss starts")
    for row, (seq, start) in enumerate(zip(sequences, loss_starts)):
        if not 1 <= start < len(seq):
            raise ValueError(f"sequence {row}: loss start {start} outside 1..{len(seq) - 1}")
    return masked_token_batch(sequences, [[0] * start + [1] * (len(seq) - start)
                                          for seq, start in zip(sequences, loss_starts)])


def masked_token_batch(sequences: list[list[int]], trained: list[list[int]]) -> TokenBatch:
    """The :class:`TokenBatch` of ``sequences``; the loss covers the predictions of the tokens
    ``j >= 1`` with ``trained[i][j] == 1`` (e.g. an episode's policy turns, not the tool's answers)."""
    tokens, labels, masks = [], [], []
    for row, (seq, mask) in enumerate(zip(sequences, trained, strict=True)):
        if len(mask) != len(seq) or not any(mask[1:]):
            raise ValueError(f"sequence {row}: the mask must have one entry per token and train one of 1..")
        tokens.append(torch.tensor(seq[:-1], dtype=torch.long))
        labels.append(torch.tensor(seq[1:], dtype=torch.long))
        masks.append(torch.tensor(mask[1:], dtype=torch.float32))
    lengths = torch.tensor([len(t) for t in tokens])
    cu = torch.zeros(len(sequences) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=cu[1:])
    return TokenBatch(torch.cat(tokens), torch.cat(labels), torch.cat(masks), cu)
