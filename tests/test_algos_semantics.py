"""megarl.algos mean what the peers mean by the same names (issue #14).

Each test states the peer's formula and the file it is read from (verl: github.com/volcengine/verl,
slime: github.com/THUDM/slime, AReaL: github.com/inclusionAI/AReaL), and computes the reference
independently: a transcription of that formula in plain Python loops over floats, never megarl's code.
Where a peer publishes test vectors they are used as they are.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megarl.algos.advantages import dr_grpo, fill_advantages, group_index, grpo, reinforce_pp, rloo
from megarl.algos.aggregation import aggregation_fn
from megarl.algos.kl import kl_penalty
from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.off_policy import CorrectionSpec, correction
from megarl.algos.policy_loss import cispo, ppo, sapo
from megarl.algos.settings import AlgorithmConfig
from megarl.sample import FinishReason, RolloutSample

pytestmark = pytest.mark.unit

f64 = torch.float64


def close(actual, expected, tol: float = 1e-9) -> bool:
    return torch.allclose(torch.as_tensor(actual, dtype=f64).detach(), torch.as_tensor(expected, dtype=f64),
                          atol=tol, rtol=1e-9)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=f64)


# --- the reference: slime's compute_mis_weights, one sequence at a time, in plain floats -----------------

def ref_mis(log_ratios: list[float], mask: list[int], level: str, mode: str, low: float, high: float,
            veto: float | None = None) -> tuple[list[float], list[int]]:
    """slime ``examples/train_infer_mismatch_helper/mis.py``, ``compute_mis_weights`` for one sequence:
    ``l = raw`` (token), ``sum_t m_t raw_t`` (sequence), ``sum_t m_t raw_t / sum_t m_t`` (geometric);
    ``w = exp(clamp(l, -20, 20))``; truncate ``clamp(w, 0, high) * m``, clip ``clamp(w, low, high) * m``,
    mask ``w * m`` with ``m' = m * 1[low <= w <= high]``; veto: ``m' = 0`` for the whole sequence when any
    trained token has ``raw_t < log(veto)``. Returns (weights, kept mask)."""
    trained = [i for i, m in enumerate(mask) if m]
    if level == "token":
        logs = list(log_ratios)
    else:
        total = sum(log_ratios[i] for i in trained)
        logs = [total / max(len(trained), 1) if level == "geometric" else total] * len(mask)
    weights, kept = [], []
    for i, m in enumerate(mask):
        w = math.exp(min(max(logs[i], -20.0), 20.0))
        if mode == "truncate":
            w, k = min(max(w, low), high), m
        else:
            k = m if low <= w <= high else 0
        weights.append(w * m)
        kept.append(k)
    if veto is not None and any(log_ratios[i] < math.log(veto) for i in trained):
        kept = [0] * len(mask)
    return weights, kept


def ref_token_mean(values: list[list[float]], mask: list[list[int]]) -> float:
    """verl ``agg_loss`` token-mean: ``sum(L * m) / sum(m)``."""
    num = sum(v * m for row, mrow in zip(values, mask) for v, m in zip(row, mrow))
    return num / sum(m for mrow in mask for m in mrow)


# Two sequences of four tokens, the last token of sequence 1 untrained; log(pi_old / pi_rollout) per token.
LOG_RATIOS = [[math.log(3.0), math.log(0.4), math.log(1.5), math.log(1.1)],
              [math.log(0.3), math.log(1.5), math.log(0.9), 9.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def _logprobs():
    rollout = t([[-1.0, -2.0, -3.0, -1.5], [-1.0, -1.2, -0.7, -2.0]])
    return rollout + t(LOG_RATIOS), rollout


# 1. Rejection ------------------------------------------------------------------------------------------

def test_rejected_tokens_leave_the_mask_and_the_token_mean_denominator():
    """verl ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_rejection_mask`` returns
    ``response_mask * mask`` and ``compute_rollout_correction_and_add_to_batch`` makes it the batch's
    ``response_mask``, whose sum ``agg_loss`` token-mean divides by; slime ``mis.py`` ``mask`` mode returns
    ``modified_mask = loss_mask * 1[low <= w <= high]`` and keeps ``weights * loss_mask`` for the kept tokens.
    So the loss is ``sum_{kept} w_t L_t / #kept``, here with PPO at ratio 1 (``L_t = -A``)."""
    old, rollout = _logprobs()
    adv = [1.0, -2.0]
    logp = old.clone().requires_grad_()
    batch = LossInputs(logprobs=logp, old_logprobs=old, advantages=t(adv), loss_mask=t(MASK),
                       rollout_logprobs=rollout)
    out = rl_loss(batch, AlgorithmConfig(off_policy_correction="mis", is_threshold=2.0))
    weights, kept = zip(*(ref_mis(lr, m, "token", "mask", 0.5, 2.0) for lr, m in zip(LOG_RATIOS, MASK)))
    per_token = [[w * -a for w in row] for row, a in zip(weights, adv)]
    expected = ref_token_mean(per_token, kept)
    assert kept == ([0, 0, 1, 1], [0, 1, 1, 0])  # 3 and 0.4, 0.3 are outside [1/2, 2]
    assert close(out.loss, expected) and close(out.denominator_share, 4)  # 4 kept tokens, not 7 trained
    assert close(out.sums["is_weight_mean"], 1.5 + 1.1 + 1.5 + 0.9)  # kept tokens keep their weights
    assert close(out.sums["rejected_tokens"], 3) and close(out.sums["rejected_sequences"], 0)
    assert close(out.trained_tokens, 7) and close(out.trained_sequences, 2)
    out.loss.backward()  # rejected tokens get no gradient; kept ones -A w / #kept
    assert close(logp.grad, [[0, 0, -1.5 / 4, -1.1 / 4], [0, 2 * 1.5 / 4, 2 * 0.9 / 4, 0]])


