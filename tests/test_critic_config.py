"""PPO with a value model, what runs without the trainer: the config's rules, GAE over a ragged batch, the
value metrics and the critic's memory in the planner."""
import json

import numpy as np
import pytest
import torch

from megarl.algos.gae import gae, ragged_gae
from megarl.algos.value_loss import value_metrics
from megarl.config import ConfigError, load_config

pytestmark = pytest.mark.unit

PPO = ["recipe=tiny_moe_ppo_cpu"]


@pytest.mark.parametrize("overrides, key, why", [
    (["recipe=tiny_moe_cpu", "algorithm.advantage=gae"], "critic.enabled", "set critic.enabled=true"),
    ([*PPO, "algorithm.advantage=grpo"], "algorithm.advantage", "a value model that only gae uses, not grpo"),
    ([*PPO, "lora.enabled=true"], "critic.enabled", "not built with LoRA"),
    ([*PPO, "algorithm.off_policy_mask_kl=0.1"], "algorithm.off_policy_mask_kl", "gae gives per-token ones"),
    ([*PPO, "algorithm.lam=1.5"], "algorithm.lam", "must be in [0, 1]"),
    ([*PPO, "critic.value_clip=0"], "critic.value_clip", "must be > 0"),
])
def test_gae_and_the_critic_require_each_other(overrides, key, why):
    with pytest.raises(ConfigError) as caught:
        load_config(overrides)
    message = str(caught.value)
    assert message.startswith(f"{key}: ") and why in message and "\n" not in message, message


def test_the_critics_checkpoint_is_checked_before_the_run(tmp_path):
    from megarl.config.inputs import check_inputs

    with pytest.raises(ConfigError, match=r"^critic.hf_path: .*/nowhere is not an HF checkpoint directory"):
        check_inputs(load_config([*PPO, f"critic.hf_path={tmp_path / 'nowhere'}"]))


def test_the_ppo_recipe_loads_with_gae_and_a_critic():
    cfg = load_config(PPO)
    assert cfg.algorithm.advantage == "gae" and cfg.critic.enabled and cfg.critic.hf_path is None
    assert 0 <= cfg.algorithm.lam <= 1 and cfg.algorithm.gamma == 1.0


def _per_sample_gae(rewards, values, mask, cu, gamma, lam):
    """The reference: each sample alone as a row of its trained tokens (the untrained ones dropped), the
    reward on the last; GAE by the textbook recursion; whitened over the batch's trained tokens."""
    advantages, returns, where = [], [], []
    for b in range(len(rewards)):
        span = np.arange(cu[b], cu[b + 1])
        trained = span[mask[span] > 0]
        v = values[trained]
        r = np.zeros(len(trained))
        r[-1] = rewards[b]
        a, following = np.zeros(len(trained)), 0.0
        for t in reversed(range(len(trained))):
            next_value = v[t + 1] if t + 1 < len(trained) else 0.0
            following = r[t] + gamma * next_value - v[t] + gamma * lam * following
            a[t] = following
        advantages.append(a)
        returns.append(a + v)
        where.append(trained)
    flat = np.concatenate(advantages)
    whitened = (flat - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8)
    out_adv, out_ret = np.zeros(len(values)), np.zeros(len(values))
    out_adv[np.concatenate(where)] = whitened
    out_ret[np.concatenate(where)] = np.concatenate(returns)
    return out_adv, out_ret


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 1.0), (1, 0.99, 0.95), (2, 0.9, 0.0)])
def test_ragged_gae_puts_the_reward_on_the_last_trained_token(seed, gamma, lam):
    gen = np.random.default_rng(seed)
    lengths = gen.integers(2, 9, size=7)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    mask = (gen.random(cu[-1]) < 0.7).astype(np.float32)
    mask[cu[1:] - 2] = 1.0  # every sample has a trained token (its last position may be an environment's)
    values, rewards = gen.normal(size=cu[-1]), gen.normal(size=len(lengths))
    advantages, returns = ragged_gae(torch.tensor(rewards), torch.tensor(values, dtype=torch.float32),
                                     torch.tensor(mask), torch.tensor(cu), gamma, lam)
    ref_adv, ref_ret = _per_sample_gae(rewards, values.astype(np.float32), mask, cu, gamma, lam)
    assert advantages.dtype == returns.dtype == torch.float32
    np.testing.assert_allclose(advantages.numpy(), ref_adv, atol=1e-5)
    np.testing.assert_allclose(returns.numpy(), ref_ret, atol=1e-5)


