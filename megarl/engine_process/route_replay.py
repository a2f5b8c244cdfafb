"""SGLang recomputes a prefix with the routes it was computed with before (every platform).

After a weight update a retracted request is prefilled anew, and ``abort_resubmit`` sends prompt +
prefix again: on its own SGLang would route those positions afresh, under the new weights, while the
trainer replays each token's recorded routes, so every token sampled after the update would see a
context the trainer's forward does not. Here the positions that hold kept routes
(:mod:`megarl.engine_process.kept_routes`) are routed through them, as megatron-core's
``RouterReplay`` routes the trainer's (``moe_utils.topk_routing_with_score_function`` with
``REPLAY_FORWARD``): the router still computes its logits, the expert ids are the kept ones, and the
gate weights are the router's own scores at those ids (softmax over the gathered logits when the
top-k is renormalised, the full softmax's entries otherwise; sigmoid scores over their sum), scaled
as SGLang scales its own. Then one trainer forward with the recorded routes reproduces every token
(``tests/test_weight_update_mid_request.py``).

Where it acts, in SGLang 0.5.23:

- ``TpModelWorker.forward_batch_generation`` (:func:`forward_batch_generation`): an extend (or
  mixed) batch lays its requests' extend tokens end to end; the rows of positions a request keeps
  routes for become this forward's :class:`ForwardReplay` (ids and which rows) while the forward runs.
  Such a forward runs eagerly: a prefill CUDA graph (CUDA's default, "breakable") would replay the
  top-k it captured, so the worker's prefill graph runner is set aside for that forward.
- ``topk._post_process_topk_ids`` (:func:`post_process_topk_ids`): every ``select_experts`` path
  (CPU, CUDA's fused kernels, grouped and biased top-k) passes its logical ids and weights through it
  before the expert-location remap and the routed-experts capture, so the replayed ids are remapped
  and captured like chosen ones. Top-k outputs that skip it (CUDA's ``BYPASSED`` and Triton-kernel
  formats, a model's own fused gate such as Kimi-K3's) cannot replay: a forward that had rows to
  replay and routed none through it is refused with the reason (the engine stops, its log says why);
  so is one whose router packs its ids for the experts before the override (flashinfer mxfp4's fused
  gate, SGLang's experimental ``SGLANG_OPT_LORA_FUSED_TOPK_PACK``).
- DP attention: the MoE runs on every DP rank's tokens gathered in a buffer (SGLang's
  ``dp_gather_partial``), so every rank needs every rank's replayed rows. Each rank votes against the
  prefill CUDA graph for a batch it replays (``dp_attn._local_prefill_cuda_graph_vote``, a min over
  the ranks: none runs it), and in every eager forward of an extend step each rank places its rows
  in its slot of the gathered layout (:func:`dp_slot_start`) and the ranks sum them
  (:func:`gathered_replay`), the way ``_dp_gather_via_all_reduce`` gathers input ids.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megarl.engine_process.kept_routes import KEPT_ROUTES

OFF_ENV = "MEGARL_ROUTE_REPLAY"  # "off": the engine's entry point does not install the replay (a bench's baseline)
LORA_TOPK_PACK_ENV = "SGLANG_OPT_LORA_FUSED_TOPK_PACK"  # SGLang's experimental fused top-k + pack for LoRA MoE

_original_forward = None  # SGLang's functions, kept by install()
_original_post_process = None
_original_vote = None


@dataclass
class ForwardReplay:
    """The kept routes of one forward's MoE input rows, on the model's device: ``ids`` int32
    [N, L, k] (rows not replayed hold anything), ``replayed`` bool [N], and ``rerouted`` bool [N]:
    the replayed rows some layer's router would have routed elsewhere. ``gathered`` caches a
    DP-attention forward's rows of every rank (:func:`gathered_replay`), whose ``start`` is this rank's
    first row there; ``layers`` counts the layers replayed."""

    ids: torch.Tensor
    replayed: torch.Tensor
    rerouted: torch.Tensor
    gathered: ForwardReplay | None = None
    start: int = 0
    layers: int = 0


_active: ForwardReplay | None = None  # the forward in progress (set by forward_batch_generation)


def extend_replay(reqs, prefix_lens, extend_lens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(ids int32 [N, L, k], replayed bool [N], owner int64 [N]: the request of each row) on the host
    for a batch whose request ``i`` feeds positions ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])``
    (N their sum, in order); None when no position of the batch has kept routes."""
    pieces = [(getattr(req, KEPT_ROUTES, None), start, n) for req, start, n in zip(reqs, prefix_lens, extend_lens)]
    kept = [k for k, start, _ in pieces if k is not None and start < len(k)]
    if not kept:
        return None
    lengths = torch.tensor([n for _, _, n in pieces])
    ids = torch.zeros((int(lengths.sum()), *kept[0].shape[1:]), dtype=torch.int32)
    replayed = torch.zeros(len(ids), dtype=torch.bool)
    row = 0
    for routes, start, n in pieces:
        end = start if routes is None else min(start + n, len(routes))
        if end > start:
            ids[row:row + end - start] = routes[start:end]
            replayed[row:row + end - start] = True
        row += n
    return ids, replayed, torch.repeat_interleave(torch.arange(len(pieces)), lengths)


