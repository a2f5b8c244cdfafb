"""The losses, estimators, controller and aggregation the peers test, against the peers' own test vectors and
their published formulas.

Test vectors are the peers' as they publish them (inputs and expected values): SkyRL
``tests/train/algorithms/test_losses.py`` and ``tests/backends/skyrl_train/utils/test_ppo_utils.py``
(github.com/NovaSky-AI/SkyRL). Elsewhere the reference is a transcription of the peer's formula in plain
Python over floats, never megarl's code: verl ``verl/trainer/ppo/core_algos.py`` (github.com/volcengine/verl),
SkyRL ``skyrl/backends/skyrl_train/utils/ppo_utils.py``, prime-rl ``src/prime_rl/trainer/rl/loss.py``
(github.com/PrimeIntellect-ai/prime-rl), on random ragged batches (rows of different trained lengths).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.algos.advantages import discounted_returns, fill_advantages, masked_whiten, maxrl, reinforce_plus_plus
from megarl.algos.aggregation import AGGREGATIONS, FIXED_DENOMINATORS, aggregation_fn, prompt_mean_weights
from megarl.algos.kl import kl_penalty
from megarl.algos.kl_control import KLController
from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.policy_loss import CovBand, clip_cov, dppo, kl_cov, ppo
from megarl.algos.settings import AlgorithmConfig
from megarl.sample import FinishReason, RolloutSample

pytestmark = pytest.mark.unit

f64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=f64)


def ragged(seed: int, rows: int = 5, width: int = 8):
    """(logp, old, advantages [B, T], mask [B, T]) with each row's trained prefix of a random length >= 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(f64)
    old = -torch.rand(rows, width, generator=gen, dtype=f64) * 3 - 0.05
    logp = (old + torch.randn(rows, width, generator=gen, dtype=f64) * 0.5).clamp(max=-1e-3)
    adv = torch.randn(rows, width, generator=gen, dtype=f64)
    return logp, old, adv, mask


def cells(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(b, i) for b in range(mask.shape[0]) for i in range(mask.shape[1]) if mask[b, i] > 0]


# --- DPPO -------------------------------------------------------------------------------------------------

# SkyRL test_dppo_policy_loss: (type, delta_low, delta_high, old, new, advantages, expected mask)
SKYRL_DPPO = {
    "tv_pos_adv_masked": ("binary_tv", 0.2, 0.2, [[-1.0, -1.0, -1.0]], [[-0.3, -2.0, -0.9]], [[1.0, -1.0, 1.0]],
                          [[0.0, 0.0, 1.0]]),
    "tv_wrong_direction_not_masked": ("binary_tv", 0.2, 0.2, [[-1.0, -1.0]], [[-2.0, -0.3]], [[1.0, -1.0]],
                                      [[1.0, 1.0]]),
    "kl_no_masking_within_delta": ("binary_kl", 0.5, 0.5, [[-1.0, -1.0]], [[-1.01, -0.99]], [[1.0, -1.0]],
                                   [[1.0, 1.0]]),
}


@pytest.mark.parametrize("name", list(SKYRL_DPPO))
def test_dppo_is_skyrls_on_its_test_vectors(name):
    """SkyRL's expected loss: ``-(ratio * A * expected_mask).sum()``, ratio = exp(new - old)."""
    kind, low, high, old, new, adv, expected_mask = SKYRL_DPPO[name]
    logp = t(new).requires_grad_()
    out = dppo(logp, t(old), t(adv), torch.ones_like(t(old)), kind, low, high)
    expected = -(torch.exp(t(new) - t(old)) * t(adv) * t(expected_mask)).sum()
    assert torch.allclose(out.per_token.sum(), expected, atol=1e-6)
    assert bool(out.clipped.any()) == (min(min(expected_mask)) == 0.0)


