"""Engine-side load of a sharded-resharding bucket (load format ``megarl_sharded``; runs in SGLang's scheduler
of every engine rank, routed here by :mod:`megarl.engine_process.pipelined_load`).

The request lists the bucket's transfers into this engine (:mod:`megarl.wire.weight_shards`); this rank
keeps those addressed to its own rank of the update group, receives them from the trainer ranks that send
them (one buffer per sender, all at once) and loads each tensor through SGLang's own ``load_weights``: its
slices sit at their rows of an uninitialised tensor of the full HF shape, and the parameter's weight loader
narrows that tensor to the rows this rank owns, which are exactly the slices', so SGLang's fused-QKV,
gate/up and expert mappings apply unchanged and nothing is sliced twice. A piece arrives whole when the
loader reads the whole tensor (replicated weights). The receive and the load are one step (no overlap:
the buckets are each engine rank's share, not the model).

Delta mode (``sync.delta``, load formats ``megarl_sharded_base`` / ``megarl_sharded_delta``): each engine
rank keeps, in host memory, a baseline of only its own slices as last loaded (:class:`SliceBaseline`: the
bytes this rank loads, not the model's), applies the changed elements to them in place
(:func:`megarl.wire.weight_delta.decode`), and loads every slice of each tensor that changed (a tensor
split over several senders is loaded whole on this rank: its unchanged slices come from the baseline).
"""
from __future__ import annotations

import logging

import torch

from megarl.wire.weight_delta import decode
from megarl.wire.weight_shards import (
    BASE_FORMAT,
    LOAD_FORMAT,
    Piece,
    Transfer,
    assemble,
    entry_name,
    exchange,
    hf_name,
    join_all,
    parse_entries,
    unreceived_parameters,
)

log = logging.getLogger(__name__)

_joined: set[str] = set()  # update groups this process took part in a first all-reduce of (join_all)


def named_update_group(manager, recv_req):
    """(this rank's SGLang weight updater, the weight-update group ``recv_req.group_name`` names; None when
    no such group was initialised)."""
    target = manager.tp_worker.model_runner.weight_updater
    return target, target._model_update_group.get(recv_req.group_name)


def missing_group_reply(recv_req):
    """SGLang's failed-update reply for a request naming a group this rank never joined."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqOutput

    return UpdateWeightsFromDistributedReqOutput(
        success=False, message=f"no weight-update group {recv_req.group_name!r}: call init_weights_update_group first")


class SliceBaseline:
    """One engine rank's slices as last loaded in delta mode: slice entry name -> host tensor (the slice's
    shape and dtype), and per HF name the slices of it this rank loads."""

    def __init__(self):
        self.slices: dict[str, torch.Tensor] = {}
        self.members: dict[str, dict[str, Piece]] = {}

    def apply(self, transfers: list[Transfer], received: list[tuple[Piece, torch.Tensor]], base: bool,
              device) -> list[tuple[Piece, torch.Tensor]]:
        """Apply a delta-mode bucket's ``received`` (piece, values) of this rank's ``transfers`` (request
        order); ``base``: a full sync's bucket, whose slices replace the baseline of their tensors. Returns
        (piece, slice on ``device``) of every slice of each tensor the bucket changed, for :func:`assemble`.
        KeyError names a slice changed without a baseline (the engine needs a full sync)."""
        if base:
            fresh: set[str] = set()
            for t in transfers:
                name = t.piece.name
                if name not in fresh:
                    for old in self.members.pop(name, {}):
                        self.slices.pop(old, None)
                    fresh.add(name)
                self.members.setdefault(name, {})[entry_name(t)] = t.piece
        wires = {t.piece: entry_name(t) for t in transfers}
        touched = dict.fromkeys(hf_name(entry) for entry, _ in decode(
            [(wires[piece], values) for piece, values in received], self.slices))
        out = []
        for name in touched:
            if name not in self.members:
                raise KeyError(f"{name}: a delta arrived for a tensor this engine rank holds no baseline of "
                               "(the engine needs a full sync)")
            out += [(piece, self.slices[entry].to(device, copy=True)) for entry, piece in self.members[name].items()]
        return out


_baseline = SliceBaseline()  # this engine rank's (one scheduler process per rank)


def own_transfers(names: list[str], dtypes: list[str], shapes: list[list[int]], rank: int) -> list[Transfer]:
    """The request entries addressed to update-group rank ``rank``, in plan order."""
    return [Transfer(src, dst, piece, piece) for src, dst, piece in parse_entries(names, dtypes, shapes) if dst == rank]


def receive(recv_req, group, device) -> list[tuple[str, torch.Tensor]]:
    """This rank's slices of the request's bucket, received over ``group``, as (HF name, full-shape tensor
    holding the slice) for SGLang's ``load_weights``."""
    rank = group.rank()  # its rank in the update group (get_rank(group) maps this process's default rank)
    if recv_req.group_name not in _joined:
        join_all(group, device)
        _joined.add(recv_req.group_name)
    transfers = own_transfers(recv_req.names, recv_req.dtypes, recv_req.shapes, rank)
    received = exchange(rank, transfers, None, group, device)
    if recv_req.load_format == LOAD_FORMAT:
        return assemble(received)
    return assemble(_baseline.apply(transfers, received, recv_req.load_format == BASE_FORMAT, device))


def check_received(manager, selector) -> tuple[bool, str]:
    """(success, message): whether every parameter of the runners ``selector`` names is free of the NaN
    rows :func:`~megarl.wire.weight_shards.assemble` fills in for rows this rank did not receive (a slice
    map that disagrees with this engine's loaders fails the sync here instead of loading them)."""
    for _, runner in manager._select_runners(selector):
        bad = unreceived_parameters(runner.model)
        if bad:
            return False, (f"sharded sync: {len(bad)} parameters of this engine rank hold NaN after the sync (rows its "
                           f"loaders read that it never received, or NaN weights), e.g. {', '.join(bad[:3])}")
    return True, "Succeeded to update parameter online."


def update_weights_from_sharded(manager, recv_req):
    """Serve one ``megarl_sharded`` ``/update_weights_from_distributed`` call on this engine rank:
    receive, load into every runner the selector names, then record the version and flush the cache
    when the call carries them (the sync's last bucket)."""
    import msgspec
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqOutput

    if manager._session is None:
        return UpdateWeightsFromDistributedReqOutput(
            success=False, message="a sharded bucket loads only inside begin/end_weight_update")
    with manager._observe_weight_load("distributed"):
        target, group = named_update_group(manager, recv_req)
        if group is None:
            return missing_group_reply(recv_req)
        try:
            weights = receive(recv_req, group, target.device)
        except Exception as e:
            return UpdateWeightsFromDistributedReqOutput(success=False, message=f"Failed to receive weights: {e}")
        success, message = True, "Succeeded to update parameter online."
        for _, runner in manager._select_runners(recv_req.selector):
            success, message = runner.weight_updater.load_weights_from_distributed(weights)
            if not success:
                break
        if success:
            manager._session = msgspec.structs.replace(manager._session, loaded_weights=True)
        if success and (recv_req.weight_version is not None or recv_req.flush_cache):  # the sync's last bucket
            success, message = check_received(manager, recv_req.selector)
        if success and (recv_req.weight_version is not None or recv_req.flush_cache):
            manager.record_weight_version_after_update(recv_req.weight_version)
            success, message = manager.flush_cache_after_weight_update(recv_req, success, message)
        if not success:
            log.error(message)
        return UpdateWeightsFromDistributedReqOutput(success=success, message=message)
