"""Keep Routing in the trainer: megatron-core's router replay fed with the engine's experts, and how
often the trainer's own router agrees with them.

Every MoE router of the model built with routing replay is a ``RouterReplay`` instance
(:func:`replay_routers`; a model chunk's own: :func:`chunk_routers`). A replayed forward takes each layer's
experts from the engine's ``routed_experts`` [b, S, L, k] in megatron's sequence-major token order, this TP
rank's slice under sequence parallelism (:func:`local_replay_indices`). The replay ids of one forward go to
the routers of the chunk that forward runs, and no other: under virtual pipeline stages a rank holds several
chunks, and megatron's schedule runs them micro-batch group by micro-batch group
(``get_schedule_table``). Under activation recompute the recomputed forward replays the same experts: each
router keeps the replay ids of its chunk's forwards in order (megatron-core's ``replay_backward_list``) and
the recompute in the backward pass takes them back in that order (``REPLAY_BACKWARD``), the order the
schedule runs one chunk's backward passes. Without replay, the routing the trainer chose is recorded and
compared with the engine's (:class:`StepRouting`), chunk by chunk too.
"""
from __future__ import annotations

import torch

from megarl.trainer.expert_load import LoadCounter
from megarl.trainer.packing import ModelInput
from megarl.trainer.rl_batch import RLBatch


def replay_routers() -> list:
    """The model's ``RouterReplay`` instances, one per MoE layer of this rank (empty without replay)."""
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


def padding_mask(model, mb: RLBatch, mi: ModelInput, sequence_parallel: bool) -> torch.Tensor:
    """bool [b, s]: True at the positions of the model input ``mi`` that hold no token of ``mb`` (padding, which
    replays experts 0..k-1), the positions megatron's MoE routers leave out of their load counts (the expert
    bias's and the auxiliary losses'). GPTModel scatters it over the sequence-parallel ranks on the first
    pipeline stage only: on a later stage ``model`` gets this TP rank's slice."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    mask = ~mi.scatter(torch.ones(len(mb.tokens), dtype=torch.bool, device=mi.tokens.device), False)
    if sequence_parallel and not get_attr_wrapped_model(model, "pre_process"):
        tp = parallel_state.get_tensor_model_parallel_world_size()
        mask = mask.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()].contiguous()
    return mask


def routing_agreement(recorded: list[torch.Tensor], routed: torch.Tensor, layer_numbers: list[int],
                      valid: torch.Tensor, sequence_parallel: bool,
                      load: LoadCounter | None = None) -> tuple[float, float]:
    """(matching token-layer pairs, valid pairs) where the trainer's top-k set equals the engine's; both
    sides' valid tokens go to ``load`` when given."""
    match, total = 0.0, 0.0
    for rec, layer in zip(recorded, layer_numbers):
        engine = local_replay_indices(routed, layer, sequence_parallel).sort(-1).values
        mine = rec.sort(-1).values
        valid_local = local_replay_indices(valid[:, :, None, None].long(), 1, sequence_parallel)[:, 0].bool()
        equal = (engine == mine).all(-1) & valid_local
        if load is not None:
            load.add(layer, engine[valid_local], mine[valid_local])
        match += float(equal.sum())
        total += float(valid_local.sum())
    return match, total


def chunk_routers(model) -> list:
    """The ``RouterReplay`` instances of one model chunk's MoE layers (the routers a forward of that chunk
    runs), in layer order; empty without replay."""
    return [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]


def routers_recomputed(config) -> bool:
    """Whether the backward pass of a model built with megatron ``config`` runs the routers' forward again
    (and so takes replay ids from their ``replay_backward_list``): full recompute of every layer
    (``uniform``), or the selective recompute of whole MoE layers."""
    if config.recompute_granularity == "full":
        return config.recompute_method == "uniform"
    return config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ())


class ReplayAgreement:
    """Counts, during a replayed forward, how often the router's own top-k equals the replayed one.

    Wraps ``get_replay_topk`` of each RouterReplay instance (not megatron's class): in
    REPLAY_FORWARD it also runs the router's default top-k on the live scores and compares sets
    on the tokens marked valid by :meth:`set_valid`; both sides' valid tokens go to ``load`` when given.
    Undone by :meth:`close`.
    """

    def __init__(self, routers: list, load: LoadCounter | None = None):
        self.routers, self.matched, self.total, self.load = routers, 0.0, 0.0, load
        self._valid: torch.Tensor | None = None
        for router in routers:
            router.get_replay_topk = self._wrap(router, router.get_replay_topk)

    def _wrap(self, router, original):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, replayed = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if router.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self._valid is not None:
                with torch.no_grad():
                    _, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    equal = (natural.sort(-1).values == replayed.sort(-1).values).all(-1) & self._valid
                    if self.load is not None:
                        self.load.add(router.layer_number, replayed[self._valid], natural[self._valid])
                    self.matched += float(equal.sum())
                    self.total += float(self._valid.sum())
            return probs, replayed

        return get_replay_topk

    def set_valid(self, valid: torch.Tensor | None) -> None:
        """bool [tokens] (this rank's token order) of the next forward's tokens; None after it."""
        self._valid = valid

    def close(self) -> None:
        for router in self.routers:
            del router.get_replay_topk  # back to the class's method


