"""The PPO ratio's old policy on the Megatron trainer (``algorithm.old_policy=recompute``).

On the tiny MoE (one process, Keep Routing and Keep Sampling Mask, samples scored by HF transformers):
- a step of four mini-batches at the tiny recipe's optimizer and algorithm: the old policy is the
  trainer's log-probs of the whole batch taken once before the first update; the first mini-batch's
  ratio is 1 (nothing clipped), the later ones' ratios carry the earlier updates and clip, and each
  mini-batch's loss is the recipe's loss (PPO clip times the truncated IS weight, token mean) computed
  here from the log-probs before the step and those of a forward-only pass just before that update.
  The clip range is narrowed to 0.02: one update at the recipe's lr moves the ratios of this small
  batch of random tokens on the random-init model by a few percent, less than the recipe's 0.2;
- a step of one update (lr 0): the recomputed old policy is the current one within 1e-6, so every
  metric equals the step's without the pass (the current log-probs, detached).
"""
import dataclasses

import pytest

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)
UPDATES = 4
PER_UPDATE = 16  # samples per mini-batch
CLIP = 0.02


def _grid(flat, cu):
    from megarl.trainer.packing import to_grid

    return to_grid(flat, cu)


def mini_batch_records(trainable, hf, algo, batching) -> list[dict]:
    """Per mini-batch of one step: its metrics, the log-probs before the step and before its update, and
    what the loss needs (ragged tensors, as lists)."""
    from hf_oracle import make_samples

    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import policy_logprobs, rl_step

    batch = build_rl_batch(make_samples(hf, PER_UPDATE * UPDATES, top_k=5, seed=7))
    batch.old_logprobs = policy_logprobs(trainable.chunks, batch, batching)
    records = []
    for k in range(UPDATES):
        mb = batch.select(range(PER_UPDATE * k, PER_UPDATE * (k + 1)))
        current = policy_logprobs(trainable.chunks, mb, batching)
        result = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, mb, algo, batching)
        records.append({"metrics": result.metrics, "current": current, "old": mb.old_logprobs,
                        "rollout": mb.rollout_logprobs, "mask": mb.loss_mask, "cu": mb.cu_seqlens,
                        "advantages": mb.advantages})
    return records


def one_update_metrics(trainable, hf, algo, batching) -> tuple[dict, dict]:
    """The metrics of one update on a frozen model without and with the recomputed old policy."""
    from hf_oracle import make_samples

    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import policy_logprobs, rl_step

    batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=3))
    plain = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, algo, batching)
    batch.old_logprobs = policy_logprobs(trainable.chunks, batch, batching)
    recomputed = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, algo, batching)
    return plain.metrics, recomputed.metrics


def old_policy_checks(rank, layout, hf_path, settings, algo):
    from hf_oracle import load_hf
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megarl.trainer.model_setup import ModelSettings, build_trainable

    hf = load_hf(hf_path)
    batching = MicroBatching(max_tokens=24, vocab_size=hf.config.vocab_size, keep_routing=True,
                             sequence_parallel=False)
    trainable = build_trainable(hf_path, layout, settings, ModelSettings(transformer_impl="local", routing_replay=True))
    records = mini_batch_records(trainable, hf, algo, batching)
    RouterReplay.clear_global_router_replay_instances()
    frozen = build_trainable(hf_path, layout, dataclasses.replace(settings, lr=0.0),
                             ModelSettings(transformer_impl="local", routing_replay=True))
    return records, one_update_metrics(frozen, hf, algo, batching)


@pytest.fixture(scope="module")
def checks(tiny_checkpoint):
    from megarl.config import load_config
    from megarl.config.components import optimizer_settings

    cfg = load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}",
                       f"trainer.updates_per_step={UPDATES}"])
    assert cfg.algorithm.old_policy == "recompute" and cfg.algorithm.off_policy_correction == "tis"
    settings = optimizer_settings(cfg, updates_per_step=UPDATES)
    return run_ranks(old_policy_checks, Layout(), tiny_checkpoint, settings, _algorithm(cfg))[0]


def _algorithm(cfg):
    """The recipe's algorithm section with the narrowed clip range (module docstring)."""

    return dataclasses.replace(cfg.algorithm, clip_low=CLIP, clip_high=CLIP)


def recipe_loss(record, algo) -> float:
    """The recipe's loss from its formula: token mean over trained tokens of ``w * max(-A r, -A clip(r))`` with
    ``r = exp(logp - logp_old)`` (PPO clip, ``[1 - clip_low, 1 + clip_high]``) and the truncated IS weight
    ``w = min(exp(logp_old - logp_rollout), is_threshold)``, ``logp`` the log-probs just before the update,
    ``logp_old`` those before the step."""
    import torch

    cu = record["cu"]
    logp, old, rollout = (_grid(record[k].double(), cu) for k in ("current", "old", "rollout"))
    mask = _grid(record["mask"].double(), cu) > 0
    adv = record["advantages"].double()[:, None]
    ratio = (logp - old).exp()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high))
    weight = (old - rollout).exp().clamp(max=algo.is_threshold)
    return float((weight * per_token)[mask].sum() / mask.sum())


def test_every_mini_batch_clips_against_the_policy_before_the_step(checks):
    from megarl.config import load_config

    algo = _algorithm(load_config(["recipe=tiny_moe_cpu"]))
    records, _ = checks
    first, *later = records
    assert first["metrics"]["clip_fraction"] == 0.0 and abs(first["metrics"]["ppo_kl"]) < 1e-6
    for k, record in enumerate(later, start=2):
        assert record["metrics"]["clip_fraction"] > 0, (k, record["metrics"])
        assert record["metrics"]["ppo_kl"] != 0.0
    for k, record in enumerate(records, start=1):
        assert record["metrics"]["loss"] == pytest.approx(recipe_loss(record, algo), rel=1e-5, abs=1e-7), k
        # the mismatch is of the policy before the step, the same for every mini-batch's tokens
        assert record["metrics"]["off_policy/kl"] == pytest.approx(
            float(((record["rollout"] - record["old"]) * record["mask"]).sum() / record["mask"].sum()), abs=1e-6)


def test_one_update_recomputes_the_current_policy(checks):
    _, (plain, recomputed) = checks
    assert abs(recomputed["ppo_kl"]) < 1e-6 and recomputed["clip_fraction"] == 0.0
    assert plain.keys() == recomputed.keys()
    for key, value in plain.items():
        assert recomputed[key] == pytest.approx(value, abs=1e-6), key