def test_vetoed_sequence_leaves_the_sequence_mean_denominator():
    """slime ``mis.py`` ``calculate_veto_mask`` (and verl's former ``rollout_token_veto_threshold`` in
    ``rollout_corr_helper.py``): a sequence with any trained token ``log_ratio < log(veto)`` gets mask 0;
    with ``seq-mean-token-mean`` (verl ``agg_loss``: mean over sequences with ``sum(mask) > 0`` of their token
    means) the vetoed sequence leaves the sequence count. TIS weights of the kept sequence stay."""
    old, rollout = _logprobs()
    adv = [1.0, -2.0]
    batch = LossInputs(logprobs=old.clone(), old_logprobs=old, advantages=t(adv), loss_mask=t(MASK),
                       rollout_logprobs=rollout)
    cfg = AlgorithmConfig(off_policy_correction="tis", off_policy_veto_threshold=0.35, loss_agg="seq_mean_token_mean")
    out = rl_loss(batch, cfg)
    refs = [ref_mis(lr, m, "token", "truncate", 0.0, 2.0, veto=0.35) for lr, m in zip(LOG_RATIOS, MASK)]
    seq_means = [sum(w * -a for w, k in zip(ws, ks) if k) / sum(ks) for (ws, ks), a in zip(refs, adv) if sum(ks)]
    assert [sum(ks) for _, ks in refs] == [4, 0]  # sequence 1 has a ratio 0.3 < 0.35
    assert close(out.loss, sum(seq_means) / len(seq_means)) and close(out.denominator_share, 1)
    assert close(out.sums["rejected_sequences"], 1) and close(out.sums["rejected_tokens"], 3)


