"""megarl.algos against values worked out by hand from each formula (numbers in the comments)."""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.advantages import advantage_fn, dr_grpo, group_index, grpo, reinforce_pp, rloo
from megarl.algos.aggregation import aggregation_fn, seq_mean_token_mean, seq_mean_token_sum, token_mean
from megarl.algos.kl import kl_penalty
from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.off_policy import CorrectionSpec, correction, masked_is, off_policy_sequence_mask, truncated_is
from megarl.algos.policy_loss import cispo, gspo, policy_loss_fn, ppo
from megarl.algos.settings import AlgorithmConfig

pytestmark = pytest.mark.unit

f64 = torch.float64
ln = math.log


def close(actual: torch.Tensor, expected, tol: float = 1e-6) -> bool:
    return torch.allclose(actual.detach().to(f64), torch.as_tensor(expected, dtype=f64), atol=tol, rtol=0)


# Advantages: rewards interleave three groups: a = [1, 0, 1, 0], b = [2, 4, 9], c = [7] (alone: no baseline,
# the raw score stays, as verl; tests/test_algos_semantics.py has the peers' formulas).
REWARDS = torch.tensor([1.0, 2.0, 0.0, 7.0, 4.0, 1.0, 9.0, 0.0], dtype=f64)
GROUPS = group_index(["a", "b", "a", "c", "b", "a", "b", "a"])


def test_group_index_numbers_groups_by_first_appearance():
    assert GROUPS.tolist() == [0, 1, 0, 2, 1, 0, 1, 0]


def test_grpo_by_hand():
    # a: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> +-0.8660254
    # b: mean 5, deviations -3, -1, 4, unbiased var 26 / 2 = 13, std 3.6055513 -> -0.8320503, -0.2773501, 1.1094004
    # c: one sample -> mean 0, std 1: 7 / (1 + eps)
    expected = [0.8660254, -0.8320503, -0.8660254, 7.0, -0.2773501, 0.8660254, 1.1094004, -0.8660254]
    assert close(grpo(REWARDS, GROUPS, eps=0.0), expected)


def test_dr_grpo_by_hand():
    assert close(dr_grpo(REWARDS, GROUPS), [0.5, -3.0, -0.5, 7.0, -1.0, 0.5, 4.0, -0.5])


def test_rloo_by_hand():
    # a: 1 - (0 + 1 + 0) / 3 = 2/3, 0 - (1 + 1 + 0) / 3 = -2/3; b: 2 - 13/2, 4 - 11/2, 9 - 6/2
    expected = [2 / 3, -4.5, -2 / 3, 7.0, -1.5, 2 / 3, 6.0, -2 / 3]
    assert close(rloo(REWARDS, GROUPS), expected)


def test_reinforce_pp_by_hand():
    # group-centred: [0.5, -3, -0.5, 7, -1, 0.5, 4, -0.5]; one token each: mean 7/8 = 0.875, sum of squared
    # deviations 76 - 8 * 0.875^2 = 69.875, Bessel variance 69.875 / 7 = 9.9821429, std 3.1594529
    centred = [0.5, -3.0, -0.5, 7.0, -1.0, 0.5, 4.0, -0.5]
    ones = torch.ones(8, dtype=f64)
    assert close(reinforce_pp(REWARDS, GROUPS, token_counts=ones), [(c - 0.875) / 3.1594529 for c in centred])


def test_advantage_bad_input():
    with pytest.raises(ValueError, match="unknown advantage 'ppo'.*dr_grpo, grpo, maxrl, opd, reinforce_pp, rloo"):
        advantage_fn("ppo")
    with pytest.raises(ValueError, match=r"\[B\]"):
        grpo(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="integer"):
        grpo(REWARDS, GROUPS.to(f64))


