"""One supervised training step on Megatron: forward/backward over micro-batches (any PP schedule),
then the optimizer. The loss is a token mean over the whole global batch, across micro-batches and
DP ranks (megatron's ``calculate_per_token_loss``), so every layout computes the same number.
Micro-batches are packed or padded rows as in the RL step (:mod:`megarl.trainer.packing`), each moved
to the model's device when its forward step runs; the reduced loss lives on the data-parallel group's device. Under
context parallelism each CP rank returns the loss sum and count of its own tokens, which megatron
adds up over the DP×CP group."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.trainer.context_parallel import row_length_multiple, this_cp_rank
from megarl.trainer.device import model_device
from megarl.trainer.packing import micro_batch_count_multiple, model_input, plan_micro_batches
from megarl.trainer.token_batch import TokenBatch


@dataclass
class StepResult:
    loss: float  # token-mean loss of the global batch (NaN on ranks that are not the last PP stage)
    grad_norm: float  # before clipping
    tokens: int  # loss tokens in the global batch
    applied: bool


def _token_loss_step(pad_id: int):
    def forward_step(data_iterator, model):
        device = model_device([model])
        mb, mi = (part.to(device) for part in next(data_iterator))
        per_token = model(mi.tokens, mi.position_ids, None, labels=mi.scatter(mb.labels, pad_id),
                          packed_seq_params=mi.packed_seq_params)  # [b, s] on the last stage

        def loss_func(output):
            local = mi.local_index
            held = local >= 0  # this CP rank's tokens (all of them without CP)
            loss_mask = mb.loss_mask[held]
            loss_sum = (output.reshape(-1)[local[held]].float() * loss_mask).sum()
            tokens = loss_mask.sum().to(torch.int)
            return loss_sum, tokens, {"loss_sum": torch.stack([loss_sum.detach(), tokens.float()])}

        return per_token, loss_func

    return forward_step


def supervised_step(chunks: list, optimizer, scheduler, batch: TokenBatch, max_tokens_per_microbatch: int, *,
                    pack: bool = True, pad_id: int = 0) -> StepResult:
    """Token-mean cross-entropy on ``batch`` (the global batch, identical on every rank), one update;
    ``pack``: packed micro-batches (else padded rows)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megarl.trainer.optimizer import optimizer_step

    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    cp = this_cp_rank()
    cp_size = 1 if cp is None else cp.size
    multiple = row_length_multiple(cp_size, parallel_state.get_tensor_model_parallel_world_size(),
                                   get_model_config(chunks[0]).sequence_parallel)
    plan = plan_micro_batches(batch.lengths, dp, max_tokens_per_microbatch, pack=pack, length_multiple=multiple,
                              cp=cp_size, count_multiple=micro_batch_count_multiple())
    micro = []
    for indices in plan.per_rank[dp_rank]:  # built on the host, moved to the model's device by the forward step
        mb = batch.select(indices)
        micro.append((mb, model_input(mb.cu_seqlens, mb.tokens, pad_id, plan.length, plan.packed, cp)))
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reduced = get_forward_backward_func()(
        forward_step_func=_token_loss_step(pad_id),
        data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
        model=chunks, num_microbatches=len(micro), seq_length=plan.length, micro_batch_size=micro[0][1].shape[0],
        forward_only=False,
    )
    applied, grad_norm = optimizer_step(optimizer, scheduler)
    loss, tokens = float("nan"), int(batch.loss_mask.sum())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = torch.stack([r["loss_sum"] for r in reduced]).sum(0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        loss = float(totals[0] / totals[1])
    return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, applied=applied)