def test_dppo_kl_masks_and_rollout_logprobs_change_the_loss():
    """SkyRL's ``kl_masked`` (some masking at delta 0.05) and ``tv_uses_rollout_logprobs`` (the behaviour log-probs
    the mask is taken against change the loss): in megarl the behaviour policy is the old one."""
    out = dppo(t([[-0.1, -0.95]]), t([[-1.0, -1.0]]), t([[1.0, 1.0]]), torch.ones(1, 2, dtype=f64), "binary_kl",
               0.05, 0.05)
    assert out.clipped.any()
    logp, adv, mask = t([[-0.3, -0.95]]), t([[1.0, 1.0]]), torch.ones(1, 2, dtype=f64)
    against_old = dppo(logp, t([[-1.0, -1.0]]), adv, mask).per_token.sum()
    against_rollout = dppo(logp, t([[-0.35, -1.0]]), adv, mask).per_token.sum()
    assert not torch.allclose(against_old, against_rollout)


def ref_dppo(logp, old, adv, mask, kind, low, high) -> tuple[float, list[list[float]]]:
    """SkyRL's ``dppo_policy_loss`` in floats: the summed loss over the mask and d loss / d logp."""
    total, grad = 0.0, [[0.0] * len(logp[0]) for _ in logp]
    for b, i in cells(t(mask)):
        p, mu, a = math.exp(logp[b][i]), math.exp(old[b][i]), adv[b][i]
        d = p - mu
        if kind == "binary_tv":
            drop = (a > 0 and d > high) or (a < 0 and -d > low)
        else:
            kl = mu * (old[b][i] - logp[b][i]) + (1 - mu) * math.log((1 - mu + 1e-8) / (1 - p + 1e-8))
            drop = (a > 0 and d > 0 and kl > high) or (a < 0 and d < 0 and kl > low)
        if not drop:
            ratio = math.exp(min(max(logp[b][i] - old[b][i], -20.0), 20.0))
            total += -ratio * a
            grad[b][i] = -ratio * a
    return total, grad


def ref_prime_rl_masked(logp, old, adv, mask, low, high) -> list[tuple[int, int]]:
    """prime-rl's ``default_loss_fn`` trust region: ``torch.where(A > 0, d > dppo_mask_high, d < -dppo_mask_low)``."""
    out = []
    for b, i in cells(t(mask)):
        d = math.exp(logp[b][i]) - math.exp(old[b][i])
        if (d > high) if adv[b][i] > 0 else (d < -low):
            out.append((b, i))
    return out


@pytest.mark.parametrize("seed, kind, low, high", [(0, "binary_tv", 0.2, 0.2), (1, "binary_tv", 0.05, 0.1),
                                                   (2, "binary_kl", 0.05, 0.05), (3, "binary_kl", 0.01, 0.2)])
def test_dppo_on_ragged_batches_is_skyrls_and_prime_rls_mask(seed, kind, low, high):
    logp, old, adv, mask = ragged(seed)
    logp = logp.requires_grad_()
    out = dppo(logp, old, adv, mask, kind, low, high)
    total, grad = ref_dppo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), kind, low, high)
    out.per_token.sum().backward()
    assert out.per_token.sum().item() == pytest.approx(total, abs=1e-6)
    assert torch.allclose(logp.grad, t(grad), atol=1e-6)
    dropped = set(map(tuple, out.clipped.nonzero().tolist()))
    assert dropped, "the batch should drop some tokens"
    if kind == "binary_tv":  # prime-rl's default masking, on the tokens with an advantage of either sign
        assert dropped == set(ref_prime_rl_masked(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), low,
                                                  high))


# --- Clip-Cov and KL-Cov ----------------------------------------------------------------------------------

def _masked_mean(values, mask):
    kept = [values[b][i] for b, i in cells(t(mask))]
    return sum(kept) / len(kept)