def test_micro_batches_add_up_to_the_batch_loss_after_rejection():
    """The contract megatron's ``calculate_per_token_loss`` relies on (and verl's ``batch_num_tokens``,
    ``verl/workers/engine/megatron/transformer_impl.py``: the global count of the loss mask after rejection):
    ``sum(loss_sum) / sum(denominator_share)`` over micro-batches is the loss of the whole batch."""
    old, rollout = _logprobs()
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        cfg = AlgorithmConfig(off_policy_correction="mis", loss_agg=agg, loss_scale_factor=4, kl_coef=0.1,
                              entropy_coef=0.01)
        full = LossInputs(logprobs=old + 0.05, old_logprobs=old, advantages=t([1.0, -2.0]), loss_mask=t(MASK),
                          rollout_logprobs=rollout, ref_logprobs=old - 0.1, entropy=old.abs())
        whole = rl_loss(full, cfg)
        parts = [rl_loss(LossInputs(*(getattr(full, f)[i:i + 1] for f in ("logprobs", "old_logprobs", "advantages",
                                                                          "loss_mask", "entropy", "ref_logprobs",
                                                                          "rollout_logprobs"))), cfg)
                 for i in range(2)]
        assert close(sum(p.loss_sum for p in parts) / sum(p.denominator_share for p in parts), whole.loss), agg
        for key in whole.sums:
            assert close(sum(p.sums[key] for p in parts), whole.sums[key]), (agg, key)


# 2. Levels, modes, clamp, veto ---------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("kind, mode, low, high", [
    ("tis", "truncate", None, 2.0),  # slime truncate: clamp(w, 0, C)
    ("tis", "truncate", 0.8, 2.0),  # slime clip: clamp(w, low, C)
    ("mis", "mask", None, 2.0),  # slime mask with its default low = 1 / C
    ("mis", "mask", 0.95, 1.2),
])
def test_levels_and_modes_match_slime_mis(level, kind, mode, low, high):
    """slime ``examples/train_infer_mismatch_helper/mis.py`` ``compute_mis_weights`` (levels token /
    sequence / geometric, modes truncate / clip / mask, ``tis_lower_bound`` default ``1 / tis_upper_bound``),
    transcribed in :func:`ref_mis`; megarl's ``tis`` without a lower bound is slime's truncate (bound 0),
    with one slime's clip."""
    old, rollout = _logprobs()
    out = correction(old, rollout, t(MASK), CorrectionSpec(kind, level, high, low))
    ref_low = low if low is not None else (0.0 if kind == "tis" else 1.0 / high)
    refs = [ref_mis(lr, m, level, mode, ref_low, high) for lr, m in zip(LOG_RATIOS, MASK)]
    assert close(out.weights, [w for w, _ in refs])
    assert out.keep.tolist() == [[bool(k) for k in ks] for _, ks in refs]


def test_log_ratios_are_clamped_to_20_before_exp():
    """verl ``rollout_corr_helper.py`` (``SAFETY_BOUND = 20.0``: ``exp(clamp(log_ratio_sum, -20, 20))``) and
    slime ``mis.py`` (``SAFETY_BOUND``): the sequence log-ratio 15 + 10 = 25 gives ``w = e^20``, -25 gives
    ``e^-20``."""
    rollout = t([[-30.0, -30.0], [-1.0, -1.0]])
    old = rollout + t([[15.0, 10.0], [-15.0, -10.0]])
    out = correction(old, rollout, torch.ones(2, 2, dtype=f64), CorrectionSpec("tis", "sequence", 1e12))
    assert close(out.weights, [[math.exp(20.0)] * 2, [math.exp(-20.0)] * 2], tol=1e-3)
    for row, weights in zip(([15.0, 10.0], [-15.0, -10.0]), out.weights.tolist()):
        assert close(weights, ref_mis(row, [1, 1], "sequence", "truncate", 0.0, 1e12)[0], tol=1e-3)


