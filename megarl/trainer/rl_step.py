"""One RL update on Megatron: log-probs of the engine's actions through the engine's experts
(Keep Routing) over the engine's action space (Keep Sampling Mask), the configured policy loss,
and one optimizer step. Runs on every trainer rank with the same global :class:`RLBatch`.

The log-probs are taken from vocab-parallel logits (each TP rank holds V/tp columns); Megatron's
padded vocabulary ids (>= the model's real vocabulary) are excluded from the softmax. The experts
are the engine's (replayed, also under activation recompute) or, without replay, the trainer's own,
compared with the engine's (:mod:`megarl.trainer.routing_replay`).

Micro-batches are packed (THD, no padding, DP ranks balanced by tokens) or padded rows
(:mod:`megarl.trainer.packing`); the per-token results go back to the ragged layout and the loss is
computed on per-sample rows, so both give the same numbers. Under context parallelism each CP rank
feeds the model its part of every micro-batch, replays its own tokens' experts, and the per-token
log-probs are all-gathered back onto whole rows (:mod:`megarl.trainer.context_parallel`, which also
says how the loss's token count is split so that the gradient is the cp=1 one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from megarl.algos.aggregation import ROW_WEIGHTED, prompt_mean_weights
from megarl.algos.is_diagnostics import MAXIMA, SEQUENCE_SUMS, TOKEN_SUMS, diagnostics
from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.settings import AlgorithmConfig
from megarl.trainer.context_parallel import ContextParallelRank, row_length_multiple, this_cp_rank, token_count_share
from megarl.trainer.device import collective_device, model_device
from megarl.trainer.expert_load import ExpertLoad, LoadCounter
from megarl.trainer.logprobs import csr_rows, vocab_parallel_logprobs
from megarl.trainer.micro_batching import MicroBatching
from megarl.trainer.mismatch import empty_mismatch, mismatch_metrics, mismatch_sums, reduce_mismatch
from megarl.trainer.packing import (
    MicroBatchPlan,
    ModelInput,
    micro_batch_count_multiple,
    model_input,
    plan_micro_batches,
    to_grid,
)
from megarl.trainer.reference import ReferenceWeights
from megarl.trainer.rl_batch import RLBatch, check_routing
from megarl.trainer.routing_replay import Replay, StepRouting, replay_routers
from megarl.trainer.score_support import SupportLogprobs, centering_grid, recorded_support


@dataclass
class RLStepResult:
    grad_norm: float
    applied: bool
    metrics: dict[str, float] = field(default_factory=dict)  # global-batch means (last PP stage)
    expert_load: ExpertLoad | None = None  # the step's expert load, when it compared routes (every rank)


def _token_logprobs(logits: torch.Tensor, mb: RLBatch, mi: ModelInput, vocab_size: int, temperature: float,
                    rows: torch.Tensor | None = None, support_head: int | None | bool = False):
    """Masked log-probs and unmasked entropy, ragged [n], of the temperature-scaled distribution
    (the one the engine sampled from) from this rank's logits [b, s, V/tp], and the count of sampled
    tokens outside their sampling mask (int scalar; they are kept, see ``vocab_parallel_logprobs``).
    ``rows`` (int64 [m] ragged positions): compute only there and leave 0 elsewhere (the loss needs
    its trained tokens only); None: every position. Under context parallelism each CP rank computes
    its own tokens and the results are all-gathered (differentiably) over the CP group. ``support_head``
    (False: not asked; None: every recorded id; k: each row's k most probable): a fourth result, the
    ids' :class:`SupportLogprobs` at the ``rows``, for score centering (not under context parallelism)."""
    from megatron.core import parallel_state

    b, s, shard = logits.shape
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * shard
    local = mi.local_index
    rows = (local >= 0).nonzero().squeeze(1) if rows is None else rows[local[rows] >= 0]
    picked = logits.reshape(b * s, shard)[local[rows]].float() / temperature
    padded = torch.arange(vocab_start, vocab_start + shard, device=logits.device) >= vocab_size
    if padded.any():  # megatron's vocabulary padding is not part of the policy
        picked = picked.masked_fill(padded, torch.finfo(torch.float32).min)
    mask = None if mb.sampling_mask is None else csr_rows(mb.sampling_mask, rows)
    support = None if support_head is False else recorded_support(mask, support_head, mi.split is not None)
    out = vocab_parallel_logprobs(picked, vocab_start, mb.targets[rows], mask,
                                  parallel_state.get_tensor_model_parallel_group(), support)
    outside = out.outside_mask
    if mi.split is not None:
        torch.distributed.all_reduce(outside, group=mi.split.cp.group)
    found = mi.to_ragged(out.logprobs, rows), mi.to_ragged(out.entropy, rows), outside
    if support is None:
        return found
    return *found, SupportLogprobs.of(out.support_logprobs, support, rows)


def micro_batches(batch: RLBatch, plan, rank: int, pad_id: int,
                  cp: ContextParallelRank | None = None) -> list[tuple[RLBatch, ModelInput]]:
    """DP rank ``rank``'s micro-batches of ``plan``: each its samples and its model input (this CP
    rank's part of it with ``cp``), on the host. A forward step moves its micro-batch to the model's
    device when the schedule reaches it (:func:`on_device`)."""
    out = []
    for indices in plan.per_rank[rank]:
        mb = batch.select(indices)
        out.append((mb, model_input(mb.cu_seqlens, mb.tokens, pad_id, plan.length, plan.packed, cp)))
    return out


def on_device(model, mb: RLBatch, mi: ModelInput) -> tuple[RLBatch, ModelInput]:
    """The micro-batch ``mb`` and its model input ``mi`` on the device of ``model`` (one chunk), for the
    forward step the schedule runs now: a rank's device then holds the micro-batches whose forward or
    backward is under way (one at a time without pipeline stages), not its whole share of the step
    (routes, sampling masks and log-probs included). Under virtual pipeline stages each chunk's forward
    of a micro-batch moves it again."""
    device = model_device([model])
    return mb.to(device), mi.to(device)


def local_micro_batches(batch: RLBatch, batching: MicroBatching
                        ) -> tuple[MicroBatchPlan, int, list[tuple[RLBatch, ModelInput]]]:
    """The plan of every DP rank for ``batch`` (host tensors) cut as ``batching`` says, this rank's DP index,
    and this rank's micro-batches on the host; the CP ranks of one DP rank share its micro-batches, each
    holding its part."""
    from megatron.core import parallel_state

    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = this_cp_rank()
    cp_size = 1 if cp is None else cp.size
    plan = plan_micro_batches(batch.lengths, dp, batching.max_tokens, pack=batching.pack, cp=cp_size,
                              length_multiple=row_length_multiple(cp_size, tp, batching.sequence_parallel),
                              count_multiple=micro_batch_count_multiple())
    return plan, dp_rank, micro_batches(batch, plan, dp_rank, batching.pad_id, cp)


def forward_backward(chunks, micro: list, forward_step, forward_only: bool, length: int):
    """megatron's pipeline schedule over ``micro`` ((batch, ModelInput, ...) tuples) of rows of ``length``;
    its per-micro-batch loss-function outputs (last PP stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b = micro[0][1].shape[0]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro), model=chunks,
        num_microbatches=len(micro), seq_length=length, micro_batch_size=b, forward_only=forward_only)


def reference_logprobs(chunks: list, micro: list, *, vocab_size: int, temperature: float,
                       replay: bool, sequence_parallel: bool, trained_only: bool = False) -> list[torch.Tensor | None]:
    """Forward-only log-probs (ragged [n] per micro-batch, last PP stage; None elsewhere) of the
    weights the model holds now, with the same routing replay and sampling mask as the step;
    ``trained_only``: at the trained positions (``loss_mask > 0``) only, 0 elsewhere."""
    from megatron.core import parallel_state

    routers = replay_routers() if replay else []
    replayer = Replay(routers, sequence_parallel, count_agreement=False) if routers else None
    collected: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        mb, mi = on_device(model, *next(data_iterator))
        if replayer is not None:
            logits = replayer.forward(model, mb, mi)
        else:
            logits = model(mi.tokens, mi.position_ids, None, packed_seq_params=mi.packed_seq_params)

        def keep(output):
            rows = (mb.loss_mask > 0).nonzero().squeeze(1) if trained_only else None
            collected.append(_token_logprobs(output, mb, mi, vocab_size, temperature, rows)[0].detach())
            return output.sum() * 0, {}

        return logits, keep

    try:
        with torch.no_grad():
            forward_backward(chunks, micro, forward_step, True, micro[0][1].row_length)
    finally:
        if replayer is not None:
            replayer.close()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return [None] * len(micro)
    return collected


def sequence_kl(chunks: list, batch: RLBatch, kl_type: str, reference: ReferenceWeights,
                batching: MicroBatching) -> list[float] | None:
    """Per sample, the sum over its trained tokens of the KL estimator ``kl_type`` between the
    policy the model holds and ``reference`` (both forward-only, same replay and mask): the penalty
    ``algorithm.kl_in_reward`` takes from the reward. The whole list on the last PP stage, else None."""
    from megatron.core import parallel_state

    from megarl.algos.kl import kl_penalty

    plan, dp_rank, micro = local_micro_batches(batch, batching)
    kwargs = dict(vocab_size=batching.vocab_size, temperature=batching.temperature, replay=batching.keep_routing,
                  sequence_parallel=batching.sequence_parallel)
    current = reference_logprobs(chunks, micro, **kwargs)
    with reference.swapped_in():
        ref = reference_logprobs(chunks, micro, **kwargs)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = {}
    for indices, (mb, _), mine, theirs in zip(plan.per_rank[dp_rank], micro, current, ref):
        if indices:
            lp, rlp = to_grid(mine, mb.cu_seqlens), to_grid(theirs, mb.cu_seqlens)
            per_token = kl_penalty(kl_type, lp, rlp, lp) * to_grid(mb.loss_mask, mb.cu_seqlens)
            local.update(zip(indices, per_token.sum(1).tolist()))
    merged = merge_over_dp(local)
    return [merged[i] for i in range(len(batch))]


def merge_over_dp(local: dict) -> dict:
    """The union of every data-parallel rank's ``local`` {sample index: value} (a collective of the DP group)."""
    from megatron.core import parallel_state

    gathered = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(gathered, local, group=parallel_state.get_data_parallel_group())
    return {i: value for part in gathered for i, value in part.items()}


def policy_logprobs(chunks: list, batch: RLBatch, batching: MicroBatching) -> torch.Tensor | None:
    """The log-probs of the weights the model holds now at every trained position of ``batch``: float32 [N]
    on the host, 0 off the trained positions (:attr:`RLBatch.old_logprobs`), from one forward-only pass with
    the step's routing replay and sampling mask. The PPO ratio's old policy of every mini-batch of a step
    (``algorithm.old_policy=recompute``), taken before the first. The whole batch on every rank of the last
    PP stage (gathered over DP), None elsewhere; a collective of every rank."""
    from megatron.core import parallel_state

    plan, dp_rank, micro = local_micro_batches(batch, batching)
    per_micro = reference_logprobs(chunks, micro, vocab_size=batching.vocab_size, temperature=batching.temperature,
                                   replay=batching.keep_routing, sequence_parallel=batching.sequence_parallel,
                                   trained_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = {}
    for indices, (mb, _), flat in zip(plan.per_rank[dp_rank], micro, per_micro):
        rows = flat.float().cpu().split(mb.lengths.tolist())
        local.update(zip(indices, rows))
    merged = merge_over_dp(local)
    return torch.cat([merged[i] for i in range(len(batch))])


_BY_DENOMINATOR = ("loss_sum", "pg_loss", "kl")
_BY_SEQUENCES = ("rejected_sequences",)
_BY_TOKENS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction", "cov_fraction",
              "is_weight_mean", "rejected_tokens", "ppo_kl", "entropy_tokens")
_CISPO_SUMS, _CISPO_MAXIMA = ("cispo/ratio_mean", "cispo/ratio_clamped_mean"), ("cispo/ratio_max", "cispo/ratio_min")
_CENTERING_SUMS = ("score_centering/support_tv", "score_centering/head_mass")


def step_sum_keys(algo: AlgorithmConfig) -> list[str]:
    """The per-micro-batch sums one RL step reduces (the same on every rank for one config): the
    loss's parts (:class:`megarl.algos.objective.LossOutput`, with the importance-weight diagnostics'
    sums) and the trained tokens' entropy."""
    kl = ("kl",) if algo.kl_coef != 0.0 and not algo.kl_in_reward else ()
    cispo = _CISPO_SUMS if algo.policy_loss == "cispo" else ()
    centred = _CENTERING_SUMS if algo.score_centering != "none" else ()
    return [*_BY_DENOMINATOR[:2], *kl, *_BY_TOKENS, *_BY_SEQUENCES, *TOKEN_SUMS, *SEQUENCE_SUMS, *cispo, *centred,
            "denominator", "trained_tokens", "trained_sequences", "kept_tokens"]


def step_max_keys(algo: AlgorithmConfig) -> list[str]:
    """The per-micro-batch maxima one RL step reduces (:attr:`megarl.algos.objective.LossOutput.maxima`)."""
    return [*MAXIMA, *(_CISPO_MAXIMA if algo.policy_loss == "cispo" else ())]


def step_metrics(totals: dict[str, float], maxima: dict[str, float] | None = None) -> dict[str, float]:
    """Batch metrics from the summed parts and the reduced maxima: ``loss``, ``pg_loss``, ``kl`` over the loss's
    denominator; the clip and rejection fractions, ``is_weight_mean``, ``ppo_kl`` (trainer against the PPO
    ratio's old policy), ``entropy`` (mean over trained tokens) and ``score_centering/*`` over trained tokens;
    ``rejected_sequences`` over trained sequences; ``cispo/*`` over the tokens in the loss; ``off_policy/*``, the
    importance-weight diagnostics of the trainer against the rollout engine
    (:func:`megarl.algos.is_diagnostics.diagnostics`)."""
    maxima = maxima or {}
    denominator = max(totals["denominator"], 1.0)
    tokens, sequences = max(totals["trained_tokens"], 1.0), max(totals["trained_sequences"], 1.0)
    out = {("loss" if k == "loss_sum" else k): totals[k] / denominator for k in _BY_DENOMINATOR if k in totals}
    out |= {("entropy" if k == "entropy_tokens" else k): totals[k] / tokens for k in _BY_TOKENS}
    out |= {k: totals[k] / sequences for k in _BY_SEQUENCES}
    out |= {k: totals[k] / tokens for k in _CENTERING_SUMS if k in totals}
    if "cispo/ratio_mean" in totals and totals["kept_tokens"] > 0:
        out |= {k: totals[k] / totals["kept_tokens"] for k in _CISPO_SUMS}
        out |= {"cispo/ratio_max": maxima["cispo/ratio_max"], "cispo/ratio_min": -maxima["cispo/ratio_min"]}
    found = diagnostics(totals, maxima, totals["trained_tokens"], totals["trained_sequences"]) if maxima else {}
    return out | {f"off_policy/{k}": v for k, v in found.items()}


def _old_policy(algo: AlgorithmConfig, mb: RLBatch, logprobs: torch.Tensor) -> torch.Tensor:
    """The PPO ratio's old policy [b, t] for the micro-batch ``mb`` whose current log-probs are ``logprobs``:
    the engine's (``old_policy=rollout``), the recomputed pre-step ones (``mb.old_logprobs``), or, for a step
    of one update, the current ones detached (the same weights and inputs as the recompute pass)."""
    if algo.old_policy == "rollout":
        return to_grid(mb.rollout_logprobs, mb.cu_seqlens)
    return logprobs.detach() if mb.old_logprobs is None else to_grid(mb.old_logprobs, mb.cu_seqlens)


def rl_step(chunks: list, optimizer, scheduler, batch: RLBatch, algo: AlgorithmConfig, batching: MicroBatching,
            reference: ReferenceWeights | None = None) -> RLStepResult:
    """One update on ``batch`` (identical on every rank; each DP rank trains its share), cut and run as
    ``batching`` says.

    ``batching.keep_routing`` replays ``batch.routed_experts`` (the model must be built with routing replay).
    ``reference``: the frozen reference policy
    whose log-probs (same replay and mask) the KL term of ``algo`` needs when ``kl_coef != 0``.
    The PPO ratio's old policy: ``batch.old_logprobs`` when set (:func:`policy_logprobs` before the step's
    first update, for a step of several), else the current log-probs (a step of one update), or the
    engine's under ``algo.old_policy=rollout``.
    Metrics: :func:`step_metrics` (loss, clip and rejection fractions, IS weight, entropy, importance-weight
    diagnostics), the train-inference mismatch over fresh tokens and the drift over stale ones
    (:func:`megarl.trainer.mismatch.mismatch_metrics`, of the policy before the step), ``routing/agreement`` (share
    of valid token-layer pairs where the trainer's own router picks the engine's expert set: recorded
    when routing is not replayed, computed beside the replay when it is), ``perf/padding_frac``
    (padding share of the model's input positions) and ``perf/dp_token_imbalance`` (max / mean real tokens per DP rank).
    ``expert_load``: both sides' tokens per expert and layer when routes were compared
    (:mod:`megarl.trainer.expert_load`).
    """
    from megarl.trainer.optimizer import optimizer_step

    load = LoadCounter.for_model(chunks) if batch.routed_experts is not None and replay_routers() else None
    vocab_size, temperature, keep_routing = batching.vocab_size, batching.temperature, batching.keep_routing
    routing = StepRouting(keep_routing, batch.routed_experts is not None, batching.sequence_parallel, load)
    _check_step_inputs(chunks, batch, algo, reference, routing)
    plan, _, micro = local_micro_batches(batch, batching)
    refs = [None] * len(micro)
    if reference is not None and algo.kl_coef != 0.0 and not algo.kl_in_reward:
        with reference.swapped_in():
            refs = reference_logprobs(chunks, micro, vocab_size=vocab_size, temperature=temperature,
                                      replay=keep_routing, sequence_parallel=batching.sequence_parallel)
    setup = LossSetup(algo, step_sum_keys(algo), step_max_keys(algo), vocab_size, temperature,
                      prompt_weights_by_group(batch, algo, model_device(chunks)))
    loss = partial(_micro_batch_loss, setup=setup)

    def forward_step(data_iterator, model):
        mb, mi, ref = next(data_iterator)
        mb, mi = on_device(model, mb, mi)
        return routing.forward(model, mb, mi), partial(loss, mb=mb, mi=mi, ref=ref)

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with routing:
        reduced = forward_backward(chunks, [(mb, mi, ref) for (mb, mi), ref in zip(micro, refs)], forward_step,
                                   False, plan.length)
    applied, grad_norm = optimizer_step(optimizer, scheduler)
    metrics = {"perf/padding_frac": plan.padding_frac(batch.lengths),
               "perf/dp_token_imbalance": plan.imbalance(batch.lengths)}
    return RLStepResult(grad_norm=grad_norm, applied=applied,
                        metrics=metrics | _reduced_metrics(reduced, setup, routing),
                        expert_load=None if load is None else load.reduced(batching.sequence_parallel))


@dataclass(frozen=True)
class LossSetup:
    """What every micro-batch's loss function of one step shares: the algorithm, the keys of the sums and maxima it
    returns (:func:`step_sum_keys`, :func:`step_max_keys`), the vocabulary, the sampling temperature, and
    ``loss_agg=prompt_mean``'s row weight of each prompt group (:func:`prompt_weights_by_group`) or None."""

    algo: AlgorithmConfig
    sum_keys: list[str]
    max_keys: list[str]
    vocab_size: int
    temperature: float
    group_weights: torch.Tensor | None = None


def prompt_weights_by_group(batch: RLBatch, algo: AlgorithmConfig, device: torch.device) -> torch.Tensor | None:
    """``loss_agg=prompt_mean``: the row weight of each of ``batch``'s prompt groups (indexed by group id, on
    ``device``; :func:`megarl.algos.aggregation.prompt_mean_weights` over the whole batch), else None."""
    if algo.loss_agg not in ROW_WEIGHTED:
        return None
    if batch.group_ids is None:
        raise ValueError(f"loss_agg={algo.loss_agg} needs the samples' prompt groups (RLBatch.group_ids)")
    trained = torch.zeros(len(batch), dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(len(batch)), batch.lengths), (batch.loss_mask > 0).double())
    table = torch.zeros(int(batch.group_ids.max()) + 1, dtype=torch.float64)
    table[batch.group_ids] = prompt_mean_weights(batch.group_ids, trained)
    return table.to(device)


