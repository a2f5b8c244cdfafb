"""Score centering (arXiv 2609.20807; SkyRL PR #2244, miles PR #3317, both open) against direct computations.

For softmax logits z and a token a sampled from the engine's q, the centred score's gradient is
``d/dz [log pi(a) - E_q log pi] = (e_a - pi) - (q - pi) = e_a - q``; a token whose loss has score coefficient
g (``-d loss / d log pi(a)``) and aggregation weight c therefore gets ``c g (q - e_a)`` where the plain policy
gradient gives ``c g (pi - e_a)``. The references below write that down from the full-vocabulary softmax
(``torch.softmax`` over the token's kept ids), with g from PPO's formula in floats, and compare with the
gradient of megarl's loss, whose centering runs through the trainer's support log-probs
(:func:`megarl.trainer.logprobs.vocab_parallel_logprobs`) and :func:`megarl.algos.score_centering.centering`.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.score_centering import Centering, centering, head
from megarl.algos.settings import AlgorithmConfig
from megarl.engines.client import generate_payload, sampling_mask_of
from megarl.engines.types import EngineError, SamplingParams
from megarl.rollout.splice import splice_continuation
from megarl.sample import FinishReason, RolloutSample, SamplingMask
from megarl.trainer.logprobs import CsrMask, csr_entries, vocab_parallel_logprobs
from megarl.trainer.rl_batch import build_rl_batch

pytestmark = pytest.mark.unit

f64 = torch.float64
V = 11


def batch(seed: int, support: int | None, rows: int = 4, width: int = 6):
    """A ragged batch of ``rows`` x ``width`` positions (trained prefixes of random lengths): logits [n, V] of the
    trained tokens, their targets, the engine's q over each token's support (``support`` ids drawn at random, the
    target among them, or the whole vocabulary for None), old and rollout log-probs, advantages, mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(f64)
    n = int(mask.sum())
    logits = torch.randn(n, V, generator=gen, dtype=f64) * 1.5
    targets = torch.randint(0, V, (n,), generator=gen)
    ids = []
    for i in range(n):
        others = torch.randperm(V, generator=gen).tolist()
        rest = [v for v in others if v != int(targets[i])][:(support or 1) - 1]
        ids.append(list(range(V)) if support is None else sorted([int(targets[i]), *rest]))
    q = [torch.softmax(torch.randn(len(r), generator=gen, dtype=f64) * 2, 0) for r in ids]
    adv = torch.randn(rows, generator=gen, dtype=f64)
    rollout = torch.stack([qq[r.index(int(a))].log() for qq, r, a in zip(q, ids, targets)])
    return logits, targets, ids, q, adv, mask, rollout


def csr(ids: list[list[int]], q: list[torch.Tensor] | None = None) -> CsrMask:
    offsets = torch.tensor([0] + [len(r) for r in ids]).cumsum(0)
    return CsrMask(torch.tensor([v for r in ids for v in r]), offsets,
                   None if q is None else torch.cat([x.log() for x in q]))