def test_veto_drops_whole_sequences_on_a_raw_token_ratio():
    """verl (former) ``compute_rollout_correction_and_rejection_mask``: ``catastrophic = (log_ratio <
    log(veto)) & response_mask``, ``veto_mask = ~catastrophic.any(-1)``, on the raw (unclamped) ratio;
    slime ``mis.py`` ``calculate_veto_mask`` the same per sequence. Untrained tokens cannot veto."""
    old, rollout = _logprobs()
    mask = [[1, 1, 1, 1], [1, 1, 1, 0]]
    log_ratios = [row[:] for row in LOG_RATIOS]
    log_ratios[1][3] = -50.0  # untrained
    old = rollout + t(log_ratios)
    for veto in (0.35, 0.25, 1e-4):
        out = correction(old, rollout, t(mask), CorrectionSpec("none", "token", 2.0, veto_threshold=veto))
        expected = [ref_mis(lr, m, "token", "truncate", 0.0, math.inf, veto=veto)[1] for lr, m in zip(log_ratios, mask)]
        assert out.keep.tolist() == [[bool(k) for k in ks] for ks in expected], veto
        assert close(out.weights, mask)


# 3. TIS lower bound and IcePop bounds ---------------------------------------------------------------------

def test_tis_lower_bound_and_icepop_band_with_independent_bounds():
    """slime ``slime/backends/megatron_utils/loss.py``: ``vanilla_tis_function`` weights
    ``clamp(r, tis_clip_low, tis_clip)``; ``icepop_function`` keeps ``r`` where ``tis_clip_low <= r <= tis_clip``.
    With the asymmetric band [0.5, 5]: ratios 3 and 0.4 -> TIS 3 and 0.5, IcePop keeps 3 and drops 0.4
    (megarl's mis: the dropped token leaves the mask; slime's icepop zeroes its weight only)."""
    ratios = [3.0, 0.4, 7.0, 1.0]
    rollout = torch.full((1, 4), -2.0, dtype=f64)
    old = rollout + t([[math.log(r) for r in ratios]])
    mask = torch.ones(1, 4, dtype=f64)
    tis = correction(old, rollout, mask, CorrectionSpec("tis", "token", 5.0, 0.5))
    assert close(tis.weights, [[min(max(r, 0.5), 5.0) for r in ratios]]) and bool(tis.keep.all())
    icepop = correction(old, rollout, mask, CorrectionSpec("mis", "token", 5.0, 0.5))
    assert icepop.keep.tolist() == [[0.5 <= r <= 5.0 for r in ratios]]
    assert close(icepop.weights * icepop.keep, [[r if 0.5 <= r <= 5.0 else 0.0 for r in ratios]])


# 4. REINFORCE++-baseline ---------------------------------------------------------------------------------

def ref_rf_baseline(scores: list[float], index: list[str], response_mask: list[list[int]]) -> list[float]:
    """verl ``verl/trainer/ppo/core_algos.py`` ``compute_reinforce_plus_plus_baseline_outcome_advantage``:
    ``score - mean_g`` (mean 0 for a group of one), tiled over the response and whitened with
    ``verl/utils/torch_functional.py`` ``masked_whiten``: token mean, Bessel ``masked_var`` over tokens,
    ``(x - mean) * rsqrt(var + 1e-8)``. Returns each sample's (per-token constant) advantage."""
    groups: dict[str, list[float]] = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    base = [s - (sum(groups[i]) / len(groups[i]) if len(groups[i]) > 1 else 0.0) for s, i in zip(scores, index)]
    tokens = [b for b, row in zip(base, response_mask) for m in row if m]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / len(tokens) * len(tokens) / (len(tokens) - 1)
    return [(b - mean) / math.sqrt(var + 1e-8) for b in base]


