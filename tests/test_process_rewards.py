"""Per-turn (process) rewards -> token advantages (megarl/algos/process.py) against a plain
transcription of verl's PRIME recipe (``recipe/prime/prime_core_algos.py``,
``compute_rloo_advantage_return``), alone, added to the RLOO outcome advantage, and with a teacher's
token advantages on top (``assign_advantages``, the step's one call); environment tokens get 0; bad
input is refused with the reason."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.algos.advantages import assign_advantages, fill_advantages
from megarl.algos.process import fill_process_advantages, process_advantages
from megarl.sample import FinishReason, RolloutSample
from megarl.trainer.rl_batch import build_rl_batch

pytestmark = pytest.mark.unit


def prime_returns(rm_scores, rm_mask, acc, eos_mask, valid_response_length, n_samples, dpo_coef, gt_coef):
    """verl's ``compute_rloo_advantage_return`` up to ``returns`` (before ``masked_whiten``), written
    out as the recipe has it: ``rm_scores`` [B, L] with its reward mask, ``acc`` [B] at the last
    response token, samples in blocks of ``n_samples``."""

    def masked_rloo(reward_tensor_original, mask_tensor):
        reward_tensor = reward_tensor_original.clone()
        reward_tensor[~mask_tensor] = 0
        for start_pos in range(0, reward_tensor.shape[0], n_samples):
            cur_rewards_mean = torch.cat([
                reward_tensor[pos:pos + 1][mask_tensor[pos:pos + 1]].mean(dim=0, keepdim=True)
                for pos in range(start_pos, start_pos + n_samples)], dim=0)
            cur_rewards_sum = cur_rewards_mean.sum()
            cur_reward_baseline = cur_rewards_sum / (n_samples - 1)
            reward_tensor[start_pos:start_pos + n_samples][mask_tensor[start_pos:start_pos + n_samples]] = \
                reward_tensor[start_pos:start_pos + n_samples][mask_tensor[start_pos:start_pos + n_samples]] * (
                    n_samples / (n_samples - 1)) - cur_reward_baseline
        return reward_tensor

    reward_tensors = []
    if dpo_coef != 0.:
        reward_tensors.append(masked_rloo(rm_scores, rm_mask) * dpo_coef)
    if gt_coef != 0.:
        reward_tensor = torch.zeros_like(eos_mask, dtype=torch.float64)
        reward_mask = torch.zeros_like(eos_mask, dtype=torch.bool)
        rows = torch.arange(0, valid_response_length.shape[0], dtype=torch.long)
        reward_mask[rows, valid_response_length - 1] = True
        reward_tensor[rows, valid_response_length - 1] = acc
        reward_tensors.append(masked_rloo(reward_tensor, reward_mask) * gt_coef)
    final_reward_tensor = sum(reward_tensors)
    return (final_reward_tensor * eos_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


def episode(rng, group_id, turns=None):
    """A synthetic multi-turn sample: policy turns (loss mask 1) with observations (0) between them,
    a random reward per turn and an outcome reward."""
    turns = turns or int(rng.integers(1, 4))
    mask, ends = [], []
    for k in range(turns):
        if k:
            mask += [0] * int(rng.integers(1, 4))
        mask += [1] * int(rng.integers(1, 5))
        ends.append(len(mask))
    r = len(mask)
    return RolloutSample(
        prompt_ids=[1, 2], response_ids=list(rng.integers(3, 50, r)), loss_mask=np.asarray(mask, np.uint8),
        rollout_logprobs=np.zeros(r, np.float32), model_version=np.zeros(r, np.int32), routed_experts=None,
        sampling_mask=None, finish_reason=FinishReason.STOP, reward=float(rng.integers(0, 2)), group_id=group_id,
        turn_ends=tuple(ends), turn_rewards=tuple(rng.normal(size=turns).round(3)))


def interleaved_groups(seed=0, groups=3, size=4):
    rng = np.random.default_rng(seed)
    return [episode(rng, f"g{j}") for _ in range(size) for j in range(groups)]


def prime_reference(samples, group_id, gt_coef):
    """PRIME's returns for one group (its samples as one block), as a list of [R] arrays."""
    block = [s for s in samples if s.group_id == group_id]
    width = max(len(s.response_ids) for s in block)
    rm_scores = torch.zeros(len(block), width, dtype=torch.float64)
    rm_mask = torch.zeros(len(block), width, dtype=torch.bool)
    eos_mask = torch.zeros(len(block), width, dtype=torch.float64)
    for b, s in enumerate(block):
        ends = torch.tensor(s.turn_ends) - 1
        rm_scores[b, ends] = torch.tensor(s.turn_rewards, dtype=torch.float64)
        rm_mask[b, ends] = True
        eos_mask[b, :len(s.response_ids)] = torch.from_numpy(s.loss_mask.astype(np.float64))
    returns = prime_returns(rm_scores, rm_mask, torch.tensor([s.reward for s in block], dtype=torch.float64),
                            eos_mask, torch.tensor([len(s.response_ids) for s in block]), len(block), 1.0, gt_coef)
    return block, [returns[b, :len(s.response_ids)].numpy() for b, s in enumerate(block)]