def grid(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat values of the trained tokens -> [B, T] (0 elsewhere), differentiable."""
    return torch.zeros(mask.shape, dtype=flat.dtype).index_put(tuple(mask.nonzero().T), flat)


def megarl_loss(logits, targets, ids, q, adv, mask, rollout, cfg: AlgorithmConfig, size: int | None = None):
    """megarl's loss of the batch and the gradient on the logits. The old policy is the trainer's own (one update,
    so the ratio is 1); the engine's log-probs are the rollout's (TIS / IcePop weights)."""
    z = logits.clone().requires_grad_()
    kept = csr(ids, q)
    out = vocab_parallel_logprobs(z, 0, targets, kept, None,
                                  support=csr_entries(kept, head(kept.offsets, kept.logprobs, size)))
    logp = grid(out.logprobs, mask)
    terms = None
    if cfg.score_centering != "none":
        chosen = head(kept.offsets, kept.logprobs, size)
        sub = csr_entries(kept, chosen)
        rows = torch.repeat_interleave(torch.arange(len(ids)), sub.offsets[1:] - sub.offsets[:-1])
        found = centering(out.support_logprobs, sub.logprobs, rows, len(ids), cfg.score_centering)
        terms = Centering(grid(found.term, mask), grid(found.support_tv, mask), grid(found.head_mass, mask))
    loss = rl_loss(LossInputs(logp, logp.detach(), adv, mask, rollout_logprobs=grid(rollout, mask),
                              centering=terms), cfg)
    (loss.loss_sum / loss.denominator_share).backward()
    return loss, z.grad


def reference_grad(logits, targets, ids, q_model, adv, mask, rollout, weight, kept=None) -> torch.Tensor:
    """``c g (q - e_a)`` per token, from the softmax over its kept ids: c = 1 / ``kept`` (token mean over the tokens
    not rejected; default all); g = w A r with r = 1 (PPO inside its clip) and w = ``weight(log-ratio to the
    engine)``; ``q_model`` [n, V]."""
    grad = torch.zeros_like(logits)
    cells = mask.nonzero().tolist()
    kept = len(cells) if kept is None else kept
    for k, (b, _) in enumerate(cells):
        masked = torch.full((V,), -math.inf, dtype=f64)
        masked[ids[k]] = logits[k, ids[k]]
        log_pi = torch.log_softmax(masked, 0)
        w = weight(float(log_pi[targets[k]] - rollout[k]))
        onehot = torch.zeros(V, dtype=f64)
        onehot[targets[k]] = 1.0
        grad[k] = w * float(adv[b]) * (q_model[k] - onehot) / kept
    return grad


def dense(ids, q) -> torch.Tensor:
    out = torch.zeros(len(ids), V, dtype=f64)
    for k, (r, qq) in enumerate(zip(ids, q)):
        out[k, r] = qq
    return out


@pytest.mark.parametrize("seed, support", [(0, None), (1, None), (2, 5), (3, 3)])
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_exact_centering_is_the_direct_computation(seed, support, correction):
    """The whole vocabulary as the support (None) or a recorded top-k support: megarl's gradient is ``c g (q -
    e_a)`` per token, with the TIS weight (clamped to 2) or IcePop's band [0.5, 2] (outside it: no gradient)."""
    data = batch(seed, support)
    logits, targets, ids, q, adv, mask, rollout = data
    cfg = AlgorithmConfig(score_centering="exact", off_policy_correction=correction, is_threshold=2.0)
    _, grad = megarl_loss(*data, cfg)
    weight = {"none": lambda lr: 1.0, "tis": lambda lr: min(math.exp(lr), 2.0),
              "mis": lambda lr: math.exp(lr) if 0.5 <= math.exp(lr) <= 2.0 else 0.0}[correction]
    log_ratios = [float(torch.log_softmax(logits[k, ids[k]], 0)[ids[k].index(int(targets[k]))] - rollout[k])
                  for k in range(len(ids))]
    kept = sum(weight(lr) > 0 for lr in log_ratios)
    assert correction != "mis" or 0 < kept < len(ids)  # IcePop rejects some tokens of these batches
    expected = reference_grad(logits, targets, ids, dense(ids, q), adv, mask, rollout, weight, kept)
    assert (grad - expected).abs().max() < 1e-9
    _, plain = megarl_loss(*data, AlgorithmConfig(off_policy_correction=correction, is_threshold=2.0))
    assert (grad - plain).abs().max() > 1e-3  # the centering changes the gradient


