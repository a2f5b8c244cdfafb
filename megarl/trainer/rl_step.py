"""One RL update on Megatron: log-probs of the engine's actions through the engine's experts
(Keep Routing) over the engine's action space (Keep Sampling Mask), the configured policy loss,
and one optimizer step. Runs on every trainer rank with the same global :class:`RLBatch`.

The log-probs are taken from vocab-parallel logits (each TP rank holds V/tp columns); Megatron's
padded vocabulary ids (>= the model's real vocabulary) are excluded from the softmax. Without
replay, the routing the trainer chose is recorded and compared with the engine's (agreement).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megarl.algos.aggregation import denominator_share
from megarl.algos.objective import LossInputs, rl_loss
from megarl.config.schema import AlgorithmConfig
from megarl.trainer.logprobs import vocab_parallel_logprobs
from megarl.trainer.rl_batch import RLBatch, check_routing
from megarl.trainer.token_batch import micro_batch_rows


@dataclass
class RLStepResult:
    grad_norm: float
    applied: bool
    metrics: dict[str, float] = field(default_factory=dict)  # global-batch means (last PP stage)


def _routers():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay.global_router_replay_instances


def local_replay_indices(routed: torch.Tensor, layer_number: int, sequence_parallel: bool) -> torch.Tensor:
    """Replay ids of one MoE layer for this rank: ``routed`` [b, S, L, k] -> [S_local * b, k] in
    megatron's sequence-major token order, the sequence slice of this TP rank under SP."""
    from megatron.core import parallel_state

    per_layer = routed[:, :, layer_number - 1, :].transpose(0, 1)  # [S, b, k]
    if sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        per_layer = per_layer.chunk(tp, dim=0)[rank]
    return per_layer.reshape(-1, per_layer.shape[-1]).contiguous()


def routing_agreement(recorded: list[torch.Tensor], routed: torch.Tensor, layer_numbers: list[int],
                      valid: torch.Tensor, sequence_parallel: bool) -> tuple[float, float]:
    """(matching token-layer pairs, valid pairs) where the trainer's top-k set equals the engine's."""
    match, total = 0.0, 0.0
    for rec, layer in zip(recorded, layer_numbers):
        engine = local_replay_indices(routed, layer, sequence_parallel).sort(-1).values
        mine = rec.sort(-1).values
        valid_local = local_replay_indices(valid[:, :, None, None].long(), 1, sequence_parallel)[:, 0].bool()
        equal = (engine == mine).all(-1) & valid_local
        match += float(equal.sum())
        total += float(valid_local.sum())
    return match, total


class ReplayAgreement:
    """Counts, during a replayed forward, how often the router's own top-k equals the replayed one.

    Wraps ``get_replay_topk`` of each RouterReplay instance (not megatron's class): in
    REPLAY_FORWARD it also runs the router's default top-k on the live scores and compares sets
    on the tokens marked valid by :meth:`set_valid`. Undone by :meth:`close`.
    """

    def __init__(self, routers: list):
        self.routers, self.matched, self.total = routers, 0.0, 0.0
        self._valid: list[torch.Tensor] = []
        for router in routers:
            router.get_replay_topk = self._wrap(router, router.get_replay_topk)

    def _wrap(self, router, original):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, replayed = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if router.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self._valid:
                with torch.no_grad():
                    _, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    valid = self._valid[self.routers.index(router)]
                    equal = (natural.sort(-1).values == replayed.sort(-1).values).all(-1) & valid
                    self.matched += float(equal.sum())
                    self.total += float(valid.sum())
            return probs, replayed

        return get_replay_topk

    def set_valid(self, valid_per_layer: list[torch.Tensor]) -> None:
        """bool [tokens] per router (this rank's token order) for the next forward."""
        self._valid = valid_per_layer

    def close(self) -> None:
        for router in self.routers:
            del router.get_replay_topk  # back to the class's method


def _token_logprobs(logits: torch.Tensor, mb: RLBatch, vocab_size: int, temperature: float):
    """Masked log-probs and unmasked entropy [b, S] of the temperature-scaled distribution (the one
    the engine sampled from) from this rank's logits [b, S, V/tp]."""
    from megatron.core import parallel_state

    b, S, shard = logits.shape
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * shard
    padded = torch.arange(vocab_start, vocab_start + shard) >= vocab_size
    logits = logits.float() / temperature
    if padded.any():  # megatron's vocabulary padding is not part of the policy
        logits = logits.masked_fill(padded, torch.finfo(torch.float32).min)
    out = vocab_parallel_logprobs(logits.reshape(b * S, shard), vocab_start, mb.targets.reshape(-1),
                                  mb.sampling_mask, parallel_state.get_tensor_model_parallel_group())
    return out.logprobs.view(b, S), out.entropy.view(b, S)