def test_turn_rewards_follow_prime_and_observation_tokens_get_zero():
    samples = interleaved_groups()
    ours = dict(zip(map(id, samples), process_advantages(samples)))
    for group_id in ("g0", "g1", "g2"):
        block, reference = prime_reference(samples, group_id, gt_coef=0.0)
        for s, expected in zip(block, reference):
            got = ours[id(s)]
            assert got.dtype == np.float32 and got.shape == (len(s.response_ids),)
            policy = s.loss_mask.astype(bool)
            np.testing.assert_allclose(got[policy], expected[policy], rtol=1e-6, atol=1e-6)
            assert (got[~policy] == 0).all()
    assert any((~s.loss_mask.astype(bool)).any() for s in samples)  # the cases include observations


def test_with_rloo_outcome_the_loss_sees_prime_returns():
    samples = interleaved_groups(seed=1)
    fill_advantages(samples, "rloo")
    stats = fill_process_advantages(samples)
    assert stats.samples == 12 and stats.turns == sum(len(s.turn_ends) for s in samples)
    assert math.isclose(stats.turn_reward_mean, float(np.mean([x for s in samples for x in s.turn_rewards])))
    batch = build_rl_batch(samples, with_routing=False, with_sampling_mask=False)
    per_position = batch.position_advantages().numpy()
    starts = batch.cu_seqlens[:-1].tolist()
    for group_id in ("g0", "g1", "g2"):
        block, reference = prime_reference(samples, group_id, gt_coef=1.0)
        for s, expected in zip(block, reference):
            b = next(i for i, x in enumerate(samples) if x is s)
            policy = s.loss_mask.astype(bool)
            got = per_position[starts[b] + len(s.prompt_ids) - 1:][:len(s.response_ids)]  # the response positions
            np.testing.assert_allclose(got[policy], expected[policy], rtol=1e-5, atol=1e-5)


def test_assign_advantages_is_rloo_plus_prime_returns_plus_the_teachers_advantage():
    samples = interleaved_groups(seed=5)
    rng = np.random.default_rng(6)
    for s in samples:
        s.rollout_logprobs = -rng.random(len(s.response_ids)).astype(np.float32)
        s.teacher_logprobs = -rng.random(len(s.response_ids)).astype(np.float32)
    algorithm = SimpleNamespace(advantage="rloo", opd_coef=0.5, opd_baseline="none", gamma=1.0)
    stats = assign_advantages(samples, algorithm, distill=True)
    policy_tokens = [s.loss_mask.astype(bool) for s in samples]
    reverse_kl = (sum(float((s.rollout_logprobs[m].astype(np.float64) - s.teacher_logprobs[m]).sum())
                      for s, m in zip(samples, policy_tokens)) / sum(int(m.sum()) for m in policy_tokens))
    assert math.isclose(stats.metrics["distill/reverse_kl"], reverse_kl, rel_tol=1e-9)
    assert stats.metrics["process/turns"] == sum(len(s.turn_ends) for s in samples)
    assert math.isclose(stats.reward_mean, float(np.mean([s.reward for s in samples])))
    batch = build_rl_batch(samples, with_routing=False, with_sampling_mask=False)
    per_position, starts = batch.position_advantages().numpy(), batch.cu_seqlens[:-1].tolist()
    for group_id in ("g0", "g1", "g2"):
        block, reference = prime_reference(samples, group_id, gt_coef=1.0)
        for s, prime in zip(block, reference):
            b = next(i for i, x in enumerate(samples) if x is s)
            teacher = 0.5 * (s.teacher_logprobs.astype(np.float64) - s.rollout_logprobs)
            got = per_position[starts[b] + len(s.prompt_ids) - 1:][:len(s.response_ids)]  # the response positions
            policy = policy_tokens[b]
            np.testing.assert_allclose(got[policy], (prime + teacher)[policy], rtol=1e-5, atol=1e-5)


