"""The critic on the Megatron trainer (one process, the tiny MoE, random init) against independent references:

- its values equal the HF backbone's last hidden state (after the final norm) times the head's weight plus its
  bias, at every trained position;
- a step's GAE advantages and returns (the driver's :meth:`Pipeline.gae_targets` on the critic's values) equal
  :func:`megarl.algos.gae.gae` on padded rows with each reward on its sample's last trained token, and the
  policy update trains on them: with ratio 1 its loss is minus their token mean over the mini-batch;
- repeated critic updates on one batch lower its clipped value loss;
- a checkpoint holds the critic under the completion record; a fresh policy and critic restored from it give
  the same values, and one more update of each copy gives the same values again (optimizer state and LR
  schedule restored); a checkpoint without a critic cannot resume a run with one;
- under TP2 with sequence parallelism (the head replicated, the sequence gathered before it) the values, and
  the values after one update, equal the single rank's;
- on a policy with tied embeddings at one pipeline stage (whose output layer holds no weight of its own) the
  values are the backbone's as well, and updates lower the value loss.
"""
import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)
BATCHING = MicroBatching(max_tokens=24, sequence_parallel=False)


def _critic(hf_path, layout, settings):
    """The critic of ``hf_path`` for ``layout``, built as the trainer ranks build it (local layers, no replay)."""
    from megarl.trainer.critic import CriticSettings, build_critic
    from megarl.trainer.model_setup import ModelSettings

    model = ModelSettings(transformer_impl="local", dispatcher="alltoall", routing_replay=False, recompute="none",
                          recompute_num_layers=None, moe_aux_loss_coeff=0.0, reference=False)
    return build_critic(CriticSettings(hf_path=hf_path, optimizer=settings), layout, model)


def _build(hf_path, layout, settings):
    from megarl.trainer.model_setup import ModelSettings, build_trainable

    policy = build_trainable(hf_path, layout, settings, ModelSettings(transformer_impl="local"))
    return policy, _critic(hf_path, layout, settings)


def _head(critic) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    head = unwrap_model(critic.chunks)[0].output_layer
    return head.weight.detach().clone(), head.bias.detach().clone()


def _gae_step(cfg, critic, whole, samples):
    """The driver's GAE targets of ``whole`` with this rank's critic as the trainer."""
    from megarl.pipeline.run import Pipeline
    from megarl.trainer.critic import critic_values

    async def values(batch, batching):
        return critic_values(critic.chunks, batch, batching)

    driver = SimpleNamespace(cfg=cfg, trainer=SimpleNamespace(critic_values=values), batching=BATCHING)
    return asyncio.run(Pipeline.gae_targets(driver, whole, samples, None))


def critic_checks(rank, layout, hf_path, settings, cfg, algo, root):
    from hf_oracle import load_hf, make_samples

    from megarl.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from megarl.trainer.critic import critic_step, critic_values
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    hf = load_hf(hf_path)
    policy, critic = _build(hf_path, layout, settings)
    samples = make_samples(hf, 8, top_k=5, seed=11)
    for i, sample in enumerate(samples):
        sample.reward, sample.advantage = float(i % 3 == 0), 0.0
    whole = build_rl_batch(samples)
    out = {"batch": whole, "head": _head(critic), "rewards": [s.reward for s in samples]}
    out["fit"] = _gae_step(cfg, critic, whole, samples)
    half = whole.select(range(4))
    out["half"] = half
    out["policy"] = rl_step(policy.chunks, policy.optimizer, policy.scheduler, half, algo,
                            dataclasses.replace(BATCHING, vocab_size=hf.config.vocab_size, keep_routing=False)).metrics
    def update():
        return critic_step(critic.chunks, critic.optimizer, critic.scheduler, whole, BATCHING,
                           value_clip=10.0).metrics["critic/value_loss"]

    out["losses"] = [update()]
    out["after_one"] = critic_values(critic.chunks, whole, BATCHING)
    out["losses"] += [update() for _ in range(3)]
    save_checkpoint(root, 1, policy, {"position": 1}, critic=critic)
    out["saved"] = critic_values(critic.chunks, whole, BATCHING)
    fresh_policy, fresh_critic = _build(hf_path, layout, settings)
    out["fresh"] = critic_values(fresh_critic.chunks, whole, BATCHING)
    load_checkpoint(root, fresh_policy, critic=fresh_critic)
    out["restored"] = critic_values(fresh_critic.chunks, whole, BATCHING)
    for model in (critic, fresh_critic):
        critic_step(model.chunks, model.optimizer, model.scheduler, whole, BATCHING, value_clip=10.0)
    out["continued"] = [critic_values(m.chunks, whole, BATCHING) for m in (critic, fresh_critic)]
    save_checkpoint(f"{root}_policy_only", 1, policy, {"position": 1})
    try:
        load_checkpoint(f"{root}_policy_only", fresh_policy, critic=fresh_critic)
    except CheckpointError as exc:
        out["no_critic"] = str(exc)
    return out


def one_update(rank, layout, hf_path, settings, batch, value_clip):
    """This layout's critic values of ``batch`` (which carries the single rank's returns), and after one update."""
    from megarl.trainer.critic import critic_step, critic_values

    critic = _critic(hf_path, layout, settings)
    batching = dataclasses.replace(BATCHING, sequence_parallel=layout.sequence_parallel)
    before = critic_values(critic.chunks, batch, batching)
    critic_step(critic.chunks, critic.optimizer, critic.scheduler, batch, batching, value_clip=value_clip)
    return before, critic_values(critic.chunks, batch, batching)