def test_exact_centering_leaves_the_loss_value_and_vanishes_on_policy():
    """The centering adds no value to the loss; with the engine's q equal to the trainer's policy over the
    support, its gradient is 0 (the score's expectation under the policy itself)."""
    logits, targets, ids, _, adv, mask, _ = batch(4, 6)
    q = [torch.softmax(logits[k, r], 0) for k, r in enumerate(ids)]
    rollout = torch.stack([qq[r.index(int(a))].log() for qq, r, a in zip(q, ids, targets)])
    data = (logits, targets, ids, q, adv, mask, rollout)
    centred, grad = megarl_loss(*data, AlgorithmConfig(score_centering="exact"))
    plain, plain_grad = megarl_loss(*data, AlgorithmConfig())
    assert torch.isclose(centred.loss_sum, plain.loss_sum, atol=1e-12)
    assert (grad - plain_grad).abs().max() < 1e-9 and plain_grad.abs().max() > 1e-3
    assert centred.sums["score_centering/support_tv"].item() < 1e-9


@pytest.mark.parametrize("seed, size", [(5, 2), (6, 4), (7, 1)])
def test_tail_centering_is_the_proportional_tail_model(seed, size):
    """The ``size`` most probable ids under q (head H) and the rest of q's mass spread over the other kept ids in
    proportion to the trainer's policy: ``q_model(b) = q(b)`` on H, ``(1 - Q_H) pi(b) / (1 - Pi_H)`` elsewhere; the
    gradient is ``c g (q_model - e_a)`` over the full vocabulary."""
    data = batch(seed, None)
    logits, targets, ids, q, adv, mask, rollout = data
    _, grad = megarl_loss(*data, AlgorithmConfig(score_centering="tail", score_centering_head=size), size)
    model = torch.zeros(len(ids), V, dtype=f64)
    for k in range(len(ids)):
        pi = torch.softmax(logits[k], 0)
        top = torch.topk(q[k], size).indices
        in_head = torch.zeros(V, dtype=torch.bool)
        in_head[top] = True
        q_head, pi_head = q[k][in_head].sum(), pi[in_head].sum()
        model[k] = torch.where(in_head, q[k], (1 - q_head) * pi / (1 - pi_head))
    expected = reference_grad(logits, targets, ids, model, adv, mask, rollout, lambda lr: 1.0)
    assert (grad - expected).abs().max() < 1e-9


def test_tail_over_the_whole_support_is_exact():
    data = batch(8, 4)
    _, tail = megarl_loss(*data, AlgorithmConfig(score_centering="tail", score_centering_head=4), 4)
    _, exact = megarl_loss(*data, AlgorithmConfig(score_centering="exact"))
    assert (tail - exact).abs().max() < 1e-9


def test_centering_metrics():
    """``support_tv`` = 1/2 sum |q - pi| over the support; ``head_mass`` = Q_H for the tail form, 1 exact."""
    policy = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.6, 0.4], dtype=f64))
    behaviour = torch.log(torch.tensor([0.4, 0.4, 0.2, 0.7, 0.3], dtype=f64))
    rows = torch.tensor([0, 0, 0, 1, 1])
    exact = centering(policy, behaviour, rows, 2, "exact")
    assert torch.allclose(exact.support_tv, torch.tensor([0.1, 0.1], dtype=f64)) and exact.head_mass.tolist() == [1, 1]
    head_only = centering(policy[[0, 3]], behaviour[[0, 3]], torch.tensor([0, 1]), 2, "tail")
    assert torch.allclose(head_only.head_mass, torch.tensor([0.4, 0.7], dtype=f64))
    assert torch.allclose(head_only.support_tv, torch.tensor([0.1, 0.1], dtype=f64))


def test_head_keeps_each_rows_most_probable_ids_in_order():
    offsets = torch.tensor([0, 3, 3, 7])
    logprobs = torch.log(torch.tensor([0.2, 0.5, 0.3, 0.1, 0.4, 0.25, 0.25]))
    assert head(offsets, logprobs, 2).tolist() == [1, 2, 4, 5]
    assert head(offsets, logprobs, None).tolist() == list(range(7))
    assert head(offsets, logprobs, 4).tolist() == list(range(7))


