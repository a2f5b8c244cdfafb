"""On-policy distillation (OPD): the teacher's per-token reverse-KL advantage on the student's own samples.

For response token t of a sample, with the teacher's log-prob ``teacher_logp_t`` (filled by
:mod:`megarl.rollout.teacher`) and the student's ``student_logp_t``::

    token_advantage_t = opd_coef * (teacher_logp_t - student_logp_t)   on loss-mask tokens, 0 elsewhere

as slime (``slime/backends/megatron_utils/loss.py``, ``apply_opd_kl_to_advantages``:
``reverse_kl = student_log_probs[i] - teacher_log_probs[i]; advantages[i] = adv - args.opd_kl_coef *
reverse_kl``) and miles (``miles/backends/training_utils/loss_hub/opd.py``, the same function) do,
after tinker-cookbook's ``distillation/train_on_policy.py``. ``student_logp_t - teacher_logp_t`` is the
one-sample estimate of the reverse KL ``KL(student || teacher)`` at token t; the policy gradient with
this advantage lowers it. With ``algorithm.opd_baseline=batch_mean`` the batch's mean of
``teacher_logp - student_logp`` over its trained tokens is subtracted first, as tinker-cookbook's
``tinker_cookbook/rl/metrics.py`` ``incorporate_kl_penalty`` does (``kl_advantages = kl_penalty_coef * mask *
(avg_logp_diff - logprob_diffs)``, with ``avg_logp_diff`` the token mean of ``sampled - base`` log-probs): a
constant baseline, so the gradient's expectation is unchanged and its variance smaller (on the demo's task the
raw advantage averages about -2 nats a token for the warmed-up student, -4 for weaker ones). It is added
to the sequence advantage (0 under ``algorithm.advantage=opd``, the reward's otherwise):
:attr:`megarl.trainer.rl_batch.RLBatch.position_advantages`.

The student's log-prob: slime and miles take ``rollout_data["log_probs"]``, the trainer's forward of
the batch at the weights before the update, unless ``--use-rollout-logprobs`` makes it
``rollout_log_probs``, the rollout engine's (tinker-cookbook uses the sampler's too). megarl takes the
engine's, ``RolloutSample.rollout_logprobs``: the advantage is set in the driver before the step, where
the trainer's log-probs do not exist yet, and with Keep Routing and Keep Sampling Mask the trainer
reproduces the engine's log-prob of every fresh token to ~1e-7 (``mismatch/logprob_abs_diff``), so
under ``mode=sync`` the two are the same number. On stale tokens (``one_step_off``, ``async``) the
engine's is the behaviour policy's, as under slime's ``--use-rollout-logprobs``. Both are of the
distribution the token was sampled from (rollout temperature, renormalised over the top-k mask); the
teacher's is at temperature 1 over the full vocabulary (:mod:`megarl.rollout.teacher`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megarl.sample import RolloutSample

OPD_BASELINES = ("none", "batch_mean")  # what is subtracted from teacher_logp - student_logp: see above


def opd_token_advantages(teacher_logprobs: np.ndarray, student_logprobs: np.ndarray, loss_mask: np.ndarray,
                         opd_coef: float, shift: float = 0.0) -> np.ndarray:
    """float32 [R]: ``opd_coef * (teacher_logprobs - student_logprobs + shift)`` where ``loss_mask`` is 1, else 0.
    All three inputs are [R] (log-probs in nats, the mask uint8 or bool); ``shift`` (nats) is a baseline."""
    if not teacher_logprobs.shape == student_logprobs.shape == loss_mask.shape or teacher_logprobs.ndim != 1:
        raise ValueError(f"teacher_logprobs, student_logprobs and loss_mask must all be [R], got "
                         f"{teacher_logprobs.shape}, {student_logprobs.shape}, {loss_mask.shape}")
    if opd_coef < 0:
        raise ValueError(f"opd_coef must be >= 0, got {opd_coef}")
    diff = teacher_logprobs.astype(np.float64) - student_logprobs.astype(np.float64) + shift
    return np.where(loss_mask > 0, opd_coef * diff, 0.0).astype(np.float32)


def fill_distill_advantages(samples: Sequence[RolloutSample], opd_coef: float,
                            baseline: str = "none") -> dict[str, float]:
    """Add each sample's OPD token advantages to its ``token_advantages`` (set when None) and return
    ``distill/reverse_kl``: the mean of ``student_logp - teacher_logp`` over the batch's trained
    (loss-mask) tokens, in nats. Every sample must carry ``teacher_logprobs``. ``baseline`` is one of
    :data:`OPD_BASELINES`: ``batch_mean`` subtracts ``-distill/reverse_kl`` from every trained token's
    ``teacher_logp - student_logp`` before the weight."""
    if baseline not in OPD_BASELINES:
        raise ValueError(f"unknown OPD baseline {baseline!r}: one of {', '.join(OPD_BASELINES)}")
    total, tokens = 0.0, 0
    for b, sample in enumerate(samples):
        if sample.teacher_logprobs is None:
            raise ValueError(f"sample {b} ({sample.group_id}) has no teacher_logprobs: on-policy distillation needs "
                             "the teacher's score of every trained sample")
        trained = sample.loss_mask > 0
        total += float((sample.rollout_logprobs[trained].astype(np.float64)
                        - sample.teacher_logprobs[trained].astype(np.float64)).sum())
        tokens += int(trained.sum())
    reverse_kl = total / tokens if tokens else 0.0
    shift = reverse_kl if baseline == "batch_mean" else 0.0  # teacher - student - mean(teacher - student)
    for sample in samples:
        extra = opd_token_advantages(sample.teacher_logprobs, sample.rollout_logprobs,
                                     sample.loss_mask, opd_coef, shift)
        sample.token_advantages = extra if sample.token_advantages is None else sample.token_advantages + extra
    return {"distill/reverse_kl": reverse_kl}
