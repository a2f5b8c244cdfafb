"""Engine-side loading of weight-sync buckets that overlaps the link (runs in SGLang's scheduler).

SGLang 0.5.23 serves each ``/update_weights_from_distributed`` call in the ``flattened_bucket``
format in three serial steps: allocate a fresh flat buffer (new pages, faulted in by the receive),
receive the broadcast into it, load its views into the model. The link idles while the engine
loads, and the sender idles with it.

:func:`install` (run by :mod:`megarl.engine_process.sglang_main` in every SGLang process) changes such a
call inside a weight-update session (``begin_weight_update`` .. ``end_weight_update``) to:

1. start receiving the call's bucket (an asynchronous broadcast) into one of two reused buffers
   (a larger bucket replaces the smaller buffer),
2. load the bucket the previous call received, while this one arrives,
3. wait for the receive and answer; the received bucket waits for the next call.

A call that sets the weight version or flushes the cache (megarl sends both on a sync's last load)
loads its own bucket too, before the version is recorded and the cache flushed, and
``end_weight_update`` loads a bucket still waiting (a caller that set no version). Nothing runs on
the engine between the driver's pause and continue, so when inside the session a bucket lands is
not visible outside it. Any other format, or a call outside a session, goes to SGLang unchanged.

A load that fails fails the call that ran it (the received bucket is dropped with it); the driver
then holds the engine, which may hold part of the new weights (:mod:`megarl.sync.weight_sync`). On a
GPU the receive runs on NCCL's stream, which waits for the loads queued before it (torch orders a
collective after the current stream's work), so a buffer is never overwritten while a load still
reads it. Memory: two bucket buffers per engine rank during a session (SGLang: one per call);
device buffers are freed at its end, host buffers stay for the next session (new host pages cost a
fault per 4 KiB).

Sharded-resharding buckets (load format ``megarl_sharded``) are served by :mod:`megarl.engine_process.sharded_load`.

Colocated buckets (``/update_weights_from_tensor`` from host shared memory) keep their mapping: see
:func:`load_flattened_bucket`.

Delta-mode buckets (``sync.delta``; load format ``megarl_delta`` over the distributed path, a flagged
bucket dict over the tensor path; the format is :mod:`megarl.wire.weight_delta`'s) are decoded
against this process's baseline, the HF tensors as last loaded (a scatter of the new values into
them), and the full tensors each bucket touches go through SGLang's own ``load_weights``, exactly as
a whole bucket's do: the engine ends bit-identical to a full sync. Memory: the baseline is one host
copy of the whole model in the export dtype per engine rank (each rank receives every bucket), held
from the first delta-mode sync on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from megarl.engine_process.sharded_load import missing_group_reply, named_update_group, update_weights_from_sharded
from megarl.wire.weight_delta import BUCKET_FLAG, decode
from megarl.wire.weight_delta import LOAD_FORMAT as DELTA_FORMAT
from megarl.wire.weight_shards import FORMATS as SHARDED_FORMATS

log = logging.getLogger(__name__)

FORMAT = "flattened_bucket"


@dataclass
class _Received:
    """A bucket received into ``buffer`` and not loaded yet: its (name, view) pairs and the
    runners (SGLang's selector) it is for."""

    weights: list[tuple[str, torch.Tensor]]
    buffer: torch.Tensor
    selector: str
    delta: bool = False  # a delta-mode bucket: decoded against the baseline before its load


@dataclass
class _Session:
    """One engine rank's receive buffers and the bucket waiting to be loaded (none between
    sessions; host buffers stay from one session to the next)."""

    free: list[torch.Tensor] = field(default_factory=list)
    waiting: _Received | None = None

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (1-D uint8), else a new one of exactly ``nbytes``."""
        for i, buffer in enumerate(self.free):
            if buffer.numel() >= nbytes:
                return self.free.pop(i)
        if self.free:
            self.free.pop(0)  # too small for this bucket: replaced, at most two buffers live
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


_sessions: dict[int, _Session] = {}  # by id() of SGLang's per-rank weight-update manager (slots: no attributes)
_mapped: list[torch.Tensor] = []  # the colocated sender's last shared buckets, mapped in this process
MAPPED_KEPT = 2  # the sender alternates between two bucket buffers, and keeps them between syncs
_baseline: dict[str, torch.Tensor] = {}  # HF name -> tensor as last loaded by a delta-mode bucket (host)


def full_tensors(pieces: list[tuple[str, torch.Tensor]], device) -> list[tuple[str, torch.Tensor]]:
    """A delta-mode bucket's pieces applied to the baseline: (HF name, the full new tensor on ``device``,
    a copy SGLang's loaders may keep) for each tensor the bucket carries."""
    return [(name, tensor.to(device, copy=True)) for name, tensor in decode(pieces, _baseline)]


def _load(manager, received: _Received) -> tuple[bool, str]:
    """Load ``received`` into every runner its selector names (SGLang's own per-runner load)."""
    import msgspec

    success, message = True, "Succeeded to update parameter online."
    weights = received.weights
    if received.delta:
        try:
            weights = full_tensors(weights, manager.tp_worker.model_runner.weight_updater.device)
        except Exception as e:
            return False, f"Failed to apply the weight delta: {e}"
    for _, runner in manager._select_runners(received.selector):
        success, message = runner.weight_updater.load_weights_from_distributed(weights)
        if not success:
            return success, message
    manager._session = msgspec.structs.replace(manager._session, loaded_weights=True)
    return success, message


def _load_waiting(manager, session: _Session) -> tuple[bool, str]:
    """Load the bucket waiting in ``session`` (if any) and free its buffer for reuse."""
    received, session.waiting = session.waiting, None
    if received is None:
        return True, "nothing waiting"
    try:
        return _load(manager, received)
    finally:
        session.free.append(received.buffer)


def update_weights_from_distributed(manager, recv_req, original):
    """SGLang's ``update_weights_from_distributed`` with the receive of this bucket overlapping the
    load of the previous one (see the module docstring); a sharded bucket goes to
    :mod:`megarl.engine_process.sharded_load`; ``original`` serves every other call."""
    if recv_req.load_format in SHARDED_FORMATS:
        return update_weights_from_sharded(manager, recv_req)
    if recv_req.load_format not in (FORMAT, DELTA_FORMAT) or manager._session is None:
        if recv_req.load_format == DELTA_FORMAT:
            from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqOutput

            return UpdateWeightsFromDistributedReqOutput(
                success=False, message="a delta-mode bucket loads only inside begin/end_weight_update")
        return original(manager, recv_req)
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqOutput
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    with manager._observe_weight_load("distributed"):
        target, group = named_update_group(manager, recv_req)
        if group is None:
            return missing_group_reply(recv_req)
        session = _sessions.setdefault(id(manager), _Session())
        buffer = None
        try:
            # SGLang's layout of the bucket (offsets, alignment checks), without allocating it
            layout = FlattenedTensorBucket.empty(recv_req.names, recv_req.dtypes, recv_req.shapes, device="meta")
            nbytes = layout.flattened_tensor.numel()
            buffer = session.buffer(nbytes, target.device)
            arriving = torch.distributed.broadcast(buffer[:nbytes], src=0, group=group, async_op=True)
        except Exception as e:  # the waiting bucket stays for end_weight_update
            if buffer is not None:
                session.free.append(buffer)
            return UpdateWeightsFromDistributedReqOutput(success=False, message=f"Failed to receive weights: {e}")
        try:
            success, message = _load_waiting(manager, session)
        finally:
            try:
                arriving.wait()
            except Exception as e:
                success, message = False, f"Failed to receive weights: {e}"
        if not success:
            session.free.append(buffer)
            log.error(message)
            return UpdateWeightsFromDistributedReqOutput(success=False, message=message)
        received = FlattenedTensorBucket(flattened_tensor=buffer[:nbytes], metadata=layout.metadata)
        session.waiting = _Received(received.reconstruct_tensors(), buffer, recv_req.selector,
                                    delta=recv_req.load_format == DELTA_FORMAT)
        if recv_req.weight_version is not None or recv_req.flush_cache:
            success, message = _load_waiting(manager, session)
            if success:
                manager.record_weight_version_after_update(recv_req.weight_version)
                success, message = manager.flush_cache_after_weight_update(recv_req, success, message)
        if not success:
            log.error(message)
        return UpdateWeightsFromDistributedReqOutput(success=success, message=message)


def load_flattened_bucket(updater, bucket: dict, original):
    """SGLang's load of a colocated (``tensor`` transport) bucket from host shared memory, keeping
    the mappings of the last two such buckets alive: the CPU sender packs all its buckets, in this
    sync and the next, into the same two buffers (:mod:`megarl.sync.transports.tensor`), and torch
    maps a handle it still holds a tensor of only once (its ``shared_cache``), so they are read
    without mapping and faulting their pages again. Costs: two buckets of shared memory stay
    mapped after the last colocated sync. CUDA IPC buckets are not kept (the trainer's memory).
    A delta-mode bucket (flagged) is decoded against the baseline and its full tensors loaded."""
    tensor = bucket["flattened_tensor"]
    if tensor.device.type == "cpu":
        _mapped.append(tensor)
        del _mapped[:-MAPPED_KEPT]
    if not bucket.get(BUCKET_FLAG):
        return original(updater, bucket)
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    pieces = FlattenedTensorBucket(flattened_tensor=tensor, metadata=bucket["metadata"]).reconstruct_tensors()
    updater.get_model().load_weights(full_tensors(pieces, updater.device))
    return True, "Success"


def end_weight_update(manager, recv_req, original):
    """SGLang's ``end_weight_update`` after loading a bucket still waiting; frees the receive
    buffers, except host buffers, which the next session reuses (no new pages to fault in)."""
    session = _sessions.get(id(manager))
    if session is None:
        return original(manager, recv_req)
    success, message = _load_waiting(manager, session) if manager._session is not None else (True, "")
    if any(buffer.device.type != "cpu" for buffer in session.free):
        del _sessions[id(manager)]
    if not success:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqOutput

        log.error(message)
        original(manager, recv_req)  # the session still closes, on every rank (its barrier)
        return EndWeightUpdateReqOutput(success=False, message=message)
    return original(manager, recv_req)


def install() -> None:
    """Route SGLang's distributed bucket loads in this process through this module (idempotent)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    if getattr(SchedulerWeightUpdaterManager.end_weight_update, "_megarl_pipelined", False):
        return
    for cls, name, replacement in (
            (SchedulerWeightUpdaterManager, "update_weights_from_distributed", update_weights_from_distributed),
            (SchedulerWeightUpdaterManager, "end_weight_update", end_weight_update),
            (WeightUpdater, "_update_weights_from_flattened_bucket", load_flattened_bucket)):
        setattr(cls, name, _patched(replacement, getattr(cls, name)))


def _patched(replacement, original):
    """SGLang's method ``original`` (one argument, positional or by keyword) served by
    ``replacement(self, argument, original)``."""

    def patched(self, *args, **kwargs):
        (argument,) = (*args, *kwargs.values())
        return replacement(self, argument, original)

    patched._megarl_pipelined = True
    return patched
