"""Score centering: the off-policy correction that centres each token's score over the sampling support.

Marek & Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning" (arXiv 2609.20807); no peer
has merged it (open: SkyRL PR #2244, miles PR #3317). The paper's text is not in the stored corpora; the
form here is derived from those PRs' descriptions. At a prefix where the engine sampled ``a ~ q`` and the
trainer's policy is ``pi``, the policy gradient's expectation is ``E_q[A] E_q[grad log pi] + Cov_q(A, grad log
pi)``. Under a train/inference mismatch ``E_q[grad log pi] != 0`` (it is 0 only for q = pi), so the first term
pulls the trainer towards the sampler, weighted by the expected advantage there, which group baselines do
not remove. Score centering subtracts it: each token's score ``grad log pi(a)`` becomes

    grad log pi(a) - sum_b c_b grad log pi(b)

with coefficients ``c`` over the recorded ids b of that position:

- ``exact``: the recorded support is the whole sampling support (megarl's Keep Sampling Mask: top-k / top-p
  ids at every token, with the engine's log-probs of each, renormalised over the support), ``c_b = q(b)``
  and ``pi`` is the trainer's policy over the same support (the masked softmax the loss already uses), so
  ``sum_b c_b grad log pi(b) = E_q[grad log pi]`` exactly.
- ``tail``: the recorded ids are a head H (the ``score_centering_head`` most probable ids under q) and the rest
  of q's mass ``1 - Q_H`` is modelled as proportional to pi beyond the head (miles' "proportional tail"):
  ``q(b) = (1 - Q_H) pi(b) / (1 - Pi_H)`` for b outside H. With ``sum_b pi(b) grad log pi(b) = 0`` over pi's
  whole support, ``E_q[grad log pi] = sum_{b in H} (q(b) - (1 - Q_H) / (1 - Pi_H) pi(b)) grad log pi(b)``, so
  ``c_b = q(b) - pi(b) (1 - Q_H) / (1 - Pi_H)`` (pi detached; 0 tail weight where ``1 - Pi_H`` < 1e-6). With
  H the whole support it is the exact form (``Q_H = 1``).

In the loss, a token whose policy loss has score coefficient ``g_t = -d(w_t L_t)/d log pi(a_t)`` (its
advantage times whatever the loss and the off-policy weight make of it: ``A r`` for PPO inside the clip,
0 outside, ``w A clip(r)`` for CISPO under TIS ``w``) gets ``g_t sum_b c_b log pi(b)`` added with the value
taken out (:func:`megarl.algos.objective.rl_loss`): the gradient is centred, the loss's value is not changed.
This is how SkyRL's PR composes it with its ``rollout_is`` loss ("subtracts the sampler-expected
(calibration-weighted) score") and miles' with TIS: the correction rides on the token's own weight, and a
token the weights reject (IcePop, ``off_policy_correction=mis``, the rejection criteria) is centred nowhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_CENTERING = ("none", "exact", "tail")
TAIL_FLOOR = 1e-6  # below this much of pi's mass beyond the head, the modelled tail takes no weight


@dataclass
class Centering:
    """Per token (ragged [n], one row each): ``term`` = ``sum_b c_b log pi(b)``, differentiable through the
    trainer's log-probs; ``support_tv`` = ``1/2 (sum_{b in H} |q(b) - pi(b)| + |Q_H - Pi_H|)``, the total
    variation between the engine's and the trainer's distributions over the recorded ids and the rest (exact:
    the support's TV), and ``head_mass`` = ``Q_H`` (1 for the exact form), both detached."""

    term: torch.Tensor
    support_tv: torch.Tensor
    head_mass: torch.Tensor


def _per_row(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, rows, values)


def centering(policy_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, rows: torch.Tensor, n: int,
              form: str) -> Centering:
    """The centering of ``n`` tokens (module docstring) from their recorded ids, flat over all tokens:
    ``policy_logprobs`` [nnz] the trainer's log pi(b) over its kept set (carries the gradient),
    ``behaviour_logprobs`` [nnz] the engine's log q(b), ``rows`` int64 [nnz] the token of each id."""
    if form not in SCORE_CENTERING or form == "none":
        raise ValueError(f"score centering form must be exact or tail, got {form!r}")
    if not policy_logprobs.shape == behaviour_logprobs.shape == rows.shape or policy_logprobs.dim() != 1:
        raise ValueError(f"policy_logprobs, behaviour_logprobs and rows must all be [nnz]; got "
                         f"{tuple(policy_logprobs.shape)}, {tuple(behaviour_logprobs.shape)}, {tuple(rows.shape)}")
    q = behaviour_logprobs.detach().to(policy_logprobs.dtype).exp()
    pi = policy_logprobs.detach().exp()
    head_q, head_pi = _per_row(q, rows, n), _per_row(pi, rows, n)
    coef = q
    if form == "tail":
        pi_tail = 1.0 - head_pi
        factor = torch.where(pi_tail > TAIL_FLOOR, (1.0 - head_q).clamp(min=0) / pi_tail.clamp(min=TAIL_FLOOR),
                             torch.zeros_like(pi_tail))
        coef = q - factor[rows] * pi
    tv = 0.5 * (_per_row((q - pi).abs(), rows, n) + (head_q - head_pi).abs())
    return Centering(term=_per_row(coef * policy_logprobs, rows, n), support_tv=tv,
                     head_mass=head_q if form == "tail" else torch.ones_like(head_q))


def head(offsets: torch.Tensor, behaviour_logprobs: torch.Tensor, size: int | None) -> torch.Tensor:
    """int64 [kept] positions (into a CSR's flat arrays with ``offsets`` [N + 1]) of each row's ``size`` largest
    ``behaviour_logprobs`` (the whole row where it has no more, or for ``size`` None), row after row, each
    row's in decreasing order of its log-probs there."""
    counts = (offsets[1:] - offsets[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    if size is None or not len(rows) or int(counts.max()) <= size:
        return torch.arange(len(rows), device=counts.device)
    by_value = torch.argsort(-behaviour_logprobs, stable=True)
    order = by_value[torch.argsort(rows[by_value], stable=True)]  # row after row, largest first
    rank = torch.arange(len(rows), device=counts.device) - torch.repeat_interleave(offsets[:-1].long(), counts)
    return order[rank < size]