def test_reinforce_pp_whitens_over_valid_tokens_as_verl():
    """verl's REINFORCE++-baseline whitens over the batch's valid tokens (:func:`ref_rf_baseline`), so a
    long response weighs its length in the mean and variance; megarl takes the token counts (loss-mask
    sums) per sample. ``fill_advantages`` counts trained tokens, not response length."""
    scores = [1.0, 0.0, 0.0, 3.0, 1.0, 2.0]
    index = ["a", "a", "a", "b", "b", "c"]
    response_mask = [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1],
                     [1, 1, 0, 0, 0]]
    expected = ref_rf_baseline(scores, index, response_mask)
    counts = t([sum(row) for row in response_mask])
    assert close(reinforce_pp(t(scores), group_index(index), token_counts=counts), expected)
    # tool-output tokens (loss mask 0) inside a response are not counted: each sample's response is 5 long
    samples = [RolloutSample(prompt_ids=[1], response_ids=[2] * 5, loss_mask=np.array(row, np.uint8),
                             rollout_logprobs=np.zeros(5, np.float32), model_version=np.zeros(5, np.int32),
                             routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP, reward=s,
                             group_id=i) for s, i, row in zip(scores, index, response_mask)]
    fill_advantages(samples, "reinforce_pp")
    assert close([s.advantage for s in samples], expected)


# 5. KL estimators ----------------------------------------------------------------------------------------

LOGP = [[-1.0, -2.0, -0.1, -30.0]]
REF = [[-1.5, -1.0, -25.0, -12.0]]  # the last two: k3 past 10, low_var_kl clamped
OLD = [[-1.2, -2.1, -0.3, -29.0]]


def ref_kl(name: str, logp: float, ref: float, old: float) -> tuple[float, float]:
    """(value, d value / d logp). verl ``core_algos.py`` ``kl_penalty_forward``: ``low_var_kl``: ``kl =
    clamp(ref - logp, -20, 20)``, ``clamp(exp(kl) - kl - 1, -10, 10)``; slime ``slime/utils/ppo_utils.py``
    ``compute_approx_kl``: ``k1 = log_ratio``, ``k2 = log_ratio^2 / 2``, ``k3 = exp(-log_ratio) - 1 + log_ratio``
    and with ``use_unbiased_kl`` ``importance_ratio * kl``, ``importance_ratio = exp(logp - old)`` (live), then for
    ``low_var_kl`` ``torch.clamp(kl, min=-10, max=10)`` after the weight (``low_var_kl_is``)."""
    x = logp - ref
    base = {"k1": (x, 1.0), "k2": (x * x / 2, x), "k3": (math.exp(-x) - 1 + x, 1 - math.exp(-x))}
    if name == "low_var_kl":
        k = min(max(ref - logp, -20.0), 20.0)
        value = math.exp(k) - k - 1
        inside = abs(ref - logp) <= 20.0 and -10.0 < value < 10.0
        return min(max(value, -10.0), 10.0), (1 - math.exp(-x)) if inside else 0.0
    if name == "low_var_kl_is":
        value, grad = ref_kl("k3_is", logp, ref, old)
        return min(max(value, -10.0), 10.0), grad if -10.0 < value < 10.0 else 0.0
    if name.endswith("_is"):
        r = math.exp(logp - old)
        value, grad = base[name[:2]]
        return r * value, r * value + r * grad
    return base[name]


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "low_var_kl", "k1_is", "k2_is", "k3_is", "low_var_kl_is"])
def test_kl_estimators_match_the_peers(name):
    """The values and gradients of :func:`ref_kl`; the ``*_is`` gradients are those of ``r * k`` with the
    ratio ``r = exp(logp - sg(old))`` carrying its gradient (slime multiplies by the live ``importance_ratio``)."""
    logp = t(LOGP).requires_grad_()
    kl = kl_penalty(name, logp, t(REF), t(OLD))
    expected = [ref_kl(name, a, b, c) for a, b, c in zip(LOGP[0], REF[0], OLD[0])]
    assert close(kl, [[v for v, _ in expected]], tol=1e-6)
    kl.sum().backward()
    assert close(logp.grad, [[g for _, g in expected]], tol=1e-6)


