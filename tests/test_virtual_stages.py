"""Two pipeline stages of two virtual stages each (megatron's interleaved schedule) on the tiny MoE with tied
embeddings and four layers, against HF transformers and against the same step without activation recompute.

One group of two ranks runs, on frozen weights (lr 0):
- an RL step with Keep Routing on samples routed through other experts than the model's own (HF's log-probs
  under that forced routing, top-k sampling masks), over more micro-batches than the schedule's group of
  micro-batches per virtual stage, with and without full activation recompute: the gradients are equal (the
  recompute in the backward pass replays each micro-batch's own experts), and the trainer's log-probs are
  HF's (the activations the stages exchange are the right ones);
- a step that records the trainer's own routing instead (agreement with HF's routing, counted chunk by chunk);
- the old-policy log-probs of a batch too small for one micro-batch per pipeline stage;
- the logits of the checkpoint-conversion check, the HF export of the tied model and the weight sync's
  streams of its two stages (the embedding table once, no output layer of its own);
- a critic of the tied model: its values are HF's backbone times its head.
"""
import dataclasses

import pytest
import torch

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)
LAYOUT = Layout(world_size=2, pp=2, vpp=2)
BATCHING = MicroBatching(max_tokens=16, sequence_parallel=False)


def _frozen(hf_path, layout, recompute):
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable

    settings = dataclasses.replace(optimizer_settings(default_config(), lr=0.0),
                                   use_distributed_optimizer=False)  # every rank keeps its whole gradient
    return build_trainable(hf_path, layout, settings,
                           ModelSettings(transformer_impl="local", routing_replay=True, recompute=recompute))


def _replayed_step(trainable, batch, vocab_size):
    """(grad norm, metrics, {(chunk, parameter): gradient}) of one Keep Routing step."""
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_step import rl_step

    result = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                     dataclasses.replace(BATCHING, vocab_size=vocab_size, keep_routing=True))
    grads = {(i, name): p.main_grad.clone() for i, c in enumerate(trainable.chunks) for name, p in c.named_parameters()}
    return result.grad_norm, result.metrics, grads


def _critic(hf_path, layout, batch):
    """(the critic's head (weight, bias) where this rank holds it, else None; its values of ``batch``)."""
    from megatron.core.utils import unwrap_model

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.critic import CriticSettings, build_critic, critic_values
    from megarl.trainer.model_setup import ModelSettings

    model = ModelSettings(transformer_impl="local", dispatcher="alltoall", routing_replay=False, recompute="none",
                          recompute_num_layers=None, moe_aux_loss_coeff=0.0, reference=False)
    critic = build_critic(CriticSettings(hf_path, optimizer_settings(default_config())), layout, model)
    last = unwrap_model(critic.chunks)[-1]
    head = last.output_layer if last.post_process else None
    return (None if head is None else (head.weight.detach().clone(), head.bias.detach().clone()),
            critic_values(critic.chunks, batch, BATCHING))


def virtual_stage_checks(rank, layout, hf_path):
    from hf_oracle import load_hf, make_samples

    from megarl.algos.settings import AlgorithmConfig
    from megarl.models.bridge import export_hf_state
    from megarl.sync.gather import stage_hf_stream
    from megarl.trainer.convert import _megatron_logits
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import local_micro_batches, policy_logprobs, rl_step

    hf = load_hf(hf_path)
    vocab = hf.config.vocab_size
    forced = build_rl_batch(make_samples(hf, 8, top_k=5, seed=1, rotate_experts=3))
    plan, _, _ = local_micro_batches(forced, BATCHING)
    out = {"micro_batches": plan.num_micro_batches}
    trainable = _frozen(hf_path, layout, "none")
    out["plain"] = _replayed_step(trainable, forced, vocab)
    natural = build_rl_batch(make_samples(hf, 8, top_k=5, seed=2))
    out["recorded"] = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, natural, AlgorithmConfig(),
                              dataclasses.replace(BATCHING, vocab_size=vocab, keep_routing=False)).metrics
    small = natural.select([0, 1])
    out["small"] = (small, policy_logprobs(trainable.chunks, small, MicroBatching(
        max_tokens=64, vocab_size=vocab, keep_routing=True)))
    ids = natural.tokens[:int(natural.cu_seqlens[1])]
    out["logits"] = (ids, _megatron_logits(trainable.chunks, ids, vocab))
    out["export"] = export_hf_state(trainable.model)
    out["stream"] = {name: tensor.clone() for name, tensor in stage_hf_stream(trainable.model)}
    out["recomputed"] = _replayed_step(_frozen(hf_path, layout, "full"), forced, vocab)
    out["critic"] = (natural, *_critic(hf_path, layout, natural))
    return out


@pytest.fixture(scope="module")
def ranks(tied_checkpoint):
    return run_ranks(virtual_stage_checks, LAYOUT, tied_checkpoint)


def test_recompute_replays_each_micro_batchs_own_experts(ranks):
    for result in ranks:
        assert result["micro_batches"] >= 2 * LAYOUT.pp  # more than one group of micro-batches per virtual stage
        (norm, _, grads), (norm_recomputed, _, grads_recomputed) = result["plain"], result["recomputed"]
        assert norm > 0 and norm_recomputed == pytest.approx(norm, abs=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grads_recomputed[name], grad, atol=1e-6, rtol=0, msg=str(name))


def test_virtual_stages_reproduce_hf(ranks, tied_checkpoint):
    from hf_oracle import load_hf

    last = ranks[1]  # the last pipeline stage computes the loss and the log-probs
    for case in ("plain", "recomputed"):
        assert last[case][1]["mismatch/logprob_abs_diff"] < 1e-5, case
    small, logprobs = last["small"]
    trained = small.loss_mask > 0
    torch.testing.assert_close(logprobs[trained], small.rollout_logprobs[trained], atol=1e-5, rtol=0)
    ids, logits = ranks[0]["logits"]
    with torch.no_grad():
        reference = load_hf(tied_checkpoint)(ids[None]).logits[0]
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_recorded_routing_is_compared_chunk_by_chunk(ranks):
    assert ranks[0]["recorded"]["routing/agreement"] > 0.99  # the trainer's own routers choose HF's experts


def test_tied_export_and_sync_hold_the_embedding_once(ranks, tied_checkpoint):
    from safetensors.torch import load_file

    original = load_file(f"{tied_checkpoint}/model.safetensors")
    assert "lm_head.weight" not in original
    for result in ranks:
        assert set(result["export"]) == set(original)
        assert all(torch.equal(result["export"][k], original[k]) for k in original)
    first, last = (result["stream"] for result in ranks)  # each stage streams its own weights
    assert "model.embed_tokens.weight" in first and not set(first) & set(last)
    streamed = first | last
    assert set(streamed) == set(original) and all(torch.equal(streamed[k], original[k]) for k in original)


def test_critic_of_the_tied_model(ranks, tied_checkpoint):
    from hf_oracle import hf_values

    assert ranks[0]["critic"][1] is None  # the head is on the last stage's last virtual stage
    batch, head, values = ranks[1]["critic"]
    torch.testing.assert_close(values, hf_values(tied_checkpoint, batch, head), atol=2e-5, rtol=1e-4)
