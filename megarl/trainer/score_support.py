"""Score centering's inputs on a trainer rank: the recorded sampling support of a micro-batch's trained tokens
(the engine's ids and log-probs, :attr:`megarl.trainer.logprobs.CsrMask.logprobs`), the trainer's log-probs of
those ids (:func:`megarl.trainer.logprobs.vocab_parallel_logprobs` with ``support``), and the per-token terms
of :func:`megarl.algos.score_centering.centering` on the loss's [B, T] grid."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algos.score_centering import Centering, centering, head
from megarl.trainer.logprobs import CsrMask, csr_entries
from megarl.trainer.packing import to_grid


@dataclass
class SupportLogprobs:
    """The recorded ids of m trained tokens, flat [nnz]: ``policy`` the trainer's log-probs over each token's kept
    set (differentiable), ``behaviour`` the engine's, ``positions`` the ragged position of each id's token; and
    the tokens' ragged positions ``rows`` [m]."""

    policy: torch.Tensor
    behaviour: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of(cls, policy: torch.Tensor, support: CsrMask, rows: torch.Tensor) -> SupportLogprobs:
        """From the trainer's log-probs of ``support``'s ids (one row per token of ``rows``)."""
        counts = (support.offsets[1:] - support.offsets[:-1]).long()
        return cls(policy, support.logprobs, torch.repeat_interleave(rows, counts), rows)


def recorded_support(mask: CsrMask | None, size: int | None, context_parallel: bool) -> CsrMask:
    """The ids (with the engine's log-probs) of ``mask``'s rows that score centering takes: each row's ``size``
    most probable under the engine (None: all). ValueError without the engine's log-probs or under context
    parallelism (whose ranks hold parts of the rows)."""
    if mask is None or mask.logprobs is None:
        raise ValueError("score centering needs the engine's sampling masks with their log-probs "
                         "(rollout.keep_sampling_mask, and the policy's engines asked for the support's log-probs)")
    if context_parallel:
        raise ValueError("score centering does not run under context parallelism")
    return csr_entries(mask, head(mask.offsets, mask.logprobs, size))


def centering_grid(support: SupportLogprobs, form: str, n: int, cu_seqlens: torch.Tensor) -> Centering:
    """:func:`megarl.algos.score_centering.centering` of the supported tokens, each term on the [B, T] grid of
    the micro-batch's ``cu_seqlens`` (``n`` ragged positions; 0 off the supported tokens)."""
    local = torch.searchsorted(support.rows, support.positions)  # each id's token among the m rows
    found = centering(support.policy, support.behaviour, local, len(support.rows), form)

    def placed(values: torch.Tensor) -> torch.Tensor:
        return to_grid(values.new_zeros(n).index_put((support.rows,), values), cu_seqlens)

    return Centering(term=placed(found.term), support_tv=placed(found.support_tv),
                     head_mass=placed(found.head_mass))