def test_ragged_gae_leaves_a_sample_without_trained_tokens_out():
    """Its reward goes nowhere and its positions get 0; the other samples' numbers are theirs alone."""
    cu, mask = torch.tensor([0, 3, 6, 8]), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    values = torch.linspace(-1, 1, 8)
    advantages, returns = ragged_gae(torch.tensor([1.0, 5.0, -1.0]), values, mask, cu, 1.0, 1.0)
    alone_adv, alone_ret = ragged_gae(torch.tensor([1.0, -1.0]), values[[0, 1, 2, 6, 7]], mask[[0, 1, 2, 6, 7]],
                                      torch.tensor([0, 3, 5]), 1.0, 1.0)
    assert advantages[3:6].abs().max() == 0 and returns[3:6].abs().max() == 0
    assert torch.equal(advantages[[0, 1, 2, 6, 7]], alone_adv) and torch.equal(returns[[0, 1, 2, 6, 7]], alone_ret)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ragged_gae(torch.ones(2), values, mask, cu, 1.0, 1.0)


def test_ragged_gae_equals_gae_on_padded_rows():
    """The same batch as padded rows through :func:`gae` itself: the ragged wrapper only moves numbers."""
    cu, mask = torch.tensor([0, 4, 7]), torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    values, rewards = torch.linspace(-1, 1, 7), torch.tensor([1.0, -0.5])
    advantages, returns = ragged_gae(rewards, values, mask, cu, 0.9, 0.8)
    grid_v = torch.tensor([[0.0, *values[1:4].tolist()], [values[5].item(), values[6].item(), 0.0, 0.0]])
    grid_m = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    grid_r = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, -0.5, 0.0, 0.0]])
    ref_adv, ref_ret = gae(grid_r, grid_v, grid_m, 0.9, 0.8)
    assert torch.allclose(advantages[[1, 2, 3, 5, 6]], torch.cat([ref_adv[0, 1:], ref_adv[1, :2]]), atol=1e-6)
    assert torch.allclose(returns[[1, 2, 3, 5, 6]], torch.cat([ref_ret[0, 1:], ref_ret[1, :2]]), atol=1e-6)
    assert advantages[[0, 4]].abs().max() == 0 and returns[[0, 4]].abs().max() == 0


def test_value_metrics_against_numpy():
    gen = np.random.default_rng(3)
    returns, noise = gen.normal(size=50), gen.normal(scale=0.3, size=50)
    mask = (gen.random(50) < 0.8).astype(np.float32)
    values = returns + noise
    got = value_metrics(torch.tensor(values), torch.tensor(returns), torch.tensor(mask))
    v, r = values[mask > 0], returns[mask > 0]
    assert got["critic/explained_variance"] == pytest.approx(1 - np.var(r - v, ddof=1) / (np.var(r, ddof=1) + 1e-5))
    assert got["critic/value_error"] == pytest.approx(np.mean((v - r) ** 2))
    assert got["critic/values_mean"] == pytest.approx(v.mean())
    perfect = value_metrics(torch.tensor(returns), torch.tensor(returns), torch.tensor(mask))
    assert perfect["critic/explained_variance"] == pytest.approx(1.0) and perfect["critic/value_error"] == 0.0


def test_the_planner_adds_the_critics_weights_gradients_and_adam_state(tmp_path, capsys):
    """The tiny model's critic: every parameter but the vocabulary head, plus a [1, hidden] head and its bias,
    each with an fp32 weight, fp32 gradient and two fp32 Adam moments (float32: no master copy; one rank).
    The recipes' architecture numbers are complete: no checkpoint is read."""
    from megarl.plan import main

    ckpt = tmp_path / "absent"
    out, plain_out = tmp_path / "ppo.json", tmp_path / "grpo.json"
    assert main([*PPO, f"model.hf_path={ckpt}", "--json", str(out)]) == 0
    assert "critic" in capsys.readouterr().out
    assert main(["recipe=tiny_moe_cpu", f"model.hf_path={ckpt}", "--json", str(plain_out)]) == 0
    ppo, plain = json.loads(out.read_text()), json.loads(plain_out.read_text())
    params, hidden = ppo["params"], load_config(PPO).model.arch.hidden_size
    critic_params = params["total"] - params["head"] + hidden + 1
    (stage,), (plain_stage,) = ppo["trainer"], plain["trainer"]
    assert stage["critic"] == critic_params * (4 + 4 + 8)
    assert stage["total"] == plain_stage["total"] + stage["critic"] and plain_stage["critic"] == 0
