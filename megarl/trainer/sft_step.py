"""One training step on Megatron: forward/backward over micro-batches (any PP schedule), then the
optimizer. The loss is a token mean over the whole global batch, across micro-batches and DP ranks
(megatron's ``calculate_per_token_loss``), so every layout computes the same number."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.trainer.token_batch import TokenBatch, data_parallel_slice, micro_batches


@dataclass
class StepResult:
    loss: float  # token-mean loss of the global batch (NaN on ranks that are not the last PP stage)
    grad_norm: float  # before clipping
    tokens: int  # loss tokens in the global batch
    applied: bool


def _token_loss_step(data_iterator, model):
    mb: TokenBatch = next(data_iterator)
    per_token = model(mb.tokens, mb.position_ids, None, labels=mb.labels)  # [b, s] on the last stage

    def loss_func(output):
        loss_sum = (output.float() * mb.loss_mask).sum()
        tokens = mb.loss_mask.sum().to(torch.int)
        return loss_sum, tokens, {"loss_sum": torch.stack([loss_sum.detach(), tokens.float()])}

    return per_token, loss_func


def supervised_step(chunks: list, optimizer, scheduler, batch: TokenBatch, max_tokens_per_microbatch: int) -> StepResult:
    """Token-mean cross-entropy on ``batch`` (the global batch, identical on every rank), one update."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.trainer.optimizer import optimizer_step

    local = data_parallel_slice(batch, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
    mbs = micro_batches(local, max_tokens_per_microbatch)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reduced = get_forward_backward_func()(
        forward_step_func=_token_loss_step, data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs),
        model=chunks, num_microbatches=len(mbs), seq_length=local.tokens.shape[1],
        micro_batch_size=len(mbs[0]), forward_only=False,
    )
    applied, grad_norm = optimizer_step(optimizer, scheduler)
    loss, tokens = float("nan"), int(batch.loss_mask.sum())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = torch.stack([r["loss_sum"] for r in reduced]).sum(0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        loss = float(totals[0] / totals[1])
    return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, applied=applied)