def test_low_var_kl_is_clamped_where_k3_is_not():
    """verl's clamp to [-10, 10] (``kl_penalty_forward``); slime's ``k3`` is unclamped: at logp - ref = 24.9,
    k3 = e^-24.9 + 23.9 but low_var_kl = 10, with zero gradient there."""
    logp = t([[-0.1]]).requires_grad_()
    assert close(kl_penalty("k3", logp, t([[-25.0]])), [[math.exp(-24.9) + 23.9]], tol=1e-9)
    capped = kl_penalty("low_var_kl", logp, t([[-25.0]]))
    capped.sum().backward()
    assert close(capped, [[10.0]]) and logp.grad.item() == 0.0


# 6. SAPO, CISPO, PPO dual clip ---------------------------------------------------------------------------

def test_sapo_soft_gate_as_verl_and_areal():
    """verl ``core_algos.py`` ``compute_policy_loss_sapo`` and AReaL ``areal/utils/functional/functional.py``
    ``sapo_loss_fn``: ``L = -sigmoid(tau (r - 1)) * 4 / tau * A``, ``tau = tau_pos`` if ``A > 0`` else
    ``tau_neg`` (defaults 1.0, 1.05 in verl ``actor.yaml`` and AReaL ``cli_args.py``), ``r = exp(clamp(logp -
    old, -20, 20))``. The gradient w.r.t. ``logp`` is ``-A r 4 s (1 - s)``; at ``r = 1`` it is ``-A``."""
    ratios = [1.0, 1.3, 0.6, 1.0, 2.5, 1e-12]  # the last one's log-ratio -27.6 is clamped to -20
    adv = [2.0, 1.0, 1.0, -1.0, -0.5, 1.0]
    old = torch.full((1, 6), -1.0, dtype=f64)
    logp = (old + t([[math.log(r) for r in ratios]])).requires_grad_()
    out = sapo(logp, old, t([adv]), torch.ones(1, 6, dtype=f64))
    cfg = AlgorithmConfig()
    expected, grad = [], []
    for r, a in zip(ratios, adv):
        inside = abs(math.log(r)) <= 20.0  # the clamp passes no gradient
        r = math.exp(min(max(math.log(r), -20.0), 20.0))
        tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        expected.append(-s * 4 / tau * a)
        grad.append(-a * r * 4 * s * (1 - s) if inside else 0.0)
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg) == (1.0, 1.05)
    assert close(out.per_token, [expected])
    out.per_token.sum().backward()
    assert close(logp.grad, [grad]) and close(grad[0], -2.0)
    assert not out.clipped.any() and not out.dual_clipped.any()


@pytest.mark.parametrize("clip_low, clip_high, absolute, ratios, clamped", [
    (0.2, 0.28, False, [1.0, 1.14, 1.56, 0.4], [1.0, 1.14, 1.28, 0.8]),  # slime "ppo_band"
    (0.0, 5.0, True, [1.0, 3.0, 9.0, 0.4], [1.0, 3.0, 5.0, 0.4]),  # slime "wide_minimax_band", eps (1.0, 4.0)
    (0.9, 1.1, True, [1.0, 1.05, 1.5, 0.4], [1.0, 1.05, 1.1, 0.9]),  # Tinker-style absolute thresholds
])
def test_cispo_matches_slime_test_vectors(clip_low, clip_high, absolute, ratios, clamped):
    """slime ``tests/test_cispo_loss.py`` (``CLIP_CASES``, ``ADVANTAGES``, ``LOG_PROBS``) for
    ``compute_cispo_loss`` in ``slime/utils/ppo_utils.py``: ``-sg(clip(r, 1 - eps, 1 + eps_high)) * A * logp``,
    gradient ``-clamped * A``. Its wide band (eps 1.0: lower bound 0) is the absolute bounds [0, 5]; the
    relative ones keep ``clip_low < 1``. Absolute thresholds as pan-x-c/TuFT ``src/tuft/loss_fn/cispo.py``."""
    adv, log_probs = [1.0, -0.5, 2.0, -1.0], [-0.7, -1.2, -0.4, -2.1]
    logp = t([log_probs]).requires_grad_()
    old = logp.detach() - t([[math.log(r) for r in ratios]])
    out = cispo(logp, old, t([adv]), torch.ones(1, 4, dtype=f64), clip_low=clip_low, clip_high=clip_high,
                absolute=absolute)
    assert close(out.per_token, [[-c * a * lp for c, a, lp in zip(clamped, adv, log_probs)]], tol=1e-6)
    assert out.clipped.tolist() == [[c != r for c, r in zip(clamped, ratios)]]
    assert out.clipped_low.tolist() == [[r < c for c, r in zip(clamped, ratios)]]
    out.per_token.sum().backward()
    assert close(logp.grad, [[-c * a for c, a in zip(clamped, adv)]], tol=1e-6)