class Replay:
    """Keep Routing over micro-batches and model chunks: before each forward of one chunk on one micro-batch,
    the engine's experts of that micro-batch are set on the routers of that chunk only (a rank holds several
    chunks under virtual pipeline stages, run micro-batch by micro-batch in megatron's schedule order);
    ``REPLAY_BACKWARD`` outside forwards, so that a recompute replays them again. Each router's
    ``replay_backward_list`` then holds the micro-batches its chunk ran forward and has not yet recomputed, in
    the order the schedule runs their backward passes (per chunk, the forward order). Where the routers are not
    recomputed (:func:`routers_recomputed`) the list is emptied after each forward: nothing would take the
    entries back, and they would keep every micro-batch's replay ids on the device until the step ends."""

    def __init__(self, routers: list, sequence_parallel: bool, count_agreement: bool,
                 load: LoadCounter | None = None):
        self.routers, self.sp = routers, sequence_parallel
        self.agreement = ReplayAgreement(routers, load) if count_agreement else None
        self._chunks: dict[int, tuple[list, bool]] = {}  # id(chunk) -> (its routers, whether they are recomputed)

    def _of(self, model) -> tuple[list, bool]:
        if id(model) not in self._chunks:
            from megatron.core.utils import get_model_config

            self._chunks[id(model)] = (chunk_routers(model), routers_recomputed(get_model_config(model)))
        return self._chunks[id(model)]

    def forward(self, model, mb: RLBatch, mi: ModelInput) -> torch.Tensor:
        """``model``'s output on the micro-batch ``mb`` (model input ``mi``) through the engine's experts."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers, recomputed = self._of(model)
        self._set_replay(routers, mb, mi)
        output = model(mi.tokens, mi.position_ids, None, packed_seq_params=mi.packed_seq_params,
                       padding_mask=padding_mask(model, mb, mi, self.sp))
        for router in routers:
            router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            router.target_topk_idx = None  # the forward's ids: in the backward list while a recompute needs them
            if not recomputed:
                router.replay_backward_list.clear()
        if self.agreement is not None:
            self.agreement.set_valid(None)
        return output

    def _set_replay(self, routers: list, mb: RLBatch, mi: ModelInput) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        k, device = mb.routed_experts.shape[-1], mb.routed_experts.device
        routed = mi.scatter(mb.routed_experts.long(), torch.arange(k, device=device))  # padding replays 0..k-1
        for router in routers:
            router.set_target_indices(local_replay_indices(routed, router.layer_number, self.sp))
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if self.agreement is not None:
            valid = mi.scatter(torch.ones(len(mb.tokens), dtype=torch.long, device=device), 0)[:, :, None, None]
            self.agreement.set_valid(local_replay_indices(valid, 1, self.sp)[:, 0].bool())

    def close(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if self.agreement is not None:
            self.agreement.close()
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


class StepRouting:
    """The routing of one training step's forwards, and its agreement with the engine's.

    ``keep_routing``: every forward replays the engine's experts (:class:`Replay`), the router's own
    choice counted beside; it needs ``routed`` (the batch carries ``routed_experts``) and a model built
    with routing replay (ValueError otherwise). Else, when the model has replay routers and the batch
    carries routes, the trainer's own choice is recorded and compared with them; with neither, the
    routers are left to choose. Enter it around the step's schedule, run each micro-batch's forward
    through :meth:`forward`; after the exit, ``counts`` holds (matching, valid) token-layer pairs of
    this rank when :attr:`measured`, and ``load`` (when given) both sides' expert load."""

    def __init__(self, keep_routing: bool, routed: bool, sequence_parallel: bool, load: LoadCounter | None = None):
        self.routers = replay_routers()
        if keep_routing and (not routed or not self.routers):
            raise ValueError("keep_routing needs routed_experts in every sample and a model built with routing replay")
        self.keep_routing, self.sp = keep_routing, sequence_parallel
        self.record = not keep_routing and routed and bool(self.routers)
        self.counts = [0.0, 0.0]
        self.load = load
        self._replay: Replay | None = None
        self._chunk_routers: dict[int, list] = {}  # id(chunk) -> its routers (recording)

    @property
    def measured(self) -> bool:
        """Whether the step compares the trainer's routing with the engine's."""
        return self.keep_routing or self.record

    def __enter__(self) -> StepRouting:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        if self.routers:
            RouterReplay.clear_global_indices()
            if self.record:
                RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            elif not self.keep_routing:
                RouterReplay.clear_global_router_replay_action()
        if self.keep_routing:
            self._replay = Replay(self.routers, self.sp, count_agreement=True, load=self.load)
        return self

    def forward(self, model, mb: RLBatch, mi: ModelInput) -> torch.Tensor:
        """``model``'s output on the micro-batch ``mb`` (model input ``mi``) under the step's routing."""
        if self._replay is not None:
            return self._replay.forward(model, mb, mi)
        output = model(mi.tokens, mi.position_ids, None, packed_seq_params=mi.packed_seq_params,
                       padding_mask=padding_mask(model, mb, mi, self.sp))
        if self.record:
            self._count_recorded(model, mb, mi)
        return output

    def _count_recorded(self, model, mb: RLBatch, mi: ModelInput) -> None:
        """Add the agreement of the routing ``model`` (one chunk) recorded in its forward on ``mb``."""
        if id(model) not in self._chunk_routers:
            self._chunk_routers[id(model)] = chunk_routers(model)
        routers = self._chunk_routers[id(model)]
        k, device = mb.routed_experts.shape[-1], mb.routed_experts.device
        valid = mi.scatter(torch.ones(len(mb.tokens), dtype=torch.bool, device=device), False)
        matched, total = routing_agreement([r.get_recorded_indices() for r in routers],
                                           mi.scatter(mb.routed_experts.long(), torch.arange(k, device=device)),
                                           [r.layer_number for r in routers], valid, self.sp, self.load)
        for router in routers:
            router.recorded_topk_idx = None
        self.counts[0] += matched
        self.counts[1] += total

    def __exit__(self, *exc) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if self._replay is not None:
            self.counts = [self._replay.agreement.matched, self._replay.agreement.total]
            self._replay.close()
            self._replay = None
        elif self.routers:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