def _check_step_inputs(chunks: list, batch: RLBatch, algo: AlgorithmConfig, reference: ReferenceWeights | None,
                       routing: StepRouting) -> None:
    """ValueError when ``batch``'s routes do not fit the model, or the KL term has no reference policy."""
    from megatron.core.utils import get_model_config

    if routing.routers and batch.routed_experts is not None:
        config = get_model_config(chunks[0])
        check_routing(batch.routed_experts, config.num_layers, config.num_moe_experts)
    if algo.kl_coef != 0.0 and reference is None:
        raise ValueError("algorithm.kl_coef != 0 needs the reference policy (built with the trainer)")


def _micro_batch_loss(output: torch.Tensor, *, mb: RLBatch, mi: ModelInput, ref: torch.Tensor | None,
                      setup: LossSetup):
    """megatron's loss function of one micro-batch ``mb`` (model input ``mi``, reference log-probs ``ref``
    or None) on this rank's logits ``output``: (loss sum, token count, {"sums": float64 [len(sum_keys)],
    "maxima": float64 [len(max_keys)], "mismatch": the train-inference mismatch sums}), all on the logits' device."""
    device = output.device
    algo: AlgorithmConfig = setup.algo
    if len(mb) == 0:  # a padding-only micro-batch (a DP rank with fewer samples than micro-batches)
        return output.sum() * 0, torch.zeros((), dtype=torch.int, device=device), {
            "sums": torch.zeros(len(setup.sum_keys), dtype=torch.float64, device=device),
            "maxima": torch.full((len(setup.max_keys),), -float("inf"), dtype=torch.float64, device=device),
            "mismatch": empty_mismatch(device)}
    head = False if algo.score_centering == "none" else (
        algo.score_centering_head if algo.score_centering == "tail" else None)
    found = _token_logprobs(output, mb, mi, setup.vocab_size, setup.temperature,
                            rows=(mb.loss_mask > 0).nonzero().squeeze(1), support_head=head)
    flat_lp, flat_ent, outside = found[:3]
    logprobs, entropy = to_grid(flat_lp, mb.cu_seqlens), to_grid(flat_ent, mb.cu_seqlens)
    advantages = mb.advantages if mb.token_advantages is None else to_grid(mb.position_advantages(), mb.cu_seqlens)
    inputs = LossInputs(
        logprobs=logprobs, old_logprobs=_old_policy(algo, mb, logprobs), loss_mask=to_grid(mb.loss_mask, mb.cu_seqlens),
        advantages=advantages, entropy=entropy, rollout_logprobs=to_grid(mb.rollout_logprobs, mb.cu_seqlens),
        ref_logprobs=None if ref is None else to_grid(ref, mb.cu_seqlens),
        row_weights=None if setup.group_weights is None else setup.group_weights[mb.group_ids],
        centering=None if head is False else centering_grid(found[3], algo.score_centering, len(mb.tokens),
                                                             mb.cu_seqlens),
    )
    out = rl_loss(inputs, algo)
    parts = {**out.sums, "loss_sum": out.loss_sum.detach(), "denominator": out.denominator_share,
             "trained_tokens": out.trained_tokens, "trained_sequences": out.trained_sequences,
             "entropy_tokens": flat_ent.detach()[mb.loss_mask > 0].sum()}
    sums = torch.stack([parts[k].double() for k in setup.sum_keys])
    maxima = torch.stack([out.maxima[k].double() for k in setup.max_keys]).to(device)
    before = flat_lp if mb.old_logprobs is None else mb.old_logprobs  # the policy before the step
    mismatch = mismatch_sums(before, mb.rollout_logprobs, mb.loss_mask, mb.staleness, outside, mb.cu_seqlens)
    num_tokens = out.denominator_share.round().to(torch.int)
    if mi.split is not None:  # every CP rank holds the whole loss: split its count (context_parallel)
        num_tokens = token_count_share(num_tokens, mi.split.cp)
    return out.loss_sum, num_tokens, {"sums": sums, "maxima": maxima, "mismatch": mismatch}


def _reduced_metrics(reduced: list[dict], setup: LossSetup, routing: StepRouting) -> dict[str, float]:
    """The step's loss, diagnostics and mismatch metrics over the DP group (last PP stage; {} elsewhere), and
    ``routing/agreement`` over every rank when ``routing`` measured it; collectives."""
    from megatron.core import parallel_state

    metrics = {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dp_group = parallel_state.get_data_parallel_group()
        totals = torch.stack([r["sums"] for r in reduced]).sum(0)
        torch.distributed.all_reduce(totals, group=dp_group)
        maxima = torch.stack([r["maxima"] for r in reduced]).amax(0)
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        metrics |= step_metrics(dict(zip(setup.sum_keys, totals.tolist())), dict(zip(setup.max_keys, maxima.tolist())))
        metrics |= mismatch_metrics(reduce_mismatch([r["mismatch"] for r in reduced], dp_group))
    if routing.measured:
        counts = torch.tensor(routing.counts, device=collective_device())
        torch.distributed.all_reduce(counts)
        metrics["routing/agreement"] = float(counts[0] / counts[1].clamp(min=1))
    return metrics