def test_ppo_dual_clip_matches_slime_test_vector():
    """slime ``tests/test_policy_loss.py``: ratios [2, 2, 0.5], A [2, -2, 2], eps 0.2 / 0.2, ``eps_clip_c``
    1.5 give losses [-2.4, 3.0, -1.0] (``compute_policy_loss``, ``slime/utils/ppo_utils.py``)."""
    ratios = [2.0, 2.0, 0.5]
    old = torch.full((1, 3), -1.0, dtype=f64)
    logp = old + t([[math.log(r) for r in ratios]])
    out = ppo(logp, old, t([[2.0, -2.0, 2.0]]), torch.ones(1, 3, dtype=f64), 0.2, 0.2, dual_clip=1.5)
    assert close(out.per_token, [[-2.4, 3.0, -1.0]])


# 7. seq_mean_token_sum_norm -----------------------------------------------------------------------------

def test_seq_mean_token_sum_norm_is_verls_constant_over_the_global_batch():
    """verl ``core_algos.py`` ``agg_loss`` ``seq-mean-token-sum-norm``: per micro-batch
    ``sum(sum_t L m) / loss_scale_factor`` (default ``loss_mask.shape[-1]``, the padded response length),
    averaged over micro-batches (``verl/workers/actor/dp_actor.py``: ``loss_scale_factor = 1 /
    gradient_accumulation``). For equal micro-batches of b sequences that is b times megarl's
    ``sum L m / (B * C)``; megarl's denominator B * C counts every row and does not move with rejection."""
    per_token = [[1.0, 2.0, 3.0, 0.5], [4.0, -1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-3.0, 1.0, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    C, b = 4, 2
    verl_micro = [sum(sum(v * m for v, m in zip(per_token[i], mask[i])) for i in rows) / C
                  for rows in ([0, 1], [2, 3])]
    verl_loss = sum(verl_micro) / len(verl_micro)
    num, den = aggregation_fn("seq_mean_token_sum_norm", C)(t(per_token), t(mask))
    assert close(den, 4 * C) and close(verl_loss, b * num / den)
    rejected = [row[:] for row in mask]
    rejected[1] = [0, 0, 0, 0]
    _, den_after = aggregation_fn("seq_mean_token_sum_norm", C)(t(per_token), t(rejected))
    assert close(den_after, den)
    _, den_default = aggregation_fn("seq_mean_token_sum_norm")(t(per_token), t(mask))
    assert close(den_default, 4 * 4)  # C defaults to the padded length, as verl's loss_mask.shape[-1]


# 8. Clip metrics -----------------------------------------------------------------------------------------

def test_clip_fractions_as_verl_counts_them():
    """verl ``core_algos.py`` ``compute_policy_loss_vanilla``: ``pg_clipfrac = mean(gt(pg_losses2,
    pg_losses1))`` (the PPO clip, whatever the dual clip does) and ``pg_clipfrac_lower = mean(gt(
    clip_pg_losses1, pg_losses3) * (A < 0))`` (the dual clip), over the response mask; megarl splits the
    first by ``r < 1`` / ``r > 1`` and reports the second as ``dual_clip_fraction``."""
    ratios = [1.5, 0.5, 0.5, 1.0, 5.0, 2.0, 0.7, 9.0]
    adv = [1.0, 1.0, -1.0, 2.0, -1.0, -1.0, -1.0, -1.0]
    mask = [1, 1, 1, 1, 1, 1, 1, 0]
    eps_low, eps_high, c = 0.2, 0.28, 3.0
    clip = low = high = dual = 0
    for r, a, m in zip(ratios, adv, mask):
        l1, l2 = -a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)
        clipped = l2 > l1
        clip += m * clipped
        low += m * (clipped and r < 1)
        high += m * (clipped and r > 1)
        dual += m * (max(l1, l2) > -a * c and a < 0)
    old = torch.full((1, 8), -1.0, dtype=f64)
    batch = LossInputs(logprobs=old + t([[math.log(r) for r in ratios]]), old_logprobs=old, advantages=t([adv]),
                       loss_mask=t([mask]))
    out = rl_loss(batch, AlgorithmConfig(clip_low=eps_low, clip_high=eps_high, dual_clip=c))
    assert (clip, low, high, dual) == (3, 2, 1, 1)
    assert [out.sums[k].item() for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
                                         "dual_clip_fraction")] == [clip, low, high, dual]
    assert close(out.trained_tokens, sum(mask))