def replay_weights(logits: torch.Tensor, ids: torch.Tensor, scoring: str, renormalize: bool) -> torch.Tensor:
    """Gate weights float32 [n, k] of experts ``ids`` (int [n, k]) from router ``logits`` [n, E]: the
    router's scores at ``ids``, as megatron-core's replay takes them."""
    logits, ids = logits.float(), ids.long()
    if scoring == "softmax":
        if renormalize:
            return torch.softmax(logits.gather(1, ids), dim=-1)
        return torch.softmax(logits, dim=-1).gather(1, ids)
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits).gather(1, ids)
        return scores / (scores.sum(-1, keepdim=True) + 1e-20) if renormalize else scores
    raise NotImplementedError(f"route replay: router scoring {scoring!r} (softmax and sigmoid are replayed)")


def apply_replay(replay: ForwardReplay, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 logits: torch.Tensor, config) -> None:
    """Route ``replay``'s rows of MoE layer ``layer`` through their kept experts: ``topk_ids`` [N, k]
    and ``topk_weights`` [N, k] changed in place, the weights from ``logits`` [N, E] per
    :func:`replay_weights`, scaled by ``config.routed_scaling_factor`` where SGLang scales its own
    (``apply_routed_scaling_factor_on_output``); rows whose chosen experts (as a set) were others are
    marked in ``replay.rerouted``. ``config`` is SGLang's ``TopKConfig``."""
    if getattr(config, "fused_gate_packed_ids", False) or os.environ.get(LORA_TOPK_PACK_ENV, "") not in ("", "0"):
        raise RuntimeError("route replay: the router packs its top-k ids for the experts itself (flashinfer mxfp4 "
                           f"fused gate, or {LORA_TOPK_PACK_ENV}), before they can be replayed")
    if topk_ids.shape[0] != replay.ids.shape[0] or topk_ids.shape[1] != replay.ids.shape[2]:
        raise RuntimeError(f"route replay: the MoE input has {tuple(topk_ids.shape)} top-k ids where the batch "
                           f"replays {replay.ids.shape[0]} rows of {replay.ids.shape[2]} (a fused shared expert's "
                           "columns, or a token layout the replay does not follow)")
    rows = replay.replayed.nonzero().flatten()
    if len(rows) == 0:
        return
    ids = replay.ids[rows, layer]
    weights = replay_weights(logits[rows], ids, config.scoring_func, config.renormalize)
    if config.apply_routed_scaling_factor_on_output and config.routed_scaling_factor is not None:
        weights = weights * config.routed_scaling_factor
    chosen = topk_ids[rows].sort(-1).values
    replay.rerouted[rows] |= (chosen != ids.to(chosen.dtype).sort(-1).values).any(-1)
    topk_ids[rows] = ids.to(topk_ids.dtype)
    topk_weights[rows] = weights.to(topk_weights.dtype)