def test_the_loss_needs_the_centering_terms():
    logp, mask = torch.full((1, 2), -1.0, dtype=f64), torch.ones(1, 2, dtype=f64)
    with pytest.raises(ValueError, match="score_centering=exact needs the centering terms"):
        rl_loss(LossInputs(logp, logp, torch.ones(1, dtype=f64), mask), AlgorithmConfig(score_centering="exact"))


# --- the engine's support log-probs, through the sample and the batch ---------------------------------------

def test_the_engine_is_asked_for_the_supports_log_probs():
    params = SamplingParams(max_new_tokens=2, top_k=5)
    assert generate_payload([[1, 2]], params, True, True, support_logprobs=True)["sampling_logprobs_mode"] == "support"
    assert generate_payload([[1, 2]], params, True, True)["sampling_logprobs_mode"] == "selected"
    assert "sampling_logprobs_mode" not in generate_payload([[1, 2]], params, True, False, support_logprobs=True)


def test_support_log_probs_become_the_mask_and_the_sampled_tokens_log_probs():
    """SGLang's ``support`` mode answers one list of log-probs per token, aligned with its kept ids
    (``SamplingMaskChunk.to_lists``); the sampled token's is its rollout log-prob."""
    rows, values = [[4, 2, 9], [7]], [[-0.5, -1.2, -2.0], [0.0]]
    mask, selected = sampling_mask_of(rows, values, [2, 7], support=True)
    assert mask.ids.tolist() == [4, 2, 9, 7] and np.allclose(mask.logprobs, [-0.5, -1.2, -2.0, 0.0])
    assert np.allclose(selected, [-1.2, 0.0])
    with pytest.raises(EngineError, match="not in its recorded sampling support"):
        sampling_mask_of(rows, values, [3, 7], support=True)
    plain, logprobs = sampling_mask_of(rows, [-1.2, 0.0], [2, 7], support=False)
    assert plain.logprobs is None and logprobs == [-1.2, 0.0]


def sample(response: list[int], rows: list[list[int]], logprob_rows, group: str = "g") -> RolloutSample:
    r = len(response)
    return RolloutSample(prompt_ids=[1, 2], response_ids=response, loss_mask=np.ones(r, np.uint8),
                         rollout_logprobs=np.zeros(r, np.float32), model_version=np.zeros(r, np.int32),
                         routed_experts=None, sampling_mask=SamplingMask.from_rows(rows, logprob_rows),
                         finish_reason=FinishReason.STOP, advantage=1.0, group_id=group)


def test_support_log_probs_survive_splicing_and_batching():
    prefix = sample([3], [[3, 4]], [[-0.1, -2.3]])
    rest = RolloutSample(prompt_ids=[1, 2, 3], response_ids=[5, 6], loss_mask=np.ones(2, np.uint8),
                         rollout_logprobs=np.zeros(2, np.float32), model_version=np.zeros(2, np.int32),
                         routed_experts=None, finish_reason=FinishReason.STOP,
                         sampling_mask=SamplingMask.from_rows([[5], [6, 1]], [[0.0], [-0.7, -0.7]]))
    joined = splice_continuation(prefix, rest)
    joined.advantage = 1.0
    assert np.allclose(joined.sampling_mask.logprobs, [-0.1, -2.3, 0.0, -0.7, -0.7])
    other = sample([8, 9], [[8], [9, 2, 3]], [[0.0], [-0.2, -2.0, -3.0]], group="h")
    built = build_rl_batch([joined, other], with_routing=False)
    assert torch.allclose(built.sampling_mask.logprobs, torch.tensor([-0.1, -2.3, 0.0, -0.7, -0.7, 0.0, -0.2, -2.0,
                                                                       -3.0]))
    assert built.group_ids.tolist() == [0, 1]
    picked = built.select([1])
    assert torch.allclose(picked.sampling_mask.logprobs, torch.tensor([0.0, -0.2, -2.0, -3.0]))
    assert picked.group_ids.tolist() == [1]
    with pytest.raises(ValueError, match="one value per kept id"):
        SamplingMask.from_rows([[1, 2]], [[0.0]])
