"""A step's loss metrics as the trainer reduces them (sums added, maxima reduced over micro-batches and ranks) and
logs them: every name reaches ``metrics.jsonl`` and TensorBoard under the name docs/configuration.md lists."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from megarl.algos.aggregation import prompt_mean_weights
from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.score_centering import Centering
from megarl.algos.settings import AlgorithmConfig
from megarl.metrics.sink import MetricsFile, read_metrics
from megarl.trainer.rl_step import step_max_keys, step_metrics, step_sum_keys

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
f64 = torch.float64


def part(seed: int, cfg: AlgorithmConfig, groups: list[int]) -> tuple[dict, dict]:
    """One micro-batch's sums and maxima, as ``_micro_batch_loss`` stacks them."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (len(groups), 1), generator=gen)).to(f64)
    old = -torch.rand(len(groups), 5, generator=gen, dtype=f64) * 2 - 0.1
    logp = (old + torch.randn(len(groups), 5, generator=gen, dtype=f64) * 0.3).requires_grad_()
    rollout = old + torch.randn(len(groups), 5, generator=gen, dtype=f64)
    term = torch.zeros_like(old)
    centred = Centering(term, torch.rand(old.shape, generator=gen, dtype=f64) * mask, torch.full_like(old, 0.9))
    out = rl_loss(LossInputs(logp, old, torch.randn(len(groups), generator=gen, dtype=f64), mask,
                             entropy=torch.rand_like(old), rollout_logprobs=rollout, centering=centred,
                             row_weights=prompt_mean_weights(torch.tensor(groups), mask.sum(1))), cfg)
    parts = {**out.sums, "loss_sum": out.loss_sum.detach(), "denominator": out.denominator_share,
             "trained_tokens": out.trained_tokens, "trained_sequences": out.trained_sequences,
             "entropy_tokens": torch.tensor(1.0, dtype=f64)}
    return {k: parts[k].item() for k in step_sum_keys(cfg)}, {k: out.maxima[k].item() for k in step_max_keys(cfg)}


def test_new_metrics_reach_metrics_jsonl_and_tensorboard_under_the_documented_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = AlgorithmConfig(policy_loss="cispo", score_centering="tail", loss_agg="prompt_mean")
    parts = [part(0, cfg, [0, 0, 1]), part(1, cfg, [2, 2])]
    totals = {k: sum(p[0][k] for p in parts) for k in parts[0][0]}
    maxima = {k: max(p[1][k] for p in parts) for k in parts[0][1]}
    found = step_metrics(totals, maxima)
    row = {k if "/" in k else f"train/{k}": v for k, v in found.items()}  # StepBooks.record's names
    new = {"off_policy/rollout_is_mean", "off_policy/rollout_is_max", "off_policy/rollout_is_min",
           "off_policy/rollout_is_std", "off_policy/rollout_is_ratio_fraction_high",
           "off_policy/rollout_is_ratio_fraction_low", "off_policy/training_ppl", "off_policy/rollout_ppl",
           "off_policy/log_ppl_diff", "off_policy/log_ppl_diff_max", "off_policy/log_ppl_diff_min",
           "cispo/ratio_mean", "cispo/ratio_clamped_mean", "cispo/ratio_max", "cispo/ratio_min",
           "score_centering/support_tv", "score_centering/head_mass", "train/cov_fraction"}
    assert new <= set(row) and all(math.isfinite(v) for v in row.values())
    assert row["cispo/ratio_min"] <= row["cispo/ratio_mean"] <= row["cispo/ratio_max"]
    assert row["off_policy/log_ppl_diff_min"] <= row["off_policy/log_ppl_diff"] <= row["off_policy/log_ppl_diff_max"]
    assert row["score_centering/head_mass"] == pytest.approx(0.9)
    documented = set(re.findall(r"``([\w/]+)``", (ROOT / "docs" / "configuration.md").read_text()))
    assert set(row) - {"train/entropy_tokens"} <= documented | {"train/entropy"}, set(row) - documented
    sink = MetricsFile(tmp_path)
    sink.log(7, row)
    sink.close()
    assert {k: v for k, v in read_metrics(tmp_path)[0].items() if k in new} == pytest.approx({k: row[k] for k in new})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert new <= set(events.Tags()["scalars"])
    assert events.Scalars("cispo/ratio_max")[0].value == pytest.approx(row["cispo/ratio_max"], rel=1e-6)