def dp_slot_start(counts: list[int], rank: int, buffer_len: int, max_padding: bool) -> int:
    """First row of DP rank ``rank``'s tokens in the gathered MoE input: ranks' ``counts`` (padded as
    the gather pads them) end to end, or equal slots of ``buffer_len / len(counts)`` rows when the
    gather pads every rank to the longest (SGLang's ``DpPaddingMode`` MAX_LEN, an all-gather)."""
    return rank * (buffer_len // len(counts)) if max_padding else sum(counts[:rank])


@dataclass(frozen=True)
class DpSlot:
    """Where a DP-attention rank's rows go in the gathered MoE input: ``start``, its first row there;
    ``writes``, whether it writes them (attention-TP and -CP rank 0: its DP group's other ranks hold the
    same rows); ``shape`` (layers, top-k) of a row; ``group``, the process group of the gather."""

    start: int
    writes: bool
    shape: tuple[int, int]
    group: object


def gathered_replay(local: ForwardReplay, num_rows: int, slot: DpSlot) -> ForwardReplay:
    """Every DP rank's replayed rows in the gathered layout of ``num_rows`` rows: each rank's ids + 1
    in its slot (0 where nothing is replayed), summed over the ranks. A collective: every rank of the
    gather calls it in the same forward (``local`` empty on a rank that replays nothing)."""
    codes = torch.zeros((num_rows, *slot.shape), dtype=torch.int32, device=local.replayed.device)
    if slot.writes:
        rows = local.replayed.nonzero().flatten()
        codes[slot.start + rows] = local.ids[rows] + 1
    torch.distributed.all_reduce(codes, group=slot.group)
    replayed = codes[:, 0, 0] > 0
    return ForwardReplay(ids=codes - 1, replayed=replayed, rerouted=torch.zeros_like(replayed), start=slot.start)


def _dp_slot() -> DpSlot:
    """This rank's :class:`DpSlot` in the forward in progress (SGLang's DP-attention state)."""
    from sglang.srt.layers import dp_attention
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    parallel, capturer = get_parallel(), get_global_experts_capturer()
    start = dp_slot_start(dp_attention.get_dp_global_num_tokens(), dp_attention.dp_gather_slot(),
                          dp_attention.get_global_dp_buffer_len(), dp_attention.is_dp_max_padding())
    group = torch.distributed.group.WORLD if dp_attention.world_dp_gather_enabled() else parallel.tp_group.device_group
    return DpSlot(start=start, writes=parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0,
                  shape=(capturer.num_layers, capturer.topk_size), group=group)


def _dp_attention() -> tuple[bool, bool]:
    """(DP attention on, an extend batch on some DP rank in the forward in progress)."""
    from sglang.srt.layers import dp_attention

    enabled = dp_attention.is_dp_attention_enabled()
    return enabled, enabled and dp_attention.get_is_extend_in_batch()


def _replay_for(topk_ids: torch.Tensor) -> ForwardReplay | None:
    """The replay of the forward in progress for an MoE input of ``topk_ids``' rows, gathered over
    the DP ranks under DP attention; None when nothing is replayed (or a CUDA graph is captured)."""
    if _active is None or (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    dp, extending = _dp_attention()
    if not dp:
        return _active
    if not extending:
        return None
    if _active.gathered is None:
        _active.gathered = gathered_replay(_active, topk_ids.shape[0], _dp_slot())
    return _active.gathered


def post_process_topk_ids(*, topk_ids, topk_weights, topk_config, router_logits, layer_id, **kwargs):
    """SGLang's ``topk._post_process_topk_ids``, the replayed rows' ids and weights put in first."""
    replay = _replay_for(topk_ids) if topk_config.allow_routed_experts_capture and layer_id is not None else None
    if replay is not None:
        apply_replay(replay, layer_id, topk_ids, topk_weights, router_logits, topk_config)
        _active.layers += 1
    return _original_post_process(topk_ids=topk_ids, topk_weights=topk_weights, topk_config=topk_config,
                                  router_logits=router_logits, layer_id=layer_id, **kwargs)


def rerouted_requests(replay: ForwardReplay, owner: torch.Tensor) -> list[int]:
    """Indices of the batch's requests (``owner`` int64 [N]: each local row's) with a replayed row that
    a router would have routed elsewhere (read from the gathered rows under DP attention)."""
    source = replay if replay.gathered is None else replay.gathered
    rerouted = source.rerouted[source.start:source.start + len(owner)].cpu()
    return sorted(set(owner[rerouted].tolist()))


def _forward_replay(host, device: torch.device) -> ForwardReplay:
    """:class:`ForwardReplay` on ``device`` from :func:`extend_replay`'s host tensors (None: nothing)."""
    if host is None:
        empty = torch.zeros(0, dtype=torch.bool, device=device)
        return ForwardReplay(ids=torch.zeros((0, 0, 0), dtype=torch.int32, device=device), replayed=empty,
                             rerouted=empty)
    replayed = host[1].to(device, non_blocking=True)
    return ForwardReplay(ids=host[0].to(device, non_blocking=True), replayed=replayed,
                         rerouted=torch.zeros_like(replayed))


@contextmanager
def replaying(worker, batch):
    """:data:`_active` set to ``batch``'s :class:`ForwardReplay` (an empty one in a DP-attention
    engine's forward that replays nothing here: its ranks may), its forward kept off the prefill CUDA
    graph. Afterwards a request with a rerouted row keeps its KV out of the prefix cache (SGLang's
    ``skip_radix_cache_insert``, as for positional embedding overrides): its KV is not what its
    tokens alone determine, and the cache's dedup of equal tokens would swap it for another's."""
    global _active
    host = None
    if batch is not None and batch.forward_mode.is_extend():
        host = extend_replay(batch.reqs, batch.prefix_lens, batch.extend_lens)
    dp = _dp_attention()[0]
    if host is None and not dp:
        yield
        return
    runner = worker.model_runner
    _active = _forward_replay(host, torch.device(runner.device))
    graphs = runner.prefill_cuda_graph_runner
    if host is not None and not dp:
        runner.prefill_cuda_graph_runner = None  # under DP attention the ranks' vote kept it off
    try:
        yield
        if host is not None and _active.layers == 0:
            raise RuntimeError("route replay: a forward with kept routes to replay routed no MoE layer through "
                               "select_experts (a top-k output format that skips it: start the engine with "
                               "--moe-runner-backend triton, or a model whose gate fuses its own top-k)")
        if host is not None:
            for i in rerouted_requests(_active, host[2]):
                batch.reqs[i].skip_radix_cache_insert = True
    finally:
        runner.prefill_cuda_graph_runner = graphs
        _active = None


def forward_batch_generation(worker, batch=None, *args, **kwargs):
    """SGLang's ``TpModelWorker.forward_batch_generation``, run :func:`replaying` ``batch``."""
    with replaying(worker, batch):
        return _original_forward(worker, batch, *args, **kwargs)


def prefill_graph_vote(*, local_batch, **kwargs) -> bool:
    """SGLang's ``dp_attn._local_prefill_cuda_graph_vote``: no prefill CUDA graph for a batch that
    replays kept routes."""
    if (local_batch is not None and local_batch.forward_mode.is_extend()
            and extend_replay(local_batch.reqs, local_batch.prefix_lens, local_batch.extend_lens) is not None):
        return False
    return _original_vote(local_batch=local_batch, **kwargs)


def install() -> None:
    """Route SGLang's forward of a batch, top-k post-processing and DP prefill-graph vote in this
    process through this module (idempotent)."""
    global _original_forward, _original_post_process, _original_vote
    from sglang.srt.layers.moe import topk
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.managers.tp_worker import TpModelWorker

    if topk._post_process_topk_ids is post_process_topk_ids:
        return
    _original_forward = TpModelWorker.forward_batch_generation
    _original_post_process = topk._post_process_topk_ids
    _original_vote = dp_attn._local_prefill_cuda_graph_vote
    TpModelWorker.forward_batch_generation = forward_batch_generation
    topk._post_process_topk_ids = post_process_topk_ids  # select_experts calls the module global
    dp_attn._local_prefill_cuda_graph_vote = prefill_graph_vote
