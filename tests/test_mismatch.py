"""Fresh-token mismatch and stale-token drift against numbers worked out by hand."""
import pytest
import torch

from megarl.trainer.mismatch import MAXED, SUMMED, mismatch_metrics, mismatch_sums, reduce_mismatch

pytestmark = pytest.mark.unit

# positions:          0     1     2     3     4     5
TRAINER = torch.tensor([-1.0, -0.5, -2.0, -0.1, -3.0, -0.7])
ROLLOUT = torch.tensor([-1.1, -0.5, -1.8, -0.3, -3.0, -0.2])
LOSS_MASK = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # position 4 is not trained
STALENESS = torch.tensor([0, 0, 1, 2, 0, 0], dtype=torch.int32)  # fresh: 0, 1, 5; stale: 2, 3


def _sums(trainer=TRAINER, rollout=ROLLOUT, loss_mask=LOSS_MASK, staleness=STALENESS, outside=0, cu_seqlens=None):
    """Each position a sample of its own unless ``cu_seqlens`` says otherwise."""
    cu = torch.arange(len(trainer) + 1) if cu_seqlens is None else cu_seqlens
    return mismatch_sums(trainer, rollout, loss_mask, staleness, torch.tensor(outside), cu)


def test_sums_and_maxima_by_hand():
    sums = _sums(outside=3)
    assert set(sums) == set(SUMMED + MAXED)
    assert all(v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad for v in sums.values())
    # fresh: trainer - rollout = 0.1, 0, -0.5; x = rollout - trainer = -0.1, 0, 0.5
    assert sums["fresh_tokens"].item() == 3
    assert sums["fresh_abs_diff"].item() == pytest.approx(0.6, abs=1e-6)
    # k3 = e^-x - 1 + x (Schulman's k3 of KL(rollout || trainer) on rollout samples):
    # (1.105170918 - 1.1) + 0 + (0.606530660 - 0.5)
    assert sums["fresh_kl"].item() == pytest.approx(0.005170918 + 0.106530660, abs=1e-6)
    # |e^(trainer - rollout) - 1|: e^0.1 - 1 = 0.105170918, 0, 1 - e^-0.5 = 0.393469340
    assert sums["fresh_ratio_dev_max"].item() == pytest.approx(0.393469340, abs=1e-6)
    # stale: trainer - rollout = -0.2, 0.2; |ratio - 1| = 1 - e^-0.2 = 0.181269247, e^0.2 - 1 = 0.221402758
    assert sums["stale_tokens"].item() == 2
    assert sums["stale_abs_diff"].item() == pytest.approx(0.4, abs=1e-6)
    assert sums["stale_ratio_dev_max"].item() == pytest.approx(0.221402758, abs=1e-6)
    assert sums["outside_mask"].item() == 3
    assert sums["current_abs_diff_max"].item() == pytest.approx(0.5, abs=1e-6)  # no boundary token: the fresh ones

    metrics = mismatch_metrics(reduce_mismatch([sums]))
    assert metrics == pytest.approx({
        "mismatch/current_logprob_abs_diff": 0.2, "mismatch/current_logprob_abs_diff_max": 0.5,
        "mismatch/current_tokens": 0.6,
        "mismatch/logprob_abs_diff": 0.2, "mismatch/kl": (0.005170918 + 0.106530660) / 3,
        "mismatch/ratio_dev_max": 0.393469340, "mismatch/fresh_tokens": 0.6,
        "staleness/logprob_drift": 0.2, "staleness/ratio_dev_max": 0.221402758,
        "mismatch/tokens_outside_mask": 3.0}, abs=1e-6)


def test_micro_batches_reduce_to_the_whole_batch():
    """Sums add and maxima take the max across micro-batches; an empty (padding-only) one adds nothing."""
    parts = [_sums(TRAINER[:3], ROLLOUT[:3], LOSS_MASK[:3], STALENESS[:3], outside=1),
             _sums(TRAINER[3:], ROLLOUT[3:], LOSS_MASK[3:], STALENESS[3:], outside=2),
             _sums(TRAINER[:0], ROLLOUT[:0], LOSS_MASK[:0], STALENESS[:0])]
    assert all(v.item() == 0 for v in parts[2].values())
    whole = reduce_mismatch([_sums(outside=3)])
    assert reduce_mismatch(parts) == pytest.approx(whole, abs=1e-12)


def test_metrics_over_an_empty_token_set_are_left_out():
    fresh_only = mismatch_metrics(reduce_mismatch([_sums(staleness=torch.zeros(6, dtype=torch.int32))]))
    assert fresh_only["mismatch/fresh_tokens"] == 1.0 and not any(k.startswith("staleness/") for k in fresh_only)
    assert fresh_only["mismatch/logprob_abs_diff"] == pytest.approx((0.1 + 0.2 + 0.2 + 0.5) / 5, abs=1e-6)
    stale_only = mismatch_metrics(reduce_mismatch([_sums(staleness=torch.ones(6, dtype=torch.int32))]))
    assert sorted(stale_only) == ["mismatch/fresh_tokens", "mismatch/tokens_outside_mask", "staleness/logprob_drift",
                                  "staleness/ratio_dev_max"]
    assert stale_only["mismatch/fresh_tokens"] == 0.0
    untrained = mismatch_metrics(reduce_mismatch([_sums(loss_mask=torch.zeros(6))]))
    assert untrained == {"mismatch/tokens_outside_mask": 0.0}


def test_kl_of_nearly_equal_float32_log_probs_is_not_rounded_away():
    """k3 ~ x^2 / 2 far below float32 resolution: computed in float64 with expm1."""
    trainer = torch.tensor([-1.0], dtype=torch.float32)
    rollout = trainer + 2.0 ** -20
    sums = _sums(trainer, rollout, torch.ones(1), torch.zeros(1, dtype=torch.int32))
    assert sums["fresh_kl"].item() == pytest.approx(2.0 ** -40 / 2, rel=1e-5)


def test_fresh_tokens_after_older_ones_in_their_sample_are_boundary_tokens():
    """Samples [0, 1, 2, 3] (two tokens of the older version, then two of the trainer's: continued across
    a weight update) and [4, 5] (untrained 4, fresh 5): a token of the trainer's version is fresh only
    when its sample holds no older token."""
    staleness = torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.int32)  # sample 0: two old tokens, then two new
    sums = _sums(staleness=staleness, cu_seqlens=torch.tensor([0, 4, 6]))
    # stale: 0, 1 (|diff| 0.1, 0); boundary: 2, 3 (0.2, 0.2); fresh: 5 (0.5)
    assert (sums["stale_tokens"].item(), sums["boundary_tokens"].item(), sums["fresh_tokens"].item()) == (2, 2, 1)
    assert sums["boundary_abs_diff"].item() == pytest.approx(0.4, abs=1e-6)
    metrics = mismatch_metrics(reduce_mismatch([sums]))
    assert metrics["mismatch/logprob_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    assert metrics["staleness/boundary_logprob_diff"] == pytest.approx(0.2, abs=1e-6)
    assert metrics["staleness/boundary_tokens"] == pytest.approx(2 / 5)
    assert metrics["mismatch/fresh_tokens"] == pytest.approx(1 / 5)
    # current: the fresh and boundary tokens together, sampled by the weights the trainer holds
    assert metrics["mismatch/current_logprob_abs_diff"] == pytest.approx((0.2 + 0.2 + 0.5) / 3, abs=1e-6)
    assert metrics["mismatch/current_logprob_abs_diff_max"] == pytest.approx(0.5, abs=1e-6)
    assert metrics["mismatch/current_tokens"] == pytest.approx(3 / 5)
