"""Off-policy rejection, importance-weight diagnostics, GAE and the value loss against the peers.

The vectors are the peers' own tests, cited per case: verl ``tests/trainer/ppo/test_rollout_corr.py``
(github.com/volcengine/verl) and SkyRL ``tests/train/algorithms/test_off_policy_correction.py``
(github.com/NovaSky-AI/SkyRL). Where a peer's test only checks that a result exists, the expected
values come from a transcription of the peer's formula in plain Python over floats (never megarl's
code): verl ``verl/trainer/ppo/rollout_corr_helper.py`` and ``verl/trainer/ppo/core_algos.py``.
"""
from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.gae import gae
from megarl.algos.is_diagnostics import diagnostic_sums, diagnostics
from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.off_policy import CorrectionSpec, correction
from megarl.algos.policy_loss import ppo
from megarl.algos.rejection import CRITERIA, parse_criteria, rejection_keep
from megarl.algos.settings import AlgorithmConfig
from megarl.algos.value_loss import clipped_value_loss

pytestmark = pytest.mark.unit

f64 = torch.float64


def t(rows, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def reject(old, rollout, mask, names: str, thresholds) -> torch.Tensor:
    """Rejection without reweighting (verl ``rollout_is=None``): the keep mask, as float."""
    spec = CorrectionSpec("none", "token", 2.0, rejection=parse_criteria(names, thresholds))
    out = correction(old, rollout, mask, spec)
    assert torch.equal(out.weights, (mask > 0).to(old.dtype))  # no weight
    return out.keep.to(old.dtype)


# --- verl's rejection criteria: a transcription of compute_rollout_rejection_mask ------------------------

def ref_verl_keep(log_ratio: list[list[float]], mask: list[list[int]], option: str, spec: str) -> list[list[int]]:
    """verl: ``l`` clamped to +-20; ``k1 = -l``, ``k2 = l^2/2``, ``k3 = exp(l) - 1 - l``; token / sequence sum /
    masked mean (``+ 1e-8``) / masked max; k1 kept in ``[log lower, log upper]`` (``lower`` from ``lower_upper``,
    else ``1 / upper``), k2 and k3 kept ``<= upper``; the keep flag times the response mask."""
    est = option[-2:]
    if est == "k1":
        lo, up = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
        lo, up = math.log(lo), math.log(up)
    else:
        lo, up = None, float(spec)
    out = []
    for row, m in zip(log_ratio, mask):
        ks = []
        for x in row:
            x = min(max(x, -20.0), 20.0)
            ks.append({"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[est])
        if option.startswith("token"):
            stats = ks
        else:
            valid = [k for k, v in zip(ks, m) if v]
            seq = {"sum": sum(valid), "mean": sum(valid) / (len(valid) + 1e-8),
                   "max": max(valid) if valid else 0.0}[option.split("_")[1]]
            stats = [seq] * len(row)
        out.append([int(v and (s <= up if lo is None else lo <= s <= up)) for s, v in zip(stats, m)])
    return out


VERL_OPTIONS = [  # test_each_supported_rollout_rs_option's parameters
    ("token_k1", "0.5_1.5"), ("token_k2", 2.0), ("token_k3", 2.0), ("seq_sum_k1", "0.6_1.4"), ("seq_sum_k2", 2.5),
    ("seq_sum_k3", 2.5), ("seq_mean_k1", "0.5_1.5"), ("seq_mean_k2", 2.0), ("seq_mean_k3", 2.0),
    ("seq_max_k2", 2.0), ("seq_max_k3", 2.0),
]


def test_the_criteria_are_verls():
    assert sorted(CRITERIA) == sorted(name for name, _ in VERL_OPTIONS)


@pytest.mark.parametrize("option, threshold", VERL_OPTIONS)
def test_each_verl_criterion_keeps_what_verl_keeps(option, threshold):
    """verl ``test_each_supported_rollout_rs_option``: 3 x 7, rollout = old + 0.15 noise (here spread wider
    and ragged so that every criterion rejects something and keeps something somewhere)."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(6, 7, generator=gen, dtype=f64)
    rollout = old + torch.randn(6, 7, generator=gen, dtype=f64) * torch.tensor([0.05, 0.15, 0.4, 0.8, 1.5, 3.0],
                                                                               dtype=f64)[:, None]
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 5, 7, 3, 6, 7])[:, None]).to(f64)
    keep = reject(old, rollout, mask, option, threshold)
    expected = ref_verl_keep((old - rollout).tolist(), mask.int().tolist(), option, str(threshold))
    assert keep.tolist() == expected
    assert 0 < keep.sum() < mask.sum(), "a case that cannot tell keep from reject"


def test_verl_chained_criteria_must_all_pass():
    """verl ``test_rollout_rs_multiple_options``: ``token_k1,seq_max_k3`` with ``0.4_1.8,3.0``, 2 x 6,
    rollout = old + 0.2 noise (here wider): a token stays where both keep it."""
    gen = torch.Generator().manual_seed(5)
    old = torch.randn(4, 6, generator=gen, dtype=f64)
    rollout = old + torch.randn(4, 6, generator=gen, dtype=f64) * 0.9
    mask = torch.ones(4, 6, dtype=f64)
    keep = reject(old, rollout, mask, "token_k1,seq_max_k3", "0.4_1.8,3.0")
    lr, m = (old - rollout).tolist(), mask.int().tolist()
    a, b = ref_verl_keep(lr, m, "token_k1", "0.4_1.8"), ref_verl_keep(lr, m, "seq_max_k3", "3.0")
    assert keep.tolist() == [[x * y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
    assert keep.tolist() != a and keep.tolist() != b  # each criterion rejects something the other keeps


def test_verl_mask_mode_truncates_and_rejects_apart():
    """verl ``test_mask_mode``: old -2; rollout -1 (ratio e^-1 ~ 0.37) and -2.5 (e^0.5 ~ 1.65), 2 x 5;
    ``rollout_is=token`` (threshold 2) with ``rollout_rs=token_k1`` (``0.5_2.0``): the weights stay the
    truncated ratios (0.37 not zeroed), the first sequence is rejected through the mask, half the tokens."""
    old = t([[-2.0] * 5, [-2.0] * 5])
    rollout = t([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    spec = CorrectionSpec("tis", "token", 2.0, rejection=parse_criteria("token_k1", "0.5_2.0"))
    out = correction(old, rollout, mask, spec)
    assert torch.allclose(out.weights[0], torch.full((5,), math.exp(-1.0)))
    assert torch.allclose(out.weights[1], torch.full((5,), math.exp(0.5)))
    assert out.keep.tolist() == [[False] * 5, [True] * 5]
    assert 1 - out.keep.float().mean().item() == pytest.approx(0.5)


def test_verl_basic_truncation_and_rejection_without_weights():
    """verl ``test_basic_rollout_correction``: 4 x 10, rollout = old + 0.1 noise; token truncation at 2
    caps the weights; a sequence weight is one value per sequence; ``seq_mean_k1`` (``0.5_1.5``) without
    IS weights leaves the weights 1."""
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 10, generator=gen)
    rollout = old + torch.randn(4, 10, generator=gen) * 0.1
    mask = torch.ones(4, 10)
    assert correction(old, rollout, mask, CorrectionSpec("tis", "token", 2.0)).weights.max() <= 2.0
    seq = correction(old, rollout, mask, CorrectionSpec("tis", "sequence", 5.0)).weights
    assert torch.equal(seq, seq[:, :1].expand_as(seq))
    assert torch.allclose(seq[:, 0], (old - rollout).sum(1).exp().clamp(max=5.0))
    keep = reject(old, rollout, mask, "seq_mean_k1", "0.5_1.5")
    assert keep.tolist() == ref_verl_keep((old - rollout).tolist(), mask.int().tolist(), "seq_mean_k1", "0.5_1.5")


def test_truncation_at_one_level_and_rejection_at_another():
    """SkyRL ``test_compute_off_policy_correction_both_enabled``: token ratios e^0.1 ~ 1.105, token TIS at 2
    and a geometric-mean mask [0.8, 1.2]: weight 1.105, kept. The same sequence with a geometric mean e^0.5
    is rejected whole while its weights stay the token-level truncated ones."""
    old = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = t([[-1.1, -1.1, -1.1], [-1.5, -1.5, -1.5]])
    mask = torch.ones(2, 3)
    geometric = parse_criteria("seq_mean_k1", f"{1 / 1.2}_{1 / 0.8}")  # verl bounds rollout/train: SkyRL's inverted
    out = correction(old, rollout, mask, CorrectionSpec("tis", "token", 2.0, rejection=geometric))
    assert torch.allclose(out.weights, t([[math.exp(0.1)] * 3, [math.exp(0.5)] * 3]))
    assert out.keep.tolist() == [[True] * 3, [False] * 3]


# --- SkyRL's vectors ----------------------------------------------------------------------------------------

def test_skyrl_token_tis():
    """SkyRL ``test_compute_tis_ratio_token_level`` / ``_sequence_level`` / ``_with_cap`` / ``_with_mask``."""
    old, rollout = t([[-1.0, -1.5, -0.5]]), t([[-1.5, -1.0, -1.5]])
    ones = torch.ones(1, 3)
    token = correction(old, rollout, ones, CorrectionSpec("tis", "token", 2.0)).weights
    assert torch.allclose(token, t([[1.6487, 0.6065, 2.0]]), atol=1e-4)
    sequence = correction(old, rollout, ones, CorrectionSpec("tis", "sequence", 5.0)).weights
    assert torch.allclose(sequence, t([[2.7183] * 3]), atol=1e-4)
    capped = correction(t([[-1.0] * 3]), t([[-2.0] * 3]), ones, CorrectionSpec("tis", "sequence", 5.0)).weights
    assert torch.allclose(capped, t([[5.0] * 3]))
    masked = correction(old, rollout, t([[1.0, 0.0, 1.0]]), CorrectionSpec("tis", "sequence", 10.0)).weights
    assert torch.allclose(masked, t([[math.exp(1.5), 0.0, math.exp(1.5)]]))


@pytest.mark.parametrize("old, rollout, mask, low, high, kept", [
    # test_compute_outlier_token_mask_masks_by_token_bounds: ratio 148.4 > 100
    ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -6.0]], [[1.0, 1.0, 1.0]], 1e-4, 100.0, False),
    # ..._accepts_in_bounds: ratios 1.65, 0.61, 1.0
    ([[-1.0, -1.5, -1.0]], [[-1.5, -1.0, -1.0]], [[1.0, 1.0, 1.0]], 1e-4, 100.0, True),
    # ..._respects_loss_mask: the outlier is not trained
    ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -6.0]], [[1.0, 1.0, 0.0]], 1e-4, 100.0, True),
    # ..._null_thresholds
    ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -6.0]], [[1.0, 1.0, 1.0]], None, None, True),
    # ..._only_high_threshold
    ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -6.0]], [[1.0, 1.0, 1.0]], None, 100.0, False),
    # ..._only_low_threshold: ratio e^-10 ~ 4.5e-5 < 1e-4
    ([[-1.0, -1.0, -11.0]], [[-1.0, -1.0, -1.0]], [[1.0, 1.0, 1.0]], 1e-4, None, False),
])
def test_skyrl_outlier_bounds_reject_whole_sequences(old, rollout, mask, low, high, kept):
    spec = CorrectionSpec("none", "token", 2.0, veto_threshold=low, veto_threshold_high=high)
    out = correction(t(old), t(rollout), t(mask), spec)
    assert out.keep.tolist() == [[kept and bool(m) for m in mask[0]]]


@pytest.mark.parametrize("old, rollout, mask, kept", [
    # test_compute_token_mask_all_in_bounds
    ([[-1.0, -1.1, -1.0]], [[-1.1, -1.0, -1.0]], [[1.0, 1.0, 1.0]], [[1, 1, 1]]),
    # ..._masks_high_ratio_tokens (7.389 > 2), ..._masks_low_ratio_tokens (0.135 < 0.5)
    ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -3.0]], [[1.0, 1.0, 1.0]], [[1, 1, 0]]),
    ([[-1.0, -1.0, -3.0]], [[-1.0, -1.0, -1.0]], [[1.0, 1.0, 1.0]], [[1, 1, 0]]),
    # ..._ignores_already_masked_tokens (rejection says nothing of untrained tokens: both 0 here)
    ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -6.0]], [[1.0, 1.0, 0.0]], [[1, 1, 0]]),
    # ..._multi_sequence_batch
    ([[-1.0, -1.0], [-3.0, -1.0]], [[-1.0, -3.0], [-1.0, -1.0]], [[1.0, 1.0], [1.0, 1.0]], [[1, 0], [0, 1]]),
    # ..._boundary_values: ratios exactly 0.5 and 2.0 are kept
    ([[0.0, 0.0]], [[math.log(2.0), -math.log(2.0)]], [[1.0, 1.0]], [[1, 1]]),
])
def test_skyrl_token_mask_is_token_k1_rejection(old, rollout, mask, kept):
    """SkyRL's per-token mask ``[0.5, 2.0]`` of the ratio is verl's ``token_k1`` with ``0.5_2.0`` (symmetric
    bounds: verl's are on the inverse ratio) and no weight (SkyRL ``tis_ratio_type=None``)."""
    assert reject(t(old), t(rollout), t(mask), "token_k1", "0.5_2.0").tolist() == kept


@pytest.mark.parametrize("level, old, rollout, low, high, kept", [
    # test_compute_sequence_mask_geometric: geometric mean 1.0 in [0.9, 1.1]
    ("geometric", [[-1.0, -1.1, -1.0]], [[-1.1, -1.0, -1.0]], 0.9, 1.1, True),
    # ..._geometric_rejects: e^0.5 ~ 1.65; ..._sequence_mask_zeros_loss: e^1
    ("geometric", [[-1.0, -1.0, -1.0]], [[-1.5, -1.5, -1.5]], 0.9, 1.1, False),
    ("geometric", [[-1.0, -1.0, -1.0]], [[-2.0, -2.0, -2.0]], 0.9, 1.1, False),
    # ..._product: e^0.3 ~ 1.35 in [0.5, 2]; ..._product_rejects_by_seq_ratio: e^3 ~ 20.1
    ("sequence", [[-1.0, -1.1, -1.2]], [[-1.2, -1.2, -1.2]], 0.5, 2.0, True),
    ("sequence", [[-1.0, -1.0, -1.0]], [[-2.0, -2.0, -2.0]], 0.5, 2.0, False),
])
def test_skyrl_sequence_masks(level, old, rollout, low, high, kept):
    """SkyRL's ``sequence_mask_metric`` geometric / product with ``[low, high]`` is ``mis`` at the geometric /
    sequence level, and verl's ``seq_mean_k1`` / ``seq_sum_k1`` with the inverse bounds, without a weight."""
    mis = correction(t(old), t(rollout), torch.ones(1, 3), CorrectionSpec("mis", level, high, threshold_low=low))
    assert mis.keep.tolist() == [[kept] * 3]
    option = "seq_mean_k1" if level == "geometric" else "seq_sum_k1"
    assert reject(t(old, f64), t(rollout, f64), torch.ones(1, 3, dtype=f64), option,
                  f"{1 / high}_{1 / low}").tolist() == [[float(kept)] * 3]


def test_mis_keeps_the_raw_weight_and_rejection_alone_keeps_none():
    """``mis`` (slime's mask mode) weighs a kept token by w; the same band as a rejection criterion weighs by 1."""
    old, rollout, mask = t([[-1.0, -1.0]]), t([[-1.3, -3.0]]), torch.ones(1, 2)
    mis = correction(old, rollout, mask, CorrectionSpec("mis", "token", 2.0))
    assert torch.allclose(mis.weights, t([[math.exp(0.3), math.exp(2.0)]])) and mis.keep.tolist() == [[True, False]]
    assert reject(old, rollout, mask, "token_k1", "0.5_2.0").tolist() == [[1.0, 0.0]]


def test_bad_criteria_and_thresholds_are_refused():
    with pytest.raises(ValueError, match="unknown rejection criterion seq_max_k1"):
        parse_criteria("token_k1,seq_max_k1", "2")
    with pytest.raises(ValueError, match="need a threshold"):
        parse_criteria("token_k2", None)
    with pytest.raises(ValueError, match="3 thresholds for 2 rejection criteria"):
        parse_criteria("token_k1,token_k2", "2,3,4")
    with pytest.raises(ValueError, match="needs 0 < lower <= upper"):
        parse_criteria("token_k1", "2_0.5")
    with pytest.raises(ValueError, match="must be one number"):
        parse_criteria("seq_max_k3", "0.5_2")
    with pytest.raises(ValueError, match="must both be"):
        rejection_keep(torch.zeros(2, 3), torch.ones(2, 2), parse_criteria("token_k2", "1"))


# --- verl's off-policy diagnostics: a transcription of compute_offpolicy_metrics and compute_is_metrics ---

def ref_verl_diagnostics(old: list[list[float]], rollout: list[list[float]], threshold: float) -> dict[str, float]:
    """Every row fully trained, as in verl's tests. ``compute_is_metrics`` at the token level: ``rho`` =
    exp(clamp(l, -20, 20)); ``rollout_is_mean`` its mean, ``_max`` / ``_min`` its extremes, ``_std``
    sqrt(max(mean(w^2) - mean(w)^2, 0)) of ``w`` = rho clamped to [1/C, C], ``_ratio_fraction_high`` /
    ``_low`` the shares of rho > C / rho < 1/C; ESS ``1 / mean((w / mean w)^2)``. ``compute_offpolicy_metrics``:
    ``kl`` mean(rollout - old); ``k3_kl`` mean(exp(l) - l - 1); ``training_ppl`` / ``rollout_ppl`` the mean
    over rows of exp(-mean(old)) / exp(-mean(rollout)); ``log_ppl_diff`` the mean over rows of d = mean(rollout)
    - mean(old), ``_max`` / ``_min`` its extremes, ``log_ppl_abs_diff`` mean |d|, ``ppl_ratio`` mean exp(d);
    ``chi2_token`` mean(exp(clamp(l))^2) - 1; ``chi2_seq`` mean over rows exp(2 clamp(sum l)) - 1."""
    ls = [[a - b for a, b in zip(ro, rr)] for ro, rr in zip(old, rollout)]
    flat = [x for row in ls for x in row]
    n = len(flat)
    clamp = lambda x: min(max(x, -20.0), 20.0)  # noqa: E731
    rho = [math.exp(clamp(x)) for x in flat]
    w = [min(max(r, 1 / threshold), threshold) for r in rho]
    mean_w = sum(w) / n
    ess = 1 / (sum((v / (mean_w + 1e-8)) ** 2 for v in w) / n)
    diffs = [sum(rr) / len(rr) - sum(ro) / len(ro) for ro, rr in zip(old, rollout)]
    return {"ess": ess, "kl": -sum(flat) / n, "k3_kl": sum(math.exp(x) - x - 1 for x in flat) / n,
            "rollout_is_mean": sum(rho) / n, "rollout_is_max": max(rho), "rollout_is_min": min(rho),
            "rollout_is_std": math.sqrt(max(sum(v * v for v in w) / n - mean_w ** 2, 0.0)) if n > 1 else 0.0,
            "rollout_is_ratio_fraction_high": sum(r > threshold for r in rho) / n,
            "rollout_is_ratio_fraction_low": sum(r < 1 / threshold for r in rho) / n,
            "training_ppl": sum(math.exp(-sum(ro) / len(ro)) for ro in old) / len(old),
            "rollout_ppl": sum(math.exp(-sum(rr) / len(rr)) for rr in rollout) / len(rollout),
            "log_ppl_diff": sum(diffs) / len(diffs), "log_ppl_diff_max": max(diffs), "log_ppl_diff_min": min(diffs),
            "ppl_ratio": sum(math.exp(d) for d in diffs) / len(diffs),
            "log_ppl_abs_diff": sum(abs(d) for d in diffs) / len(diffs),
            "chi2_token": sum(math.exp(clamp(x)) ** 2 for x in flat) / n - 1,
            "chi2_seq": sum(math.exp(2 * clamp(sum(row))) for row in ls) / len(ls) - 1}


def _combined(parts: list) -> tuple[dict[str, float], dict[str, float]]:
    """The sums added and the maxima reduced over the parts' :func:`diagnostic_sums`."""
    sums = {k: sum(p[0][k].item() for p in parts) for k in parts[0][0]}
    return sums, {k: max(p[1][k].item() for p in parts) for k in parts[0][1]}


def test_diagnostics_are_verls_and_add_up_over_parts():
    """verl ``test_offpolicy_metrics``'s batch (4 x 12, old = N - 2, rollout = N - 1.5) and
    ``test_metrics_completeness``' threshold 2.5: the metrics of verl's formulas; summed (maxima: reduced) over
    two halves of the batch (two micro-batches, or DP ranks) they are those of the whole."""
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, 12, generator=gen, dtype=f64) - 2.0
    rollout = torch.randn(4, 12, generator=gen, dtype=f64) - 1.5
    mask = torch.ones(4, 12, dtype=f64)
    expected = ref_verl_diagnostics(old.tolist(), rollout.tolist(), 2.5)
    whole = diagnostics(*_combined([diagnostic_sums(old, rollout, mask, 2.5)]), 48, 4)
    halves = diagnostics(*_combined([diagnostic_sums(old[i:i + 2], rollout[i:i + 2], mask[i:i + 2], 2.5)
                                     for i in (0, 2)]), 48, 4)
    assert set(whole) == set(expected)
    for key, value in expected.items():
        assert whole[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert halves[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert 0 < whole["ess"] < 1 and whole["chi2_seq"] > whole["chi2_token"] > 0
    assert whole["rollout_is_ratio_fraction_high"] > 0 and whole["rollout_is_ratio_fraction_low"] > 0
    assert whole["log_ppl_diff_min"] < 0 < whole["log_ppl_diff_max"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diagnostics_are_verls_on_ragged_batches(seed):
    """Ragged rows (each row's trained prefix of a random length, padded with garbage log-probs): verl's
    metrics over the trained tokens alone, split over micro-batches of one row each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (5,), generator=gen).tolist()
    old = torch.randn(5, 9, generator=gen, dtype=f64) * 0.7 - 1.0
    rollout = old + torch.randn(5, 9, generator=gen, dtype=f64) * 0.9
    mask = torch.tensor([[1.0] * n + [0.0] * (9 - n) for n in lengths], dtype=f64)
    expected = ref_verl_diagnostics([r[:n] for r, n in zip(old.tolist(), lengths)],
                                    [r[:n] for r, n in zip((rollout - 60 * (1 - mask)).tolist(), lengths)], 2.0)
    parts = [diagnostic_sums(old[i:i + 1], rollout[i:i + 1] - 60 * (1 - mask[i:i + 1]), mask[i:i + 1], 2.0)
             for i in range(5)]
    found = diagnostics(*_combined(parts), sum(lengths), 5)
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_diagnostics_skip_untrained_tokens():
    old, rollout = t([[-1.0, -1.0, -50.0]], f64), t([[-1.2, -0.9, -1.0]], f64)
    sums, maxima = diagnostic_sums(old, rollout, t([[1.0, 1.0, 0.0]], f64), 2.0)
    expected = ref_verl_diagnostics([[-1.0, -1.0]], [[-1.2, -0.9]], 2.0)
    found = diagnostics({k: v.item() for k, v in sums.items()}, {k: v.item() for k, v in maxima.items()}, 2, 1)
    assert all(found[k] == pytest.approx(v, rel=1e-6) for k, v in expected.items())
    assert diagnostics({k: 0.0 for k in sums}, {k: -math.inf for k in maxima}, 0, 0) == {}


# --- old_policy=rollout: verl's bypass mode -----------------------------------------------------------------

def test_rollout_old_policy_is_the_ppo_ratio_and_rejects_by_the_current_policy():
    """verl ``compute_policy_loss_bypass_mode`` with ``ppo_clip``: the PPO ratio is to the rollout policy, no
    IS weight on top, and the rejection compares the current policy (detached) with the rollout's."""
    logp = t([[-1.0, -0.5, -2.0]], f64).requires_grad_()
    rollout = t([[-1.1, -1.0, -0.2]], f64)
    adv, mask = t([1.0], f64), torch.ones(1, 3, dtype=f64)
    cfg = AlgorithmConfig(old_policy="rollout", off_policy_rejection="token_k1", off_policy_rejection_threshold="0.5_2",
                          is_threshold=2.0)
    # the trainer's step passes the rollout's log-probs as the old policy (rl_step._old_policy): their ratio
    # to themselves is 1, so a rejection that compared them would keep everything
    out = rl_loss(LossInputs(logp, rollout, adv, mask, rollout_logprobs=rollout), cfg)
    keep = t([[1.0, 1.0, 0.0]], f64)  # ratios e^0.1, e^0.5 kept; e^-1.8 < 0.5 rejected
    expected = ppo(logp, rollout, adv, keep).per_token.sum() / 2
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert out.sums["rejected_tokens"].item() == 1 and out.sums["clip_fraction"].item() == 1  # e^0.5 > 1.2
    with pytest.raises(ValueError, match="old_policy=rollout"):
        rl_loss(LossInputs(logp, rollout, adv, mask, rollout_logprobs=rollout),
                AlgorithmConfig(old_policy="rollout", off_policy_correction="tis"))


def test_recompute_old_policy_clips_against_the_pre_step_log_probs():
    """The ratio is to ``old_logprobs``; ``ppo_kl`` is verl's ``actor/ppo_kl``, mean(old - logp)."""
    logp = t([[-1.0, -0.5, -2.0]], f64).requires_grad_()
    old = t([[-1.5, -0.5, -1.0]], f64)
    out = rl_loss(LossInputs(logp, old, t([1.0], f64), torch.ones(1, 3, dtype=f64),
                             rollout_logprobs=old.clone()), AlgorithmConfig())
    assert out.sums["clip_fraction"].item() == 1  # e^0.5 with A > 0 (e^-1 too is outside, but not clipped at A > 0)
    assert out.sums["ppo_kl"].item() == pytest.approx(-0.5 + 0 + 1.0)
    assert out.sums["is_kl"].item() == pytest.approx(0.0)  # the old policy is the rollout's here


# --- GAE and the value loss: verl's compute_gae_advantage_return and compute_value_loss ------------------

def ref_verl_gae(rewards, values, mask, gamma, lam):
    """verl, row by row in floats: from the last position back, ``delta = r_t + gamma * nextvalue - v_t``,
    ``lastgaelam_ = delta + gamma * lam * lastgaelam``; at an unmasked position ``nextvalue`` and ``lastgaelam``
    take ``v_t`` and ``lastgaelam_``, at a masked one they are kept; ``returns = adv + values``; then
    ``masked_whiten(adv)``: masked mean (``/ (N + 1e-8)``), unbiased masked variance, ``rsqrt(var + 1e-8)``."""
    adv_rows = []
    for r, v, m in zip(rewards, values, mask):
        nextvalue, lastgaelam, row = 0.0, 0.0, [0.0] * len(v)
        for i in reversed(range(len(v))):
            delta = r[i] + gamma * nextvalue - v[i]
            candidate = delta + gamma * lam * lastgaelam
            nextvalue = v[i] * m[i] + (1 - m[i]) * nextvalue
            lastgaelam = candidate * m[i] + (1 - m[i]) * lastgaelam
            row[i] = lastgaelam
        adv_rows.append(row)
    returns = [[a + b for a, b in zip(ar, vr)] for ar, vr in zip(adv_rows, values)]
    picked = [a for ar, mr in zip(adv_rows, mask) for a, m in zip(ar, mr) if m]
    n = len(picked)
    mean = sum(picked) / (n + 1e-8)
    var = sum((a - mean) ** 2 for a in picked) / (n + 1e-8) * n / (n - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in ar] for ar in adv_rows], returns


def ragged_batch(seed: int, rows: int = 5, width: int = 9):
    """Rows of random lengths (right padding) with environment tokens (mask 0) inside some of them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(f64)
    mask *= (torch.rand(rows, width, generator=gen) > 0.2).to(f64)
    mask[:, 0] = 1.0
    return (torch.randn(rows, width, generator=gen, dtype=f64), torch.randn(rows, width, generator=gen, dtype=f64),
            mask)


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 1.0), (1, 0.99, 0.95), (2, 0.9, 0.0), (3, 0.5, 0.7)])
def test_gae_is_verls_on_ragged_batches(seed, gamma, lam):
    rewards, values, mask = ragged_batch(seed)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_verl_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    on = mask > 0
    assert torch.allclose(advantages[on], torch.tensor(ref_adv, dtype=f64)[on], atol=1e-6, rtol=0)
    assert torch.allclose(returns[on], torch.tensor(ref_ret, dtype=f64)[on], atol=1e-6, rtol=0)
    assert not advantages[~on].any() and not returns[~on].any()


def test_gae_bad_input():
    rewards, values, mask = ragged_batch(0)
    with pytest.raises(ValueError, match="must all be"):
        gae(rewards[:, :3], values, mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma and lam must be in"):
        gae(rewards, values, mask, 1.5, 1.0)
    with pytest.raises(ValueError, match="needs at least 2"):
        gae(rewards, values, torch.zeros_like(mask), 1.0, 1.0)


def ref_verl_value_loss(vpreds, returns, values, mask, clip):
    """verl: ``vpredclipped = clip(vpreds, values - c, values + c)``, ``max((vpreds - R)^2, (vpredclipped - R)^2)``,
    ``0.5 * agg_loss(token-mean)``; ``vf_clipfrac`` = masked mean of ``(vpredclipped - R)^2 > (vpreds - R)^2``."""
    total, clipped, n = 0.0, 0.0, 0.0
    for vp_row, r_row, v_row, m_row in zip(vpreds, returns, values, mask):
        for vp, r, v, m in zip(vp_row, r_row, v_row, m_row):
            bounded = min(max(vp, v - clip), v + clip)
            a, b = (vp - r) ** 2, (bounded - r) ** 2
            total += m * max(a, b)
            clipped += m * (b > a)
            n += m
    return 0.5 * total / n, clipped / (n + 1e-8)


@pytest.mark.parametrize("seed, clip", [(0, 0.2), (1, 0.5), (2, 0.05)])
def test_value_loss_is_verls_on_ragged_batches(seed, clip):
    returns, old_values, mask = ragged_batch(seed)
    values = (old_values + 0.8 * torch.randn(old_values.shape, generator=torch.Generator().manual_seed(seed + 9),
                                             dtype=f64)).requires_grad_()
    out = clipped_value_loss(values, old_values, returns, mask, clip)
    loss = out.per_token.sum() / mask.sum()
    ref_loss, ref_clipfrac = ref_verl_value_loss(values.tolist(), returns.tolist(), old_values.tolist(),
                                                 mask.tolist(), clip)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-6)
    assert (out.clipped.sum() / mask.sum()).item() == pytest.approx(ref_clipfrac, abs=1e-6)
    assert 0 < out.clipped.sum() < mask.sum()
    loss.backward()  # the clipped term carries no gradient where it is the larger and v is outside the band
    outside = out.clipped & ((values - old_values).abs() > clip)
    assert not values.grad[outside].any() and values.grad[mask > 0].any()


def test_value_loss_bad_input():
    returns, old_values, mask = ragged_batch(0)
    with pytest.raises(ValueError, match="must all be"):
        clipped_value_loss(old_values[:, :2], old_values, returns, mask, 0.2)
    with pytest.raises(ValueError, match="must be > 0"):
        clipped_value_loss(old_values, old_values, returns, mask, 0.0)