def ref_clip_cov(logp, old, adv, mask, lo, hi, ratio, lb, ub, seed) -> tuple[float, set]:
    """verl's ``compute_policy_loss_clip_cov`` in floats: the summed loss over the mask and the detached tokens;
    its ``torch.randperm`` draw on the generator seeded ``seed``."""
    mean_a, mean_lp = _masked_mean(adv, mask), _masked_mean(logp, mask)
    candidates, losses = [], {}
    for b, i in cells(t(mask)):
        r = math.exp(logp[b][i] - old[b][i])
        l1, l2 = -adv[b][i] * r, -adv[b][i] * min(max(r, 1 - lo), 1 + hi)
        losses[b, i] = max(l1, l2)
        cov = (adv[b][i] - mean_a) * (logp[b][i] - mean_lp)
        if not l2 > l1 and lb < cov < ub:
            candidates.append((b, i))  # torch.nonzero's row-major order
    count = max(int(ratio * len(losses)), 1)
    if len(candidates) > count:
        perm = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed)).tolist()
        candidates = [candidates[k] for k in perm[:count]]
    return sum(v for k, v in losses.items() if k not in set(candidates)), set(candidates)


@pytest.mark.parametrize("seed, ratio, lb, ub", [(0, 0.25, -5.0, 5.0), (1, 0.1, -0.5, 0.5), (2, 1.0, 0.0, 5.0),
                                                 (3, 2e-4, -5.0, 5.0)])
def test_clip_cov_is_verls_on_ragged_batches(seed, ratio, lb, ub):
    logp, old, adv, mask = ragged(seed)
    out = clip_cov(logp, old, adv, mask, 0.2, 0.2, CovBand(ratio, lb, ub), torch.Generator().manual_seed(seed))
    total, detached = ref_clip_cov(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, ratio, lb, ub,
                                   seed)
    assert out.per_token.sum().item() == pytest.approx(total, abs=1e-6)
    assert set(map(tuple, out.cov_selected.nonzero().tolist())) == detached and detached