# PPO: old log-prob -1 everywhere; logp = -1 + ln r. clip_low 0.2, clip_high 0.28 -> band [0.8, 1.28].
#   token  A   r    loss without dual clip               d loss / d logp (= d loss/dr * r)
#   0     +1  1.5   max(-1.5, -1.28) = -1.28 (clipped)    0
#   1     +1  0.5   max(-0.5, -0.8) = -0.5                -A r = -0.5
#   2     -1  0.5   max(0.5, 0.8) = 0.8 (clipped)         0
#   3     +2  1.0   -2                                    -2
#   4     -1  5.0   max(5, 1.28) = 5; dual clip 3 -> 3    5 without dual clip, 0 with it
#   5     -1  2.0   max(2, 1.28) = 2 (< 3: not dual)      2
#   6     -1  1.1   1.1                                   1.1
#   7     (masked, log-ratio 100): loss 0, grad 0
PPO_R = [[1.5, 0.5, 0.5, 1.0], [5.0, 2.0, 1.1, 1.0]]
PPO_A = torch.tensor([[1.0, 1.0, -1.0, 2.0], [-1.0, -1.0, -1.0, 3.0]], dtype=f64)
PPO_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=f64)


def _ppo_inputs():
    old = torch.full((2, 4), -1.0, dtype=f64)
    logp = (old + torch.tensor(PPO_R, dtype=f64).log()).clone()
    logp[1, 3] = 99.0
    return logp.requires_grad_(), old


@pytest.mark.parametrize(
    "dual_clip, loss, grad, clipped",
    [
        (None, [[-1.28, -0.5, 0.8, -2.0], [5.0, 2.0, 1.1, 0.0]], [[0, -0.5, 0, -2], [5, 2, 1.1, 0]],
         [[1, 0, 1, 0], [0, 0, 0, 0]]),
        (3.0, [[-1.28, -0.5, 0.8, -2.0], [3.0, 2.0, 1.1, 0.0]], [[0, -0.5, 0, -2], [0, 2, 1.1, 0]],
         [[1, 0, 1, 0], [0, 0, 0, 0]]),  # token 4 is dual-clipped, not PPO-clipped (its clipped term is smaller)
    ],
)
def test_ppo_clip_and_dual_clip_by_hand(dual_clip, loss, grad, clipped):
    logp, old = _ppo_inputs()
    out = ppo(logp, old, PPO_A, PPO_MASK, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    assert close(out.per_token, loss)
    out.per_token.sum().backward()
    assert close(logp.grad, grad)
    assert out.clipped.tolist() == [[bool(c) for c in row] for row in clipped]
    assert out.dual_clipped.tolist() == [[False] * 4, [dual_clip is not None, False, False, False]]


def test_ppo_ratio_15_clip_02_advantage_plus_1_is_clipped_at_12():
    old = torch.tensor([[-2.0]], dtype=f64)
    logp = (old + ln(1.5)).requires_grad_()
    out = ppo(logp, old, torch.tensor([1.0], dtype=f64), torch.ones(1, 1, dtype=f64))
    assert close(out.per_token, [[-1.2]])
    out.per_token.sum().backward()
    assert logp.grad.item() == 0.0


def test_ppo_bad_input():
    logp, old = _ppo_inputs()
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo(logp, old, PPO_A, PPO_MASK, dual_clip=0.9)
    with pytest.raises(ValueError, match="clip_low"):
        ppo(logp, old, PPO_A, PPO_MASK, clip_low=1.0)
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, T\]"):
        ppo(logp, old, PPO_A[:, :3], PPO_MASK)
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        ppo(logp, old[:, :3], PPO_A, PPO_MASK)
    with pytest.raises(ValueError, match="unknown policy_loss 'grpo'; valid: cispo, clip_cov, dppo, gspo, kl_cov, ppo"):
        policy_loss_fn("grpo")


