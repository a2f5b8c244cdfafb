"""The critic: a value model beside the policy on the same trainer ranks (same layout, same process groups).

It is the policy's architecture with a scalar head (:mod:`megarl.models.value_head`), built through
megatron-bridge from an HF checkpoint (``critic.hf_path``, default the policy's starting one), with its own
DDP, optimizer and LR schedule (``critic.*`` optimizer keys). Its routers choose their own experts: the
engine's routing is the policy's and is not replayed here.

Per RL step: :func:`critic_values` gives the values of the step's tokens before any update (forward only,
like the old-policy pass); the driver turns them into GAE advantages and returns
(:func:`megarl.algos.gae.ragged_gae`); then, after each of the policy's mini-batch updates,
:func:`critic_step` trains the critic on the same mini-batch with the clipped value loss
(:mod:`megarl.algos.value_loss`), token mean over the mini-batch's trained tokens (megatron divides the
summed gradient by the global token count, as for the policy).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl.algos.value_loss import clipped_value_loss
from megarl.trainer.context_parallel import token_count_share
from megarl.trainer.device import model_device
from megarl.trainer.micro_batching import MicroBatching
from megarl.trainer.optimizer import OptimizerSettings
from megarl.trainer.packing import ModelInput, to_grid
from megarl.trainer.rl_batch import RLBatch
from megarl.trainer.rl_step import RLStepResult, forward_backward, local_micro_batches, merge_over_dp, on_device

_SUMS = ("loss_sum", "clipped", "trained_tokens")


@dataclass(frozen=True)
class CriticSettings:
    """How the trainer ranks build the critic: the checkpoint, its optimizer and LR schedule."""

    hf_path: str  # HF checkpoint of the backbone (the head starts fresh)
    optimizer: OptimizerSettings


def build_critic(settings: CriticSettings, layout, model):
    """This rank's critic (a model_setup.TrainableModel) for ``layout``; ``model``: the policy's
    models.bridge.ModelSettings (layer implementation, dispatcher, recompute), without routing replay or LoRA."""
    from megarl.trainer.model_setup import build_trainable

    backbone = dataclasses.replace(model, routing_replay=False, reference=False, lora=None,
                                   moe_expert_bias_update_rate=None)
    return build_trainable(settings.hf_path, layout, settings.optimizer, backbone, value_head=True)


def _token_values(output: torch.Tensor, mi: ModelInput) -> torch.Tensor:
    """The head's output [b, s, 1] -> float32 values at every ragged position of the micro-batch, [n]
    (gathered over the CP ranks, differentiable)."""
    local = mi.local_index
    rows = (local >= 0).nonzero().squeeze(1)
    picked = output.reshape(-1)[local[rows]].float()
    return mi.to_ragged(picked, rows)


def critic_values(chunks: list, batch: RLBatch, batching: MicroBatching) -> torch.Tensor | None:
    """The critic's value at every position of ``batch``, float32 [N] on the host (0 off the trained
    positions), from one forward-only pass: the whole batch on every rank of the last PP stage
    (gathered over DP), None elsewhere; a collective of every rank."""
    from megatron.core import parallel_state

    plan, dp_rank, micro = local_micro_batches(batch, batching)
    collected: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        mb, mi = on_device(model, *next(data_iterator))
        output = model(mi.tokens, mi.position_ids, None, packed_seq_params=mi.packed_seq_params)

        def keep(out):
            collected.append((_token_values(out, mi) * mb.loss_mask).detach())
            return out.sum() * 0, {}

        return output, keep

    with torch.no_grad():
        forward_backward(chunks, micro, forward_step, True, micro[0][1].row_length)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = {}
    for indices, (mb, _), flat in zip(plan.per_rank[dp_rank], micro, collected):
        local.update(zip(indices, flat.cpu().split(mb.lengths.tolist())))
    merged = merge_over_dp(local)
    return torch.cat([merged[i] for i in range(len(batch))])


def _value_loss(output: torch.Tensor, mb: RLBatch, mi: ModelInput, clip: float, device) -> tuple:
    """megatron's loss-function triple of one micro-batch: (summed clipped value loss, its trained-token
    count, {"sums": float64 [loss, clipped tokens, trained tokens]})."""
    if len(mb) == 0:  # a padding-only micro-batch (a DP rank with fewer samples than micro-batches)
        return output.sum() * 0, torch.zeros((), dtype=torch.int, device=device), {
            "sums": torch.zeros(len(_SUMS), dtype=torch.float64, device=device)}
    cu = mb.cu_seqlens
    values = to_grid(_token_values(output, mi), cu)
    mask = to_grid(mb.loss_mask, cu)
    loss = clipped_value_loss(values, to_grid(mb.old_values, cu), to_grid(mb.returns, cu), mask, clip)
    loss_sum, trained = loss.per_token.sum(), (mask > 0).sum()
    sums = torch.stack([loss_sum.detach().double(), loss.clipped.sum().double(), trained.double()])
    num_tokens = trained.to(torch.int)
    if mi.split is not None:  # every CP rank holds the whole loss: split its count (context_parallel)
        num_tokens = token_count_share(num_tokens, mi.split.cp)
    return loss_sum, num_tokens, {"sums": sums}


def critic_step(chunks: list, optimizer, scheduler, batch: RLBatch, batching: MicroBatching,
                value_clip: float) -> RLStepResult:
    """One critic update on ``batch`` (identical on every rank; each DP rank trains its share), which must
    carry ``old_values`` and ``returns``. Metrics (last PP stage): ``critic/value_loss`` (token mean of the
    clipped loss), ``critic/value_clipfrac`` (share of trained tokens where the clipped term was the
    larger), ``critic/grad_norm``."""
    from megatron.core import parallel_state

    from megarl.trainer.optimizer import optimizer_step

    if batch.old_values is None or batch.returns is None:
        raise ValueError("a critic step needs the batch's old_values and returns (critic_values, then ragged_gae)")
    device = model_device(chunks)
    plan, _, micro = local_micro_batches(batch, batching)

    def forward_step(data_iterator, model):
        mb, mi = on_device(model, *next(data_iterator))
        output = model(mi.tokens, mi.position_ids, None, packed_seq_params=mi.packed_seq_params)
        return output, lambda out: _value_loss(out, mb, mi, value_clip, device)

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reduced = forward_backward(chunks, micro, forward_step, False, plan.length)
    applied, grad_norm = optimizer_step(optimizer, scheduler)
    metrics = {"critic/grad_norm": grad_norm}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = torch.stack([r["sums"] for r in reduced]).sum(0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        loss, clipped, tokens = totals.tolist()
        metrics |= {"critic/value_loss": loss / max(tokens, 1.0), "critic/value_clipfrac": clipped / max(tokens, 1.0)}
    return RLStepResult(grad_norm=grad_norm, applied=applied, metrics=metrics)