def test_clip_cov_on_skyrls_test_vector():
    """SkyRL ``test_clip_cov_policy_loss``'s inputs (clip_ratio 0.5, bounds -5 and 5; its global seed 42): verl's
    formula's loss, and not PPO's."""
    adv = t([[2.0, -1.0, 1.5, 0.8], [1.0, 0.5, -2.0, 1.2]])
    old = torch.full((2, 4), -1.0, dtype=f64)
    logp = t([[-0.5, -1.5, -0.8, -1.2], [-1.3, -0.7, -1.8, -0.9]])
    mask = t([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    out = clip_cov(logp, old, adv, mask, 0.2, 0.2, CovBand(0.5, -5.0, 5.0), torch.Generator().manual_seed(42))
    total, detached = ref_clip_cov(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 0.5, -5.0,
                                   5.0, 42)
    assert out.per_token.sum().item() == pytest.approx(total, abs=1e-6)
    assert detached and 0 < out.cov_selected.sum() / mask.sum() <= 1
    assert not torch.isclose(out.per_token.sum(), ppo(logp, old, adv, mask).per_token.sum())


def ref_kl_cov(logp, old, adv, mask, ratio, coef) -> tuple[float, set, list[list[float]]]:
    """verl's ``compute_policy_loss_kl_cov`` in floats: summed loss, penalised tokens, d loss / d logp."""
    trained = cells(t(mask))
    mean_a = sum(adv[b][i] for b, i in trained) / len(trained)
    mean_lp = sum(logp[b][i] for b, i in trained) / len(trained)
    cov = {k: (adv[k[0]][k[1]] - mean_a) * (logp[k[0]][k[1]] - mean_lp) for k in trained}
    top = set(sorted(trained, key=lambda k: -cov[k])[:max(int(len(trained) * ratio), 1)])
    total, grad = 0.0, [[0.0] * len(logp[0]) for _ in logp]
    for b, i in trained:
        x = logp[b][i] - old[b][i]
        total += -adv[b][i] * math.exp(x) + (coef * abs(x) if (b, i) in top else 0.0)
        grad[b][i] = -adv[b][i] * math.exp(x) + (coef * math.copysign(1.0, x) if (b, i) in top else 0.0)
    return total, top, grad


@pytest.mark.parametrize("seed, ratio, coef", [(0, 0.2, 1.0), (1, 0.5, 0.3), (2, 2e-4, 1.0)])
def test_kl_cov_is_verls_on_ragged_batches(seed, ratio, coef):
    logp, old, adv, mask = ragged(seed)
    logp = logp.requires_grad_()
    out = kl_cov(logp, old, adv, mask, ratio, coef)
    total, top, grad = ref_kl_cov(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ratio, coef)
    out.per_token.sum().backward()
    assert out.per_token.sum().item() == pytest.approx(total, abs=1e-6)
    assert set(map(tuple, out.cov_selected.nonzero().tolist())) == top
    assert torch.allclose(logp.grad, t(grad), atol=1e-6)


def test_clip_cov_through_the_loss_draws_the_same_tokens_for_the_same_batch():
    """The loss seeds Clip-Cov's draw from the batch (every TP rank computes the same loss): two calls agree, and
    the detached share is the configured one."""
    logp, old, adv, mask = ragged(6, rows=8, width=16)
    cfg = AlgorithmConfig(policy_loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    first, second = (rl_loss(LossInputs(logp, old, adv, mask), cfg) for _ in range(2))
    assert torch.equal(first.loss_sum, second.loss_sum)
    assert first.sums["cov_fraction"].item() == max(int(0.05 * mask.sum()), 1)


def test_kl_cov_on_skyrls_test_vector():
    """SkyRL ``test_kl_cov_policy_loss``'s inputs (kl_cov_frac 0.5, ppo_kl_coef 1): verl's formula, not PPO's."""
    adv = t([[1.5, -0.5, 2.0, 0.8], [0.5, 1.0, -1.5, 1.2]])
    old = torch.full((2, 4), -1.0, dtype=f64)
    logp = t([[-0.8, -1.2, -0.6, -1.1], [-1.1, -0.9, -1.4, -0.7]])
    mask = t([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    out = kl_cov(logp, old, adv, mask, 0.5, 1.0)
    total, top, _ = ref_kl_cov(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.5, 1.0)
    assert out.per_token.sum().item() == pytest.approx(total, abs=1e-6) and len(top) == 3
    assert not torch.isclose(out.per_token.sum(), ppo(logp, old, adv, mask).per_token.sum())


# --- the abs KL estimator ---------------------------------------------------------------------------------

def test_abs_kl_is_skyrls_and_verls():
    """SkyRL ``test_compute_approx_kl``: log_probs [0.2, 0.3, 0.5], base [0.1, 0.2, 0.4], mask [1, 1, 0] ->
    ``(log_probs - base).abs() * mask``; verl ``kl_penalty_forward`` ``abs``. Its gradient is sign(x)."""
    logp = t([[0.2, 0.3, 0.5]]).requires_grad_()
    value = kl_penalty("abs", logp, t([[0.1, 0.2, 0.4]])) * t([[1.0, 1.0, 0.0]])
    assert torch.allclose(value, t([[0.1, 0.1, 0.0]]), atol=1e-9)
    logp2 = t([[-1.0, -2.0]]).requires_grad_()
    kl_penalty("abs", logp2, t([[-1.5, -1.5]])).sum().backward()
    assert torch.equal(logp2.grad, t([[1.0, -1.0]]))


# --- the adaptive KL controller ---------------------------------------------------------------------------

def ref_verl_adaptive(value: float, target: float, horizon: float, kl: float, n: int) -> float:
    """verl ``AdaptiveKLController.update``: ``e = np.clip(kl / target - 1, -0.2, 0.2)``, ``value *= 1 + e * n /
    horizon``."""
    error = float(np.clip(kl / target - 1, -0.2, 0.2))
    return value * (1 + error * n / horizon)


def test_adaptive_kl_controller_is_skyrls_test_vector():
    """SkyRL ``test_adaptive_kl_controller_update``: init 0.2, target 0.1, horizon 100, update(0.2, 10) -> 0.204;
    ``test_fixed_kl_controller``: a fixed one never moves."""
    control = KLController(0.2, "adaptive", target=0.1, horizon=100)
    assert control.update(0.2, 10) == pytest.approx(0.2 * 1.02, rel=1e-12)
    fixed = KLController(0.1)
    assert fixed.update(1.0, 10) == 0.1


def test_adaptive_kl_controller_follows_verls_rule_step_by_step():
    """A scripted KL sequence (inside the clip, past it on both sides, at the target): after each step the
    coefficient is verl's, and a checkpoint round trip continues from where it was."""
    kls = [0.05, 0.3, 0.1, 0.001, 0.12, 0.5, 0.08, 0.0, 0.1, 0.2]
    ns = [64, 64, 32, 128, 64, 16, 64, 64, 8, 64]
    control = KLController(0.05, "adaptive", target=0.1, horizon=1000)
    expected = 0.05
    for step, (kl, n) in enumerate(zip(kls, ns)):
        if step == 5:  # resume mid-run
            restored = KLController(0.05, "adaptive", target=0.1, horizon=1000)
            restored.load_state_dict(control.state_dict())
            control = restored
        expected = ref_verl_adaptive(expected, 0.1, 1000, kl, n)
        assert control.update(kl, n) == pytest.approx(expected, rel=1e-12), step
    assert expected != 0.05
    with pytest.raises(ValueError, match="kl_target > 0 and kl_horizon > 0"):
        KLController(0.1, "adaptive", target=0.1, horizon=0)


def test_kl_controller_from_config():
    cfg = AlgorithmConfig(kl_coef=0.3, kl_ctrl="adaptive", kl_target=0.2, kl_horizon=50.0, kl_in_reward=True)
    control = KLController.from_config(cfg)
    assert (control.value, control.kind, control.target, control.horizon) == (0.3, "adaptive", 0.2, 50.0)


# --- REINFORCE++ and MaxRL --------------------------------------------------------------------------------

def test_reinforce_plus_plus_returns_are_skyrls_test_vectors():
    """SkyRL ``test_compute_reinforce_plus_plus_outcome_advantage_returns_and_masking``: rewards [1, 2, 3], mask
    [1, 1, 0], gamma 1 -> returns [3, 2, 3]; ``..._gamma``: mask all 1, gamma 0.5 -> [2.75, 3.5, 3.0]."""
    assert torch.allclose(discounted_returns(t([1.0, 2.0, 3.0]), t([1.0, 1.0, 0.0]), 1.0), t([3.0, 2.0, 3.0]))
    assert torch.allclose(discounted_returns(t([1.0, 2.0, 3.0]), t([1.0, 1.0, 1.0]), 0.5), t([2.75, 3.5, 3.0]))
    (adv,) = masked_whiten([t([3.0, 2.0, 3.0])], [t([1.0, 1.0, 0.0])])
    assert adv[2] == 0.0 and adv[0] == pytest.approx(0.5 / math.sqrt(0.5 + 1e-8), rel=1e-9)  # [3, 2]: mean 2.5


def ref_verl_reinforce_pp(scores: list[float], masks: list[list[int]], gamma: float) -> list[list[float]]:
    """verl's ``compute_reinforce_plus_plus_outcome_advantage`` over one padded batch: the score on the last valid
    token, the discounted sum from the end with the reset, ``masked_whiten`` (unbiased variance, 1e-8)."""
    returns = []
    for score, mask in zip(scores, masks):
        rewards = [0.0] * len(mask)
        rewards[max(i for i, m in enumerate(mask) if m)] = score
        row, running = [0.0] * len(mask), 0.0
        for i in reversed(range(len(mask))):
            running = rewards[i] + gamma * running
            row[i] = running
            running *= mask[i]
        returns.append(row)
    flat = [r for row, mask in zip(returns, masks) for r, m in zip(row, mask) if m]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(r - mean) / math.sqrt(var + 1e-8) if m else 0.0 for r, m in zip(row, mask)]
            for row, mask in zip(returns, masks)]


@pytest.mark.parametrize("seed, gamma", [(0, 1.0), (1, 0.9), (2, 0.5)])
def test_reinforce_plus_plus_is_verls_on_ragged_batches(seed, gamma):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (6,), generator=gen).tolist()
    scores = torch.rand(6, generator=gen, dtype=f64).tolist()
    masks = [[1] * n for n in lengths]
    expected = ref_verl_reinforce_pp(scores, masks, gamma)
    found = reinforce_plus_plus(t(scores), [t(m) for m in masks], gamma)
    for row, ref in zip(found, expected):
        assert torch.allclose(row, t(ref), atol=1e-6)


def test_reinforce_plus_plus_fills_token_advantages():
    """The step's estimator: the sequence advantage 0, the token advantages verl's (reward minus penalty)."""
    samples = [RolloutSample(prompt_ids=[1], response_ids=[2] * n, loss_mask=np.ones(n, np.uint8),
                             rollout_logprobs=np.zeros(n, np.float32), model_version=np.zeros(n, np.int32),
                             routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP, reward=r,
                             group_id=g) for n, r, g in [(3, 1.0, "a"), (1, 0.0, "a"), (4, 0.5, "b")]]
    fill_advantages(samples, "reinforce_plus_plus", penalties=[0.1, 0.0, 0.2], gamma=0.9)
    expected = ref_verl_reinforce_pp([0.9, 0.0, 0.3], [[1] * 3, [1], [1] * 4], 0.9)
    assert [s.advantage for s in samples] == [0.0, 0.0, 0.0]
    for sample, ref in zip(samples, expected):
        assert np.allclose(sample.token_advantages, ref, atol=1e-6)


def test_maxrl_is_skyrls_test_vector():
    """SkyRL ``test_compute_maxrl_advantage``: groups [6, 3] (mean 4.5) and [9, 12] (mean 10.5)."""
    found = maxrl(t([6.0, 3.0, 9.0, 12.0]), torch.tensor([0, 0, 1, 1]))
    expected = [1.5 / (4.5 + 1e-6), -1.5 / (4.5 + 1e-6), -1.5 / (10.5 + 1e-6), 1.5 / (10.5 + 1e-6)]
    assert torch.allclose(found, t(expected), atol=1e-9)


def test_maxrl_on_random_groups_and_a_group_of_one():
    """SkyRL's ``compute_maxrl_advantage`` in floats: ``(r - mean) / (mean + 1e-6)`` over groups of several, ``r``
    for a group of one (its mean taken as 0)."""
    gen = torch.Generator().manual_seed(3)
    groups = torch.tensor([0, 1, 0, 2, 1, 1, 0])
    rewards = torch.rand(7, generator=gen, dtype=f64)
    members = {g: [rewards[i].item() for i in range(7) if groups[i] == g] for g in set(groups.tolist())}
    expected = []
    for r, g in zip(rewards.tolist(), groups.tolist()):
        mean = sum(members[g]) / len(members[g])
        expected.append((r - mean) / (mean + 1e-6) if len(members[g]) > 1 else r)
    assert torch.allclose(maxrl(rewards, groups), t(expected), atol=1e-9)


# --- prompt_mean and the denominators after rejection -----------------------------------------------------

def test_prompt_mean_is_skyrls_test_vector():
    """SkyRL ``test_prompt_mean``: values [[1, 2], [3, 4], [5, 6], [7, 8]], mask [[1, 1], [1, 0], [1, 1], [1, 1]],
    prompts rows 0-1 and 2-3 -> (2.0 + 6.5) / 2 = 4.25."""
    mask = t([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    weights = prompt_mean_weights(torch.tensor([0, 0, 1, 1]), mask.sum(1))
    num, den = aggregation_fn("prompt_mean", row_weights=weights)(t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]),
                                                                 mask)
    assert (num / den).item() == pytest.approx(4.25, abs=1e-12)


def ref_skyrl_prompt_mean(values, mask, groups) -> float:
    """SkyRL's ``apply_loss_reduction_to_advantages_minibatch`` ``prompt_mean``: token [i, t] of prompt p scaled
    by 1 / (num_prompts * tokens_in_prompt_p), then ``reduce_loss`` sums over the mask."""
    prompts = sorted(set(groups))
    total = 0.0
    for p in prompts:
        rows = [b for b, g in enumerate(groups) if g == p]
        tokens = max(sum(sum(mask[b]) for b in rows), 1)
        total += sum(values[b][i] * mask[b][i] for b in rows for i in range(len(mask[b]))) / (len(prompts) * tokens)
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompt_mean_on_ragged_batches_adds_up_over_micro_batches(seed):
    """Groups of several sizes over a ragged batch: SkyRL's loss; split into micro-batches (rows in another order)
    the numerators and denominators add up to it."""
    values, _, _, mask = ragged(seed, rows=7)
    groups = [0, 1, 0, 2, 1, 1, 0]
    weights = prompt_mean_weights(torch.tensor(groups), mask.sum(1))
    expected = ref_skyrl_prompt_mean(values.tolist(), mask.tolist(), groups)
    num, den = aggregation_fn("prompt_mean", row_weights=weights)(values, mask)
    assert (num / den).item() == pytest.approx(expected, abs=1e-9)
    parts = [[5, 0], [3, 6, 1], [2, 4]]
    pieces = [aggregation_fn("prompt_mean", row_weights=weights[p])(values[p], mask[p]) for p in parts]
    assert (sum(n for n, _ in pieces) / sum(d for _, d in pieces)).item() == pytest.approx(expected, abs=1e-9)


def test_rejection_moves_the_denominators_the_docs_say_it_moves():
    """Rejecting a token and a whole sequence shrinks the denominator of every aggregation not in
    FIXED_DENOMINATORS and leaves those; docs/architecture.md ("Loss normalisation") lists the same two sets."""
    values, _, _, mask = ragged(4, rows=4)
    rejected = mask.clone()
    rejected[0, 0] = 0.0
    rejected[1] = 0.0
    weights = prompt_mean_weights(torch.tensor([0, 0, 1, 1]), mask.sum(1))
    for name in AGGREGATIONS:
        agg = aggregation_fn(name, 8, weights)
        before, after = agg(values, mask)[1].item(), agg(values, rejected)[1].item()
        assert (after == before) == (name in FIXED_DENOMINATORS), name
    section = (ROOT / "docs" / "architecture.md").read_text().split("## Loss normalisation")[1].split("\n## ")[0]
    items = ["- " + item.split("\n\n")[0] for item in section.split("\n- ")[1:]]  # list items, wrapped lines joined
    after_item = next(item for item in items if item.startswith("- counted after rejection"))
    before_item = next(item for item in items if item.startswith("- counted before rejection"))
    assert set(re.findall(r"`(\w+)`", after_item)) == set(AGGREGATIONS) - FIXED_DENOMINATORS
    assert set(re.findall(r"`(\w+)`", before_item)) == FIXED_DENOMINATORS


def test_prompt_mean_through_the_loss_needs_its_weights():
    logp, old, adv, mask = ragged(5, rows=4)
    cfg = AlgorithmConfig(loss_agg="prompt_mean")
    with pytest.raises(ValueError, match="prompt_mean needs the rows' weights"):
        rl_loss(LossInputs(logp, old, adv, mask), cfg)
    weights = prompt_mean_weights(torch.tensor([0, 1, 1, 0]), mask.sum(1))
    out = rl_loss(LossInputs(logp, logp.detach(), adv, mask, row_weights=weights), cfg)
    expected = ref_skyrl_prompt_mean((-adv).tolist(), mask.tolist(), [0, 1, 1, 0])  # ratio 1: L = -A
    assert (out.loss_sum / out.denominator_share).item() == pytest.approx(expected, abs=1e-9)


# --- CISPO's ratio diagnostics ----------------------------------------------------------------------------

def test_cispo_ratio_metrics_skip_masked_tokens_as_skyrl():
    """SkyRL ``test_policy_loss_cispo_ratio_min_max_ignore_masked_tokens``: old [-1, -1, -3], new [-1.69315, -1,
    -0.69741] (ratios ~0.5, 1, 10), the middle token masked: min and max over the two others; the means of the
    ratio and of its clamp to [0.8, 1.2] over them."""
    logp, old = t([[-1.69315, -1.0, -0.69741]]), t([[-1.0, -1.0, -3.0]])
    out = rl_loss(LossInputs(logp, old, t([[1.0, -1.0, -4.0]]), t([[1.0, 0.0, 1.0]])),
                  AlgorithmConfig(policy_loss="cispo"))
    ratios = [math.exp(-0.69315), math.exp(2.30259)]
    assert -out.maxima["cispo/ratio_min"].item() == pytest.approx(ratios[0], rel=1e-3)
    assert out.maxima["cispo/ratio_max"].item() == pytest.approx(ratios[1], rel=1e-3)
    kept = out.sums["kept_tokens"].item()
    assert kept == 2
    assert out.sums["cispo/ratio_mean"].item() / kept == pytest.approx(sum(ratios) / 2, rel=1e-6)
    assert out.sums["cispo/ratio_clamped_mean"].item() / kept == pytest.approx((0.8 + 1.2) / 2, rel=1e-6)
    above = rl_loss(LossInputs(t([[-0.9, -6.0, -0.69741]]), old, t([[1.0, -1.0, -4.0]]), t([[1.0, 0.0, 1.0]])),
                    AlgorithmConfig(policy_loss="cispo"))  # every kept ratio above 1: the masked token is no minimum
    assert -above.maxima["cispo/ratio_min"].item() == pytest.approx(math.exp(0.1), rel=1e-6)
    assert "cispo/ratio_max" not in rl_loss(LossInputs(logp, old, t([[1.0, -1.0, -4.0]]), t([[1.0, 0.0, 1.0]])),
                                             AlgorithmConfig()).maxima


def test_the_run_takes_the_rewards_kl_coefficient_from_verls_controller():
    """``Pipeline.kl_penalties`` over scripted steps (a fake trainer returns each sample's summed KL): each step's
    penalties use the coefficient before its update, which then follows verl's ``apply_kl_penalty``: current KL =
    the batch mean of each sample's token-mean KL, n_steps = the batch's samples."""
    import asyncio

    from megarl.config import load_config
    from megarl.config.components import micro_batching
    from megarl.pipeline.run import Pipeline, resumed_kl_control

    cfg = load_config(["recipe=tiny_moe_cpu", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.05",
                       "algorithm.kl_ctrl=adaptive", "algorithm.kl_target=0.02", "algorithm.kl_horizon=40"])
    lengths = [3, 1, 4, 2]
    scripted = [[0.03, 0.01, 0.2, 0.04], [0.3, 0.5, 0.2, 0.1], [0.0, 0.0, 0.0, 0.0], [0.06, 0.02, 0.08, 0.04]]

    class Trainer:
        async def sequence_kl(self, batch, algo, batching):
            assert len(batch) == len(lengths)
            return scripted[self.step]

    trainer = Trainer()
    pipe = Pipeline(cfg=cfg, trainer=trainer, pool=None, sync=None, buffer=None, producer=None, ledger=None,
                    books=None, batching=micro_batching(cfg, vocab_size=384, pad_id=0), start_step=0,
                    kl_control=resumed_kl_control(cfg, None))
    samples = [RolloutSample(prompt_ids=[1], response_ids=[2] * n, loss_mask=np.ones(n, np.uint8),
                             rollout_logprobs=np.zeros(n, np.float32), model_version=np.zeros(n, np.int32),
                             routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP, reward=1.0,
                             group_id="g") for n in lengths]
    beta = 0.05
    for step, sums in enumerate(scripted):
        trainer.step = step
        penalties = asyncio.run(pipe.kl_penalties(samples, step + 1))
        assert penalties == pytest.approx([beta * s for s in sums], rel=1e-12)
        current = sum(s / n for s, n in zip(sums, lengths)) / len(lengths)
        assert pipe._kl_metrics == pytest.approx({"kl/coef": beta, "kl/reward_kl": current}, rel=1e-12)
        beta = ref_verl_adaptive(beta, 0.02, 40, current, len(lengths))
        assert pipe.kl_control.value == pytest.approx(beta, rel=1e-12)
    resumed = resumed_kl_control(cfg, {"kl_ctrl": pipe.kl_control.state_dict()})
    assert resumed.value == pipe.kl_control.value != 0.05