def test_assign_advantages_without_a_teacher_asks_for_no_teacher_scores():
    samples = interleaved_groups(seed=7)
    algorithm = SimpleNamespace(advantage="grpo", opd_coef=1.0, opd_baseline="none", gamma=1.0)
    stats = assign_advantages(samples, algorithm)
    assert "distill/reverse_kl" not in stats.metrics and stats.metrics["process/turns"] > 0
    with pytest.raises(ValueError, match="has no teacher_logprobs"):
        assign_advantages(interleaved_groups(seed=7), algorithm, distill=True)


def test_group_of_one_keeps_raw_rewards_to_go():
    rng = np.random.default_rng(2)
    s = episode(rng, "alone", turns=3)
    [got] = process_advantages([s])
    at = np.asarray(s.turn_ends) - 1
    expected = [sum(r for r, e in zip(s.turn_rewards, at) if e >= t) if s.loss_mask[t] else 0.0
                for t in range(len(s.response_ids))]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_adds_to_existing_token_advantages_and_leaves_groups_without_turn_rewards():
    rng = np.random.default_rng(3)
    samples = [episode(rng, "a") for _ in range(3)] + [episode(rng, "b") for _ in range(2)]
    for s in samples[3:]:
        s.turn_rewards = ()
    first = samples[0]
    existing = np.arange(len(first.response_ids), dtype=np.float32)
    first.token_advantages = existing.copy()
    expected = process_advantages(samples)
    stats = fill_process_advantages(samples)
    assert stats.samples == 3
    np.testing.assert_allclose(first.token_advantages, existing + expected[0], rtol=1e-6)
    assert first.token_advantages.dtype == np.float32
    assert expected[3] is None and expected[4] is None
    assert samples[3].token_advantages is None and samples[4].token_advantages is None


def test_bad_turn_rewards_are_refused_with_the_reason():
    rng = np.random.default_rng(4)

    def group(n=2, turns=2):
        return [episode(rng, "g", turns=turns) for _ in range(n)]

    samples = group()
    samples[1].turn_rewards = samples[1].turn_rewards[:1]  # set after construction: not checked there
    with pytest.raises(ValueError, match=r"sample 1 \(group 'g'\): 1 turn_rewards for 2 turn_ends"):
        process_advantages(samples)
    samples = group()
    samples[0].turn_rewards = ()
    with pytest.raises(ValueError, match="group 'g': 1 of 2 samples have turn_rewards"):
        process_advantages(samples)
    samples = group()
    samples[0].turn_rewards = (1.0, float("nan"))
    with pytest.raises(ValueError, match="must be finite"):
        process_advantages(samples)
    samples = group()
    samples[1].turn_ends = (samples[1].turn_ends[0] + 1, samples[1].turn_ends[1])  # the observation's first token
    with pytest.raises(ValueError, match="turns end at environment tokens"):
        process_advantages(samples)
    samples = group()
    samples[0].turn_ends = (samples[0].turn_ends[1], samples[0].turn_ends[0])
    with pytest.raises(ValueError, match="must increase within the response"):
        process_advantages(samples)