# GSPO, band [0.8, 1.2]. Row 0: token log-ratios 0.1, 0.2, 0.3 -> mean 0.2, s = e^0.2 = 1.2214028, A = +1:
# clipped at 1.2, loss -1.2 per token, no gradient. Row 1: log-ratios -0.1, 0.3 (third token masked,
# log-ratio 5) -> mean 0.1, s = e^0.1 = 1.1051709 inside the band, A = -2: loss 2 s = 2.2103418 per token.
def _gspo_inputs():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=f64)
    logp = (old + torch.tensor([[0.1, 0.2, 0.3], [-0.1, 0.3, 5.0]], dtype=f64)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=f64)
    return logp, old, torch.tensor([1.0, -2.0], dtype=f64), mask


def test_gspo_sequence_ratio_and_shared_gradient_by_hand():
    logp, old, adv, mask = _gspo_inputs()
    out = gspo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert close(out.per_token, [[-1.2, -1.2, -1.2], [2.2103418, 2.2103418, 0.0]])
    assert out.clipped.tolist() == [[True, True, True], [False, False, False]]
    # token_mean over 5 tokens: (3 * -1.2 + 2 * 2.2103418) / 5; d/dlogp of row 1 = -A s / 5 = 0.4420684 on both
    # tokens although their own ratios differ (e^-0.1 vs e^0.3): the gradient is shared by the sequence.
    numerator, denominator = token_mean(out.per_token, mask)
    loss = numerator / denominator
    assert close(loss, (3 * -1.2 + 2 * 2.2103418) / 5)
    loss.backward()
    assert close(logp.grad, [[0.0, 0.0, 0.0], [0.4420684, 0.4420684, 0.0]])


def test_gspo_gradient_equals_sequence_level_objective_under_seq_mean():
    # GSPO objective mean_i -A_i s_i: d/dlogp_t of row 1 = (1/2) * 2 * s / |y| = 1.1051709 / 2 = 0.5525855
    logp, old, adv, mask = _gspo_inputs()
    numerator, denominator = seq_mean_token_mean(gspo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2).per_token,
                                                 mask)
    (numerator / denominator).backward()
    assert close(logp.grad, [[0.0, 0.0, 0.0], [0.5525855, 0.5525855, 0.0]])


def test_rl_loss_rejects_settings_of_another_policy_loss():
    logp, old, adv, mask = _gspo_inputs()
    inputs = LossInputs(logprobs=logp, old_logprobs=old, advantages=adv, loss_mask=mask)
    with pytest.raises(ValueError, match="dual_clip applies to the ppo policy loss only"):
        rl_loss(inputs, AlgorithmConfig(policy_loss="gspo", dual_clip=3.0))
    with pytest.raises(ValueError, match="clip_absolute applies to the cispo policy loss only"):
        rl_loss(inputs, AlgorithmConfig(policy_loss="ppo", clip_absolute=True))


# CISPO, band [0.8, 1.2], old log-prob -1: L = -sg(clip(r)) A logp.
#   r = 1.5, A = +1: logp = -1 + ln 1.5 = -0.5945349, w = 1.2: L = 1.2 * 0.5945349 = 0.7134419, dL/dlogp = -1.2
#   r = 0.9, A = -1: logp = -1.1053605, w = 0.9: L = -0.9 * 1.1053605 = -0.9948245, dL/dlogp = +0.9
#   r = 0.5, A = +2: logp = -1.6931472, w = 0.8: L = 1.6 * 1.6931472 = 2.7090355, dL/dlogp = -1.6
def test_cispo_detached_clipped_weight_by_hand():
    old = torch.full((1, 3), -1.0, dtype=f64, requires_grad=True)
    logp = (torch.full((1, 3), -1.0, dtype=f64)
            + torch.tensor([[ln(1.5), ln(0.9), ln(0.5)]], dtype=f64)).requires_grad_()
    out = cispo(logp, old, torch.tensor([[1.0, -1.0, 2.0]], dtype=f64), torch.ones(1, 3, dtype=f64))
    assert close(out.per_token, [[0.7134419, -0.9948245, 2.7090355]])
    assert out.clipped_high.tolist() == [[True, False, False]] and out.clipped_low.tolist() == [[False, False, True]]
    out.per_token.sum().backward()
    # the clipped tokens still learn (unlike PPO), and the ratio adds nothing: a ratio with gradient
    # would give -A (w + r logp) instead, e.g. 0.9 + 0.9 * -1.1053605 on the middle token
    assert close(logp.grad, [[-1.2, 0.9, -1.6]])
    assert old.grad is None


