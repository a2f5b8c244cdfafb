"""The ``algorithm`` section of the run config: :class:`AlgorithmConfig`, each name checked against the
registries of this package (the run config, :mod:`megarl.config.schema`, nests it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import II

from megarl.algos.advantages import ADVANTAGES, TOKEN_LEVEL
from megarl.algos.aggregation import AGGREGATIONS
from megarl.algos.distill import OPD_BASELINES
from megarl.algos.gae import CRITIC_ADVANTAGES
from megarl.algos.kl import KL_ESTIMATORS
from megarl.algos.kl_control import KL_CONTROLLERS
from megarl.algos.off_policy import CORRECTIONS, LEVELS, OLD_POLICIES
from megarl.algos.policy_loss import DPPO_TYPES, POLICY_LOSSES
from megarl.algos.score_centering import SCORE_CENTERING
from megarl.fields import setting


@dataclass(frozen=True)
class AlgorithmConfig:
    """What each name means, with the peers' (verl, slime, SkyRL, AReaL, prime-rl) formula it follows: the
    docstrings of ``megarl/algos/``. Off-policy correction: ``w`` is the trainer/rollout probability ratio at
    ``off_policy_level``; rejected tokens (mis, off_policy_rejection, the vetoes, off_policy_mask_kl) leave the
    loss. Metrics of the step (``metrics.jsonl`` and TensorBoard, under these names): ``train/loss``,
    ``train/pg_loss``, ``train/kl``, ``train/entropy``, ``train/clip_fraction``, ``train/clip_fraction_low``,
    ``train/clip_fraction_high``, ``train/dual_clip_fraction``, ``train/cov_fraction`` (clip_cov, kl_cov),
    ``train/is_weight_mean``, ``train/rejected_tokens``, ``train/rejected_sequences``, ``train/ppo_kl``; with the
    engine's log-probs, the trainer against the engine (verl's names): ``off_policy/rollout_is_mean``,
    ``off_policy/rollout_is_max``, ``off_policy/rollout_is_min``, ``off_policy/rollout_is_std``,
    ``off_policy/rollout_is_ratio_fraction_high``, ``off_policy/rollout_is_ratio_fraction_low`` (token weights
    against is_threshold), ``off_policy/ess``, ``off_policy/kl``, ``off_policy/k3_kl``, ``off_policy/chi2_token``,
    ``off_policy/chi2_seq``, ``off_policy/training_ppl``, ``off_policy/rollout_ppl``, ``off_policy/log_ppl_diff``
    (signed, per sequence rollout minus trainer mean log-prob), ``off_policy/log_ppl_diff_max``,
    ``off_policy/log_ppl_diff_min``, ``off_policy/log_ppl_abs_diff``, ``off_policy/ppl_ratio``; policy_loss=cispo:
    ``cispo/ratio_mean``, ``cispo/ratio_clamped_mean``, ``cispo/ratio_max``, ``cispo/ratio_min`` (over the tokens
    in the loss); score_centering: ``score_centering/support_tv``, ``score_centering/head_mass``; kl_in_reward:
    ``kl/coef`` (the coefficient the step's rewards took) and ``kl/reward_kl`` (the batch's mean token KL)."""

    # grpo | dr_grpo | rloo | reinforce_pp (REINFORCE++-baseline, whitened over tokens) | maxrl ((r - mean) /
    # (mean + 1e-6), SkyRL) | reinforce_plus_plus (verl's REINFORCE++: token returns discounted by gamma, whitened)
    # | opd (0: the teacher's alone) | gae (PPO with a value model: verl's compute_gae_advantage_return over the
    # critic's values, needs critic.enabled; megarl/algos/gae.py)
    advantage: str = setting("grpo", choices=(*ADVANTAGES, *TOKEN_LEVEL, *CRITIC_ADVANTAGES))
    gamma: float = setting(1.0, ge=0, le=1)  # gae, reinforce_plus_plus: discount per token
    lam: float = setting(1.0, ge=0, le=1)  # gae: the lambda of GAE (1: Monte-Carlo returns minus values)
    # ppo | gspo | cispo | sapo | dppo (DPPO's binary trust-region mask) | clip_cov | kl_cov (the covariance losses)
    policy_loss: str = setting("ppo", choices=tuple(POLICY_LOSSES))
    # the PPO ratio's old policy: recompute (the trainer's log-probs before the step's first update, one
    # forward-only pass when trainer.updates_per_step > 1) | rollout (the engine's log-probs: verl's bypass mode,
    # the ratio to the rollout policy is the off-policy correction; off_policy_correction must be none)
    old_policy: str = setting("recompute", choices=OLD_POLICIES)
    clip_low: float = setting(0.2, ge=0)  # ratio band [1 - clip_low, 1 + clip_high] of ppo, gspo, cispo, clip_cov
    clip_high: float = setting(0.2, ge=0)
    clip_absolute: bool = False  # cispo: the IS-weight bounds are [clip_low, clip_high] themselves (lower may be 0)
    dual_clip: Optional[float] = setting(None, gt=1)  # c > 1 for PPO dual clip
    sapo_tau_pos: float = setting(1.0, gt=0)  # sapo: gate temperature for tokens with advantage > 0 (verl tau_pos)
    sapo_tau_neg: float = setting(1.05, gt=0)  # sapo: gate temperature for advantage <= 0 (verl tau_neg)
    # dppo: binary_tv (|p - p_old| trust region) | binary_kl (binary KL of the sampled token's probability)
    dppo_type: str = setting("binary_tv", choices=DPPO_TYPES)
    dppo_delta_low: float = setting(0.2, ge=0)  # dppo: the divergence bound for tokens with advantage < 0
    dppo_delta_high: float = setting(0.2, ge=0)  # dppo: the divergence bound for tokens with advantage > 0
    # clip_cov: the share of trained tokens detached at most (at least one) among those of covariance in
    # (clip_cov_lb, clip_cov_ub) (verl clip_cov_ratio)
    clip_cov_ratio: float = setting(2e-4, gt=0, le=1)
    # clip_cov: the covariance band (clip_cov_lb, clip_cov_ub) of the candidates (lb below ub)
    clip_cov_lb: float = setting(1.0, ge=-1000, le=1000)
    clip_cov_ub: float = setting(5.0, ge=-1000, le=1000)
    kl_cov_ratio: float = setting(2e-4, gt=0, le=1)  # kl_cov: share of trained tokens of largest covariance penalised
    kl_cov_coef: float = setting(1.0, ge=0)  # kl_cov: weight of |logp - logp_old| on them (verl ppo_kl_coef)
    # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (Dr.GRPO: sum / (B * C))
    # | prompt_mean (token mean within each prompt group, then the mean over groups; SkyRL)
    loss_agg: str = setting("token_mean", choices=tuple(AGGREGATIONS))
    # C of seq_mean_token_sum_norm (verl loss_scale_factor)
    loss_scale_factor: int = setting(II("rollout.max_new_tokens"), ge=1)
    kl_coef: float = setting(0.0, ge=0)  # weight of the KL to the reference policy (the starting checkpoint)
    # k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10]) | k1_is | k2_is | k3_is (x pi/pi_old) | low_var_kl_is
    # (clamp(pi/pi_old * k3, -10, 10), slime's clamp after the weight) | abs (|k1|, verl's and SkyRL's)
    kl_type: str = setting("k3", choices=tuple(KL_ESTIMATORS))
    kl_in_reward: bool = False  # true: reward - kl_coef * sum_t KL_t pre-advantage (verl use_kl_in_reward); false: loss
    # fixed (kl_coef throughout) | adaptive (verl's AdaptiveKLController from kl_coef towards kl_target; needs
    # kl_in_reward, where verl applies it)
    kl_ctrl: str = setting("fixed", choices=KL_CONTROLLERS)
    kl_target: float = setting(0.1, gt=0)  # adaptive: the mean token KL it steers towards
    kl_horizon: float = setting(10000.0, gt=0)  # adaptive: samples over which an error of 20% moves kl_coef by 20%
    entropy_coef: float = setting(0.0, ge=0)
    # on-policy distillation: per-token advantage opd_coef * (teacher_logp - student_logp) (needs teacher.hf_path);
    # alone with advantage=opd, added to the reward advantage otherwise
    opd_coef: float = setting(0.0, ge=0)
    # none (slime, miles: teacher_logp - student_logp as it is) | batch_mean (tinker-cookbook: minus its mean over
    # the batch's trained tokens, a baseline that keeps the gradient's expectation and cuts its variance)
    opd_baseline: str = setting("none", choices=OPD_BASELINES)
    # none | tis (w clamped to [is_threshold_low, is_threshold]) | mis (reject tokens/sequences with w outside it)
    off_policy_correction: str = setting("none", choices=CORRECTIONS)
    # token | sequence (product of token ratios) | geometric (their geometric mean)
    off_policy_level: str = setting("token", choices=LEVELS)
    is_threshold: float = setting(2.0, ge=1)  # upper bound C of w (>= 1)
    # lower bound of w in [0, 1]; null: 0 for tis, 1 / is_threshold for mis
    is_threshold_low: Optional[float] = setting(None, ge=0, le=1)
    # reject a sequence with a token ratio below this (e.g. 1e-4)
    off_policy_veto_threshold: Optional[float] = setting(None, gt=0, le=1)
    # reject a sequence with a token ratio above this (SkyRL's outlier_token_is_threshold_high, e.g. 100)
    off_policy_veto_threshold_high: Optional[float] = setting(None, ge=1)
    # verl's rejection criteria (rollout_rs), comma-separated, all must pass: token_k1..3, seq_sum_k1..3,
    # seq_mean_k1..3, seq_max_k2..3 (megarl/algos/rejection.py); independent of the weight of off_policy_correction
    off_policy_rejection: Optional[str] = None
    # their thresholds (rollout_rs_threshold): one for all or one each, comma-separated; k1: "lower_upper" or upper
    # (quote it: unquoted, YAML and Hydra read 0.5_2 as the number 0.52)
    off_policy_rejection_threshold: Optional[str] = None
    # reject sequences with A < 0 and KL to the rollout policy > this
    off_policy_mask_kl: Optional[float] = setting(None, ge=0)
    # none | exact (each token's score centred by its expectation under the engine's distribution over the recorded
    # top-k/top-p support: needs rollout.keep_sampling_mask) | tail (over the support's score_centering_head most
    # probable ids, the rest of the engine's mass modelled proportional to the trainer's); composes with
    # off_policy_correction (megarl/algos/score_centering.py)
    score_centering: str = setting("none", choices=SCORE_CENTERING)
    score_centering_head: int = setting(8, ge=1)  # tail: recorded ids kept per token (the engine's most probable)