# 9. Groups of one ----------------------------------------------------------------------------------------

def test_a_group_of_one_keeps_its_raw_score_as_in_verl():
    """verl ``core_algos.py``: ``compute_grpo_outcome_advantage`` sets mean 0, std 1 for a group of one
    (``(score - 0) / (1 + epsilon)``); ``compute_rloo_outcome_advantage`` leaves a lone score as it is; the
    Dr.GRPO form (``norm_adv_by_std_in_grpo=False``) gives ``score - 0``. Larger groups are unchanged."""
    scores = [0.7, 1.0, 0.0, -2.5]
    index = ["solo", "pair", "pair", "other"]
    groups = group_index(index)
    eps = 1e-6
    std = 0.5 ** 0.5  # unbiased std of [1, 0]
    expected = [0.7 / (1 + eps), 0.5 / (std + eps), -0.5 / (std + eps), -2.5 / (1 + eps)]
    assert close(grpo(t(scores), groups, eps), expected)
    assert close(dr_grpo(t(scores), groups), [0.7, 0.5, -0.5, -2.5])
    assert close(rloo(t(scores), groups), [0.7, 1.0, -1.0, -2.5])
    counts = torch.ones(4, dtype=f64)
    assert close(reinforce_pp(t(scores), groups, token_counts=counts), ref_rf_baseline(scores, index, [[1]] * 4))


def test_equal_rewards_in_a_group_give_zero():
    """verl GRPO: a group with std 0 gets ``0 / (0 + epsilon) = 0``."""
    assert close(grpo(t([1.0, 1.0, 1.0]), group_index(["g"] * 3)), [0.0, 0.0, 0.0])


def test_loss_config_defaults_are_the_peers():
    """The defaults that carry a peer's name: verl ``actor.yaml`` ``tau_pos: 1.0``, ``tau_neg: 1.05``;
    verl ``rollout_correction.yaml`` ``rollout_is_threshold: 2.0``; slime ``--tis-clip 2.0``; verl's
    ``seq-mean-token-sum-norm`` constant, the response length: ``rollout.max_new_tokens`` at load."""
    from megarl.config import load_config

    cfg = AlgorithmConfig()
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg, cfg.is_threshold) == (1.0, 1.05, 2.0)
    loaded = load_config(["recipe=tiny_moe_cpu", "rollout.max_new_tokens=7"])
    assert loaded.algorithm.loss_scale_factor == 7