# Aggregation: L = [[1, 2, 3, 4], [5, 6, 7, 8], [inf, nan, 9, 9]], m = [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
AGG_L = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [math.inf, math.nan, 9.0, 9.0]], dtype=f64)
AGG_M = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=f64)


@pytest.mark.parametrize(
    "name, numerator, denominator",
    [
        ("token_mean", 1 + 2 + 5 + 6 + 7, 5),  # 21 / 5 = 4.2
        ("seq_mean_token_mean", 1.5 + 6.0, 2),  # the empty row is not a sequence
        ("seq_mean_token_sum", 3 + 18, 2),
        ("seq_mean_token_sum_norm", 3 + 18, 3 * 4),  # every row, padded length 4
    ],
)
def test_aggregation_by_hand(name, numerator, denominator):
    num, den = aggregation_fn(name)(AGG_L, AGG_M)
    assert close(num, numerator) and close(den, denominator)


def test_aggregation_weights_in_gradient():
    # seq_mean_token_mean: d/dL of row 0 tokens = 1/2 * 1/2, row 1 tokens = 1/2 * 1/3
    per_token = torch.zeros(2, 3, dtype=f64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=f64)
    numerator, denominator = seq_mean_token_mean(per_token, mask)
    (numerator / denominator).backward()
    assert close(per_token.grad, [[0.25, 0.25, 0.0], [1 / 6, 1 / 6, 1 / 6]])
    per_token.grad = None
    numerator, denominator = seq_mean_token_sum(per_token, mask)
    (numerator / denominator).backward()
    assert close(per_token.grad, [[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]])


def test_aggregation_bad_input():
    with pytest.raises(ValueError, match="unknown loss_agg 'mean'"):
        aggregation_fn("mean")
    with pytest.raises(ValueError, match="needs a constant loss_scale_factor > 0"):
        aggregation_fn("seq_mean_token_sum_norm", "${rollout.max_new_tokens}")(AGG_L, AGG_M)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_mean(AGG_L, AGG_M[:, :2])


# KL: logp = -1, ref = -1.5 -> x = 0.5; logp = -2, ref = -1 -> x = -1. old = -1.2 and -2.1 (ratios e^0.2, e^0.1).
#   k1 = x: 0.5, -1                         grad 1, 1
#   k2 = x^2 / 2: 0.125, 0.5                grad x: 0.5, -1
#   k3 = e^-x + x - 1: 0.1065307, 0.7182818 grad 1 - e^-x: 0.3934693, -1.7182818
#   k3_is = r k3: 1.2214028 * 0.1065307 = 0.1301168, 1.1051709 * 0.7182818 = 0.7938242
#     grad r k3 + r (1 - e^-x) = r x: 0.6107014, -1.1051709
@pytest.mark.parametrize(
    "name, value, grad",
    [
        ("k1", [0.5, -1.0], [1.0, 1.0]),
        ("k2", [0.125, 0.5], [0.5, -1.0]),
        ("k3", [0.1065307, 0.7182818], [0.3934693, -1.7182818]),
        ("k3_is", [0.1301168, 0.7938242], [0.6107014, -1.1051709]),
    ],
)
def test_kl_estimators_by_hand(name, value, grad):
    logp = torch.tensor([[-1.0, -2.0]], dtype=f64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=f64)
    old = torch.tensor([[-1.2, -2.1]], dtype=f64)
    kl = kl_penalty(name, logp, ref, old)
    assert close(kl, [value])
    kl.sum().backward()
    assert close(logp.grad, [grad])


