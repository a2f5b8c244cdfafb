"""Padded token batches and their split into data-parallel slices and token-budget micro-batches."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    """``B`` right-padded sequences of length ``S``.

    tokens: int64 [B, S] input ids; labels: int64 [B, S], the next token at each position;
    loss_mask: float32 [B, S], 1 where the prediction of ``labels`` counts.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, rows) -> "TokenBatch":
        return TokenBatch(self.tokens[rows], self.labels[rows], self.loss_mask[rows])

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1]).expand_as(self.tokens)


def pack_sequences(sequences: list[list[int]], loss_starts: list[int], pad_id: int,
                   length_multiple: int = 1) -> TokenBatch:
    """Right-pad ``sequences`` into a :class:`TokenBatch`.

    The loss covers the predictions of ``seq[loss_starts[i]:]`` (e.g. the answer after a prompt).
    ``S`` is rounded up to ``length_multiple`` (sequence parallel needs S divisible by TP).
    """
    if len(sequences) != len(loss_starts):
        raise ValueError(f"{len(sequences)} sequences but {len(loss_starts)} loss starts")
    longest = max(len(s) for s in sequences)
    S = -(-(longest - 1) // length_multiple) * length_multiple
    tokens = torch.full((len(sequences), S), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(sequences), S), dtype=torch.float32)
    for row, (seq, start) in enumerate(zip(sequences, loss_starts)):
        if not 1 <= start < len(seq):
            raise ValueError(f"sequence {row}: loss start {start} outside 1..{len(seq) - 1}")
        n = len(seq) - 1
        tokens[row, :n] = torch.tensor(seq[:-1])
        labels[row, :n] = torch.tensor(seq[1:])
        loss_mask[row, start - 1: n] = 1.0
    return TokenBatch(tokens, labels, loss_mask)


def data_parallel_slice(batch: TokenBatch, dp_rank: int, dp_size: int) -> TokenBatch:
    """This DP rank's contiguous share of the global batch (B must divide by ``dp_size``)."""
    if len(batch) % dp_size:
        raise ValueError(f"global batch of {len(batch)} sequences does not split over {dp_size} DP ranks")
    per_rank = len(batch) // dp_size
    return batch[slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)]


def micro_batches(batch: TokenBatch, max_tokens: int) -> list[TokenBatch]:
    """Split into equal micro-batches of at most ``max_tokens`` padded tokens each (at least one
    sequence each; equal sizes because pipeline stages exchange fixed-shape activations)."""
    rows = micro_batch_rows(len(batch), batch.tokens.shape[1], max_tokens)
    return [batch[slice(i, i + rows)] for i in range(0, len(batch), rows)]


def micro_batch_rows(num_rows: int, seq_length: int, max_tokens: int) -> int:
    """The largest divisor of ``num_rows`` whose ``rows * seq_length`` fits ``max_tokens`` (>= 1)."""
    budget = max(1, max_tokens // seq_length)
    count = -(-num_rows // budget)
    while num_rows % count:
        count += 1
    return num_rows // count