@pytest.fixture(scope="module")
def checks(tiny_checkpoint, tmp_path_factory):

    from megarl.config import load_config
    from megarl.config.components import optimizer_settings

    cfg = load_config(["recipe=tiny_moe_ppo_cpu", f"model.hf_path={tiny_checkpoint}", "algorithm.lam=0.9"])
    settings = optimizer_settings(cfg)
    algo = dataclasses.replace(cfg.algorithm, off_policy_correction="none")
    root = tmp_path_factory.mktemp("critic") / "checkpoints"
    return run_ranks(critic_checks, Layout(), tiny_checkpoint, settings, cfg, algo, str(root))[0] | {
        "root": root, "hf_path": tiny_checkpoint, "cfg": cfg, "settings": settings}


def test_values_are_the_backbones_last_hidden_state_times_the_head(checks):
    from hf_oracle import hf_values

    batch = checks["batch"]
    reference = hf_values(checks["hf_path"], batch, checks["head"])
    assert reference.abs().max() > 1e-3  # a random head: values of both signs, not all 0
    torch.testing.assert_close(batch.old_values, reference, atol=2e-5, rtol=1e-4)


def test_a_steps_gae_is_gae_on_its_values_and_rewards(checks):
    from megarl.algos.gae import gae
    from megarl.trainer.packing import to_grid

    batch, cfg = checks["batch"], checks["cfg"]
    cu = batch.cu_seqlens
    mask, values = to_grid(batch.loss_mask, cu), to_grid(batch.old_values, cu)
    rewards = torch.zeros_like(values)
    for b, reward in enumerate(checks["rewards"]):
        rewards[b, int(mask[b].nonzero().max())] = reward
    advantages, returns = gae(rewards, values, mask, cfg.algorithm.gamma, cfg.algorithm.lam)
    torch.testing.assert_close(to_grid(batch.token_advantages, cu), advantages, atol=1e-6, rtol=0)
    torch.testing.assert_close(to_grid(batch.returns, cu), returns, atol=1e-6, rtol=0)
    fit = checks["fit"]
    assert set(fit) == {"critic/explained_variance", "critic/value_error", "critic/values_mean"}
    trained = mask > 0
    assert fit["critic/value_error"] == pytest.approx(float(((values - returns)[trained] ** 2).mean()), rel=1e-5)
    # the policy's update is on these advantages: ratio 1, no correction, so its loss is -mean_t(A)
    half = checks["half"]
    expected = -float((half.position_advantages() * half.loss_mask).sum() / half.loss_mask.sum())
    assert abs(expected) > 1e-3
    assert checks["policy"]["pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_critic_updates_lower_the_value_loss(checks):
    losses = checks["losses"]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_checkpoint_round_trip_restores_the_critic(checks):
    record = json.loads((checks["root"] / "iter_0000001" / "complete.json").read_text())
    assert any(name.startswith("critic/") for name in record["files"])
    assert not torch.equal(checks["fresh"], checks["saved"])  # the trained critic differs from a new one
    assert torch.equal(checks["restored"], checks["saved"])
    mine, theirs = checks["continued"]
    assert not torch.equal(mine, checks["saved"])
    torch.testing.assert_close(theirs, mine, atol=1e-6, rtol=0)
    assert "holds no critic" in checks["no_critic"]


def test_tp2_with_sequence_parallelism_equals_one_rank(checks):
    layout = Layout(world_size=2, tp=2, sequence_parallel=True)
    before, after = run_ranks(one_update, layout, checks["hf_path"], checks["settings"], checks["batch"], 10.0)[0]
    torch.testing.assert_close(before, checks["batch"].old_values, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, before, atol=1e-4)
    torch.testing.assert_close(after, checks["after_one"], atol=1e-5, rtol=1e-5)


def tied_critic_checks(rank, layout, hf_path, settings):
    """The critic of the tied checkpoint: (batch, head, its values of the batch, the value losses of two
    updates towards returns one above those values)."""
    import dataclasses

    from hf_oracle import load_hf, make_samples

    from megarl.trainer.critic import critic_step, critic_values
    from megarl.trainer.rl_batch import build_rl_batch

    critic = _critic(hf_path, layout, settings)
    head = _head(critic)
    batch = build_rl_batch(make_samples(load_hf(hf_path), 8, top_k=5, seed=11))
    values = critic_values(critic.chunks, batch, BATCHING)
    target = dataclasses.replace(batch, old_values=values, returns=values + batch.loss_mask)
    losses = [critic_step(critic.chunks, critic.optimizer, critic.scheduler, target, BATCHING,
                          value_clip=10.0).metrics["critic/value_loss"] for _ in range(2)]
    return batch, head, values, losses


def test_critic_of_a_policy_with_tied_embeddings(tied_checkpoint):
    from hf_oracle import hf_values

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings

    settings = optimizer_settings(default_config(), lr=1e-3)
    batch, head, values, losses = run_ranks(tied_critic_checks, Layout(), tied_checkpoint, settings)[0]
    torch.testing.assert_close(values, hf_values(tied_checkpoint, batch, head), atol=2e-5, rtol=1e-4)
    assert losses[1] < losses[0], losses
