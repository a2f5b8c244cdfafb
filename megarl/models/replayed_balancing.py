"""megatron-core's load balancing under Keep Routing: the auxiliary losses count the replayed routes.

A router built with routing replay takes its experts from the engine (``RouterReplay``), and the experts'
load is that of the replayed routes: the aux-loss-free expert bias already counts them (megatron's
``TopKRouter._apply_expert_bias`` adds the routing map the replay produced), but the auxiliary losses
(``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) take their tokens per expert from a top-k of their
own over the router's scores (``compute_routing_scores_for_aux_loss``): the load the router would have
made, not the one the experts got. :func:`count_replayed_routes` makes them take the replayed routes'
map instead, padding rows left out as megatron's own map leaves them (a padding row of the given map is
empty). Their probabilities, which carry the gradient, stay the router's.

It wraps, once per process, ``RouterReplay.get_replay_topk`` (each replay remembers the experts it gave
last, ``last_replayed``) and the three ``TopKRouter._apply_*aux_loss`` methods (the map they get is replaced
while the router replays); a router that does not replay is left as megatron made it.

Padding (the positions of a micro-batch that hold no token, which replay experts 0..k-1) is kept out of the
counts by the padding mask the trainer gives the model (``megarl.trainer.routing_replay.padding_mask``).
megatron-core 0.19's ``TopKRouter._apply_expert_bias`` cannot take one (``routing_map & ~padding_mask``
broadcasts the flattened [tokens] mask against the [tokens, experts] map): the wrapper gives it the mask as
[tokens, 1] (:func:`_masking_padding_rows`).
"""
from __future__ import annotations

import functools

import torch

AUX_LOSSES = ("_apply_aux_loss", "_apply_seq_aux_loss", "_apply_global_aux_loss")
_INSTALLED = "_megarl_replayed_balancing"


def replayed_map(router, routing_map: torch.Tensor) -> torch.Tensor:
    """The routing map [tokens, E] an auxiliary loss of ``router`` counts: the replayed experts' when the
    router replays (rows that ``routing_map`` leaves empty, padding, stay empty), else ``routing_map``."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = getattr(router, "router_replay", None)
    replayed = getattr(replay, "last_replayed", None)
    if replay is None or replayed is None or replay.router_replay_action not in (
            RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        return routing_map
    if replayed.shape[0] != routing_map.shape[0]:
        raise ValueError(f"router {router.layer_number}: {replayed.shape[0]} replayed tokens for an aux-loss map "
                         f"of {routing_map.shape[0]}")
    mapped = torch.zeros_like(routing_map, dtype=torch.bool).scatter(1, replayed.to(routing_map.device), True)
    return mapped & routing_map.any(-1, keepdim=True)


def count_replayed_routes() -> None:
    """Install the wrappers of the module docstring (once per process)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if getattr(TopKRouter, _INSTALLED, False):
        return
    topk = RouterReplay.get_replay_topk

    @functools.wraps(topk)
    def get_replay_topk(self, scores, k, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, indices = topk(self, scores, k, num_groups, group_topk, default_compute_topk)
        self.last_replayed = indices
        return probs, indices

    RouterReplay.get_replay_topk = get_replay_topk
    for name in AUX_LOSSES:
        setattr(TopKRouter, name, _counting_replayed(getattr(TopKRouter, name)))
    TopKRouter._apply_expert_bias = _masking_padding_rows(TopKRouter._apply_expert_bias)
    setattr(TopKRouter, _INSTALLED, True)


def _masking_padding_rows(method):
    """``TopKRouter._apply_expert_bias`` (routing map [tokens, E], padding mask [tokens] or None) given the
    mask as [tokens, 1], which leaves the padding rows out of the expert bias's token counts."""
    @functools.wraps(method)
    def wrapped(self, routing_map, padding_mask=None):
        if padding_mask is not None and padding_mask.dim() == 1:
            padding_mask = padding_mask[:, None]
        return method(self, routing_map, padding_mask=padding_mask)

    return wrapped


def _counting_replayed(method):
    """``method`` (an aux loss of ``TopKRouter``: probs, scores, routing map, ...) fed the replayed map."""
    @functools.wraps(method)
    def wrapped(self, probs, scores_for_aux_loss, routing_map, *args, **kwargs):
        return method(self, probs, scores_for_aux_loss, replayed_map(self, routing_map), *args, **kwargs)

    return wrapped