def rl_step(chunks: list, optimizer, scheduler, batch: RLBatch, algo: AlgorithmConfig, *, vocab_size: int,
            max_tokens_per_microbatch: int, keep_routing: bool, sequence_parallel: bool,
            temperature: float = 1.0, ref_logprobs: Optional[torch.Tensor] = None) -> RLStepResult:
    """One update on ``batch`` (identical on every rank; each DP rank trains its share).

    ``keep_routing`` replays ``batch.routed_experts`` (the model must be built with routing replay).
    Metrics: ``loss``, ``pg_loss``, ``clip_fraction``, ``mismatch/logprob_abs_diff`` (mean |trainer -
    rollout| log-prob over trained tokens, before the update), ``mismatch/kl`` (k3 estimate of
    KL(rollout || trainer)), ``mismatch/ratio_dev_max`` (max |trainer/rollout probability ratio - 1|
    over trained tokens: the PPO ratio's distance from 1 before the update), and
    ``routing/agreement`` (share of valid token-layer pairs where the trainer's own router picks the
    engine's expert set: recorded when routing is not replayed, computed beside the replay when it is).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.utils import get_model_config

    from megarl.trainer.optimizer import optimizer_step

    routers = _routers()
    if keep_routing and (batch.routed_experts is None or not routers):
        raise ValueError("keep_routing needs routed_experts in every sample and a model built with routing replay")
    if routers and batch.routed_experts is not None:
        config = get_model_config(chunks[0])
        check_routing(batch.routed_experts, config.num_layers, config.num_moe_experts)
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if len(batch) % dp:
        raise ValueError(f"{len(batch)} samples do not split over {dp} data-parallel ranks")
    denominator = float(denominator_share(algo.loss_agg, batch.loss_mask))
    per_rank = len(batch) // dp
    local = batch.rows(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    rows = micro_batch_rows(len(local), local.tokens.shape[1], max_tokens_per_microbatch)
    micro = [(local.rows(i, i + rows), i) for i in range(0, len(local), rows)]  # (micro-batch, first row)
    ref = None if ref_logprobs is None else ref_logprobs[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    record = not keep_routing and batch.routed_experts is not None and bool(routers)
    layer_numbers = [r.layer_number for r in routers]
    agreement = [0.0, 0.0]

    replay_agreement = ReplayAgreement(routers) if keep_routing else None

    def forward_step(data_iterator, model):
        mb, start = next(data_iterator)
        if keep_routing:
            RouterReplay.set_replay_data([local_replay_indices(mb.routed_experts, n, sequence_parallel) for n in layer_numbers])
            valid = (torch.arange(mb.tokens.shape[1]) < mb.num_positions[:, None])[:, :, None, None].long()
            replay_agreement.set_valid([local_replay_indices(valid, 1, sequence_parallel)[:, 0].bool()] * len(routers))
        logits = model(mb.tokens, mb.position_ids, None)
        if record:
            valid = torch.arange(mb.tokens.shape[1]) < mb.num_positions[:, None]
            matched, total = routing_agreement(RouterReplay.get_recorded_data(), mb.routed_experts, layer_numbers,
                                               valid, sequence_parallel)
            agreement[0] += matched
            agreement[1] += total

        def loss_func(output):
            logprobs, entropy = _token_logprobs(output, mb, vocab_size, temperature)
            inputs = LossInputs(
                logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=mb.advantages, loss_mask=mb.loss_mask,
                entropy=entropy, rollout_logprobs=mb.rollout_logprobs,
                ref_logprobs=None if ref is None else ref[start:start + len(mb)],
            )
            out = rl_loss(inputs, algo, denominator)
            trained = mb.loss_mask > 0
            diff = (logprobs.detach() - mb.rollout_logprobs)
            log_ratio = (mb.rollout_logprobs - logprobs.detach())
            stats = torch.stack([
                out.loss.detach() * denominator, out.metrics["pg_loss"] * denominator,
                out.metrics["clip_fraction"] * trained.sum(), diff.abs()[trained].sum(),
                (log_ratio.exp() - 1 - log_ratio)[trained].sum(), trained.sum().float(),
            ])
            ratio_dev = (-log_ratio).exp().sub(1).abs()[trained]
            ratio_dev_max = ratio_dev.max() if ratio_dev.numel() else torch.zeros(())
            return (out.loss * denominator, denominator_share(algo.loss_agg, mb.loss_mask).to(torch.int),
                    {"stats": stats, "ratio_dev_max": ratio_dev_max})

        return logits, loss_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if routers:
        RouterReplay.clear_global_indices()
        action = RouterReplayAction.REPLAY_FORWARD if keep_routing else RouterReplayAction.RECORD if record else None
        if action is None:
            RouterReplay.clear_global_router_replay_action()
        else:
            RouterReplay.set_global_router_replay_action(action)
    try:
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=chunks,
            num_microbatches=len(micro), seq_length=local.tokens.shape[1], micro_batch_size=rows, forward_only=False,
        )
    finally:
        if replay_agreement is not None:
            replay_agreement.close()
    if routers:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    if replay_agreement is not None:
        agreement = [replay_agreement.matched, replay_agreement.total]
    applied, grad_norm = optimizer_step(optimizer, scheduler)
    metrics: dict[str, float] = {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = torch.stack([r["stats"] for r in reduced]).sum(0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        tokens = max(float(totals[5]), 1.0)
        metrics = {
            "loss": float(totals[0]) / denominator, "pg_loss": float(totals[1]) / denominator,
            "clip_fraction": float(totals[2]) / tokens, "mismatch/logprob_abs_diff": float(totals[3]) / tokens,
            "mismatch/kl": float(totals[4]) / tokens,
        }
        ratio_dev_max = torch.stack([r["ratio_dev_max"] for r in reduced]).max()
        torch.distributed.all_reduce(ratio_dev_max, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_data_parallel_group())
        metrics["mismatch/ratio_dev_max"] = float(ratio_dev_max)
    if record or keep_routing:
        counts = torch.tensor(agreement)
        torch.distributed.all_reduce(counts)
        metrics["routing/agreement"] = float(counts[0] / counts[1].clamp(min=1))
    return RLStepResult(grad_norm=grad_norm, applied=applied, metrics=metrics)