def test_kl_bad_input():
    logp = torch.zeros(1, 2, dtype=f64)
    with pytest.raises(ValueError, match="unknown kl_type 'k4'; valid: abs, k1, k1_is, k2, k2_is, k3, k3_is"):
        kl_penalty("k4", logp, logp)
    with pytest.raises(ValueError, match="k3_is needs old_logprobs"):
        kl_penalty("k3_is", logp, logp)


# Off-policy weights w_t = exp(old - rollout), C = 2 (MIS band [0.5, 2]).
#   row 0: w = 3, 0.4, 1.5          product 1.8
#   row 1: w = 0.3, 1.5, (masked 10) product 0.45
OP_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=f64)


def _off_policy_inputs():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=f64)
    old = rollout + torch.tensor([[ln(3), ln(0.4), ln(1.5)], [ln(0.3), ln(1.5), ln(10)]], dtype=f64)
    return old.requires_grad_(), rollout


@pytest.mark.parametrize(
    "level, truncated, masked_keep",
    [
        ("token", [[2.0, 0.4, 1.5], [0.3, 1.5, 0.0]], [[False, False, True], [False, True, False]]),
        ("sequence", [[1.8, 1.8, 1.8], [0.45, 0.45, 0.0]], [[True, True, True], [False, False, False]]),
    ],
)
def test_importance_weights_by_hand(level, truncated, masked_keep):
    old, rollout = _off_policy_inputs()
    weights = truncated_is(old, rollout, OP_MASK, 2.0, level)
    assert close(weights, truncated)
    assert not weights.requires_grad
    weights, keep = masked_is(old, rollout, OP_MASK, 2.0, level)  # rejected tokens leave the mask, kept keep w
    assert keep.tolist() == masked_keep
    assert close(weights, [[3.0, 0.4, 1.5], [0.3, 1.5, 0.0]] if level == "token" else [[1.8] * 3, [0.45, 0.45, 0.0]])


def test_correction_selects_by_config_names():
    old, rollout = _off_policy_inputs()
    tis = correction(old, rollout, OP_MASK, CorrectionSpec("tis", "token", 2.0))
    assert close(tis.weights, [[2.0, 0.4, 1.5], [0.3, 1.5, 0.0]]) and tis.keep.tolist() == (OP_MASK > 0).tolist()
    assert close(correction(old, None, OP_MASK, CorrectionSpec("none", "token", 2.0)).weights, OP_MASK)
    with pytest.raises(ValueError, match="unknown off_policy_correction 'pis'; valid: none, tis, mis"):
        correction(old, rollout, OP_MASK, CorrectionSpec("pis", "token", 2.0))
    with pytest.raises(ValueError, match="unknown off_policy_level 'batch'; valid: token, sequence, geometric"):
        correction(old, rollout, OP_MASK, CorrectionSpec("tis", "batch", 2.0))
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        correction(old, None, OP_MASK, CorrectionSpec("mis", "token", 2.0))
    with pytest.raises(ValueError, match="off_policy_veto_threshold needs rollout_logprobs"):
        correction(old, None, OP_MASK, CorrectionSpec("none", "token", 2.0, veto_threshold=1e-4))
    with pytest.raises(ValueError, match="is_threshold must be >= 1"):
        truncated_is(old, rollout, OP_MASK, 0.5)
    with pytest.raises(ValueError, match=r"is_threshold_low must be in \[0, 1\]"):
        masked_is(old, rollout, OP_MASK, 2.0, threshold_low=1.5)


def test_off_policy_sequence_mask_by_hand():
    # kl_i = mean_t (rollout - logp): row 0 (0.3 + 0.1) / 2 = 0.2, row 1 the same, row 2 0.05 (masked 9 ignored).
    # bound 0.1: row 0 has A < 0 and kl > 0.1 -> dropped; row 1 has A > 0 -> kept; row 2 kl <= 0.1 -> kept.
    logp = torch.tensor([[-1.3, -1.1, 0.0], [-1.3, -1.1, 0.0], [-1.05, -1.05, -10.0]], dtype=f64)
    rollout = torch.full((3, 3), -1.0, dtype=f64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=f64)
    keep = off_policy_sequence_mask(logp, rollout, torch.tensor([-1.0, 1.0, -1.0], dtype=f64), mask, max_kl=0.1)
    assert keep.tolist() == [False, True, True]


def test_rl_loss_combines_the_configured_terms_by_hand():
    # ratio 1, A = +1: PPO loss -1 per token; TIS weights min(4, 2) = 2 and 1 -> pg = (-2 - 1) / 2 = -1.5
    # k1 to ref: [0.5, 0] -> mean 0.25, times 0.1; entropy [1, 3] -> mean 2, times 0.01
    # loss = -1.5 + 0.025 - 0.02 = -1.495; d/dlogp = pg [-2/2, -1/2] + kl 0.1 / 2 = [-0.95, -0.45]
    cfg = AlgorithmConfig(kl_coef=0.1, kl_type="k1", entropy_coef=0.01, off_policy_correction="tis", is_threshold=2.0)
    logp = torch.tensor([[-1.0, -2.0]], dtype=f64, requires_grad=True)
    batch = LossInputs(
        logprobs=logp,
        old_logprobs=logp.detach().clone(),
        advantages=torch.tensor([1.0], dtype=f64),
        loss_mask=torch.ones(1, 2, dtype=f64),
        entropy=torch.tensor([[1.0, 3.0]], dtype=f64),
        ref_logprobs=torch.tensor([[-1.5, -2.0]], dtype=f64),
        rollout_logprobs=torch.tensor([[-1.0 - ln(4), -2.0]], dtype=f64),
    )
    out = rl_loss(batch, cfg)
    assert close(out.loss, -1.495) and close(out.denominator_share, 2) and close(out.loss_sum, -2.99)
    assert close(out.sums["pg_loss"], -3.0) and close(out.sums["is_weight_mean"], 3.0)
    assert close(out.sums["kl"], 0.5) and close(out.sums["entropy"], 4.0) and close(out.trained_tokens, 2)
    out.loss.backward()
    assert close(logp.grad, [[-0.95, -0.45]])
    with pytest.raises(ValueError, match="kl_coef != 0 needs ref_logprobs"):
        rl_loss(LossInputs(logp, logp.detach(), batch.advantages, batch.loss_mask, entropy=batch.entropy,
                           rollout_logprobs=batch.rollout_logprobs), cfg)


def test_rl_loss_drops_negative_far_off_policy_sequences():
    # ratio 1 everywhere, so the PPO loss per token is -A. Sequence 0 (A=-1) has KL(mu||pi) = 0.5 per
    # token, above the bound 0.1; sequence 1 (A=+1) has KL 0. Token mean with seq 0 dropped:
    # (-1 - 1) / 2 = -1 ; without the mask: (+1 +1 -1 -1) / 4 = 0.
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=torch.float64)
    inputs = LossInputs(logprobs=logp, old_logprobs=logp.detach(),
                        advantages=torch.tensor([-1.0, 1.0], dtype=torch.float64),
                        loss_mask=torch.ones(2, 2, dtype=torch.float64), rollout_logprobs=rollout)
    masked = rl_loss(inputs, AlgorithmConfig(off_policy_mask_kl=0.1))
    assert masked.loss.item() == pytest.approx(-1.0)
    assert masked.sums["rejected_sequences"].item() == 1 and masked.sums["rejected_tokens"].item() == 2
    assert rl_loss(inputs, AlgorithmConfig()).loss.item() == pytest.approx(0.0)
