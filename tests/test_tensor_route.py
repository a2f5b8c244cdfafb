"""The colocated ``tensor`` sync's route (megarl/sync/transports/tensor.py): each engine rank is fed by the
trainer rank on its device. Trainer ranks on CPU (gloo, POSIX shared memory) run the real route: each pipeline
stage's sender broadcasts its bucket to the feeding ranks, each of which serialises the buffer it holds for
its one engine rank; another process opens every payload and finds the stage's tensors, and the driver's side
assembles one list per engine, by rank."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from megarl.parallel import Layout
from megarl.sync.buckets import BucketIndex, TensorEntry
from megarl.sync.transports.tensor import TensorEngineSide, tensor_feeds
from megarl.trainer.launch import run_ranks


def stage_tensors(stage: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"layers.{stage}.w", torch.full((2, 3), float(stage + 1))),
            (f"layers.{stage}.b", torch.arange(4.0) + stage)]


def fanout_round(rank, layout, engines, engine_tp):
    """One round of the route on this rank; then the payloads of the next rank opened here (another process
    than the one that made it, as an engine rank does: each payload once, as it holds one reference); this
    rank's payloads and what it opened."""
    import os

    import torch.distributed as dist
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megarl.platform.description import Platform
    from megarl.sync.buckets import pack
    from megarl.sync.gather import is_stage_sender, pipeline_stage
    from megarl.sync.transports.tensor import TensorFanout, TensorSpec, new_buffer

    stage, sender = pipeline_stage(), is_stage_sender()
    fanout = TensorFanout(TensorSpec(engine_tp=engine_tp, engines=engines), stage, sender, Platform.cpu())
    bucket = pack(stage_tensors(stage), stage=stage, allocate=lambda n: new_buffer(n, False)) if sender else None
    mine = fanout.round(bucket)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    opened, owner = [], (rank + 1) % len(every)
    for held_stage, (engine, engine_rank, payload) in every[owner].items():
        data = MultiprocessingSerializer.deserialize(payload)
        tensors = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                        metadata=data["metadata"]).reconstruct_tensors()
        opened.append((owner, held_stage, engine, engine_rank, {k: v.tolist() for k, v in tensors}))
    dist.barrier()  # no rank frees its buffers before every rank opened them
    fanout.close()
    return {"mine": mine, "opened": opened, "sender": sender, "stage": stage,
            "nccl_cumem": os.environ.get("NCCL_CUMEM_ENABLE")}  # as init_rank set it


@pytest.mark.unit
def test_each_engine_rank_is_fed_by_the_trainer_rank_on_its_device():
    assert tensor_feeds(2, 2) == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert tensor_feeds(1, 4) == {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (0, 3)}


@pytest.mark.usefixtures("ray_local")
def test_two_stages_reach_every_feeding_rank_of_an_engine():
    """PP2 x DP2 into one engine of two ranks, on ranks 0 and 1's devices: stage 1's sender (rank 2, which
    feeds nothing) broadcasts its bucket to ranks 0 and 1, rank 0 (stage 0's sender, feeding engine rank 0)
    sends its own to rank 1; each of ranks 0 and 1 serialises each stage's bucket once, for its engine rank
    alone, and rank 3 (neither sender nor feeding) takes no part."""
    results = run_ranks(fanout_round, Layout(world_size=4, pp=2), 1, 2)
    assert [(r["stage"], r["sender"]) for r in results] == [(0, True), (0, False), (1, True), (1, False)]
    assert {r["nccl_cumem"] for r in results} == {os.environ.get("NCCL_CUMEM_ENABLE", "0")}  # the engines' value
    assert [sorted(r["mine"]) for r in results] == [[0, 1], [0, 1], [], []]
    for rank in (0, 1):
        assert {(e, er) for e, er, _ in results[rank]["mine"].values()} == {(0, rank)}
    # rank r opened rank r + 1's payloads: rank 3 rank 0's (engine rank 0), rank 0 rank 1's (engine rank 1)
    assert [[o[:4] for o in r["opened"]] for r in results] == [[(1, 0, 0, 1), (1, 1, 0, 1)], [], [],
                                                               [(0, 0, 0, 0), (0, 1, 0, 0)]]
    expected = {stage: {k: v.tolist() for k, v in stage_tensors(stage)} for stage in (0, 1)}
    assert all(tensors == expected[stage] for r in results for _, stage, _, _, tensors in r["opened"])
    payloads = [p for r in results for _, _, p in r["mine"].values()]
    assert len(set(payloads)) == 4  # one serialisation per (engine rank, bucket): never one opened twice
    side = TensorEngineSide(engine_tp=2)
    side._numbers = {"http://e0": 0}
    index = BucketIndex(stage=1, seq=0, entries=(TensorEntry("x", "float32", (1,), 0),), nbytes=4)
    assert side.payload(2, index, [r["mine"] for r in results]) == [[results[0]["mine"][1][2],
                                                                     results[1]["mine"][1][2]]]


@pytest.mark.unit
def test_each_engine_gets_its_own_ranks_payloads_by_url():
    """The driver's side numbers the engines in the order the link first formed and posts each engine its
    own list, whatever order the clients come in later (a recovered engine is appended to the end)."""
    posted = {}

    class Client:
        def __init__(self, url):
            self.base_url = url

        async def update_weights_from_tensor(self, payload, **kwargs):
            posted[self.base_url] = payload

    class Trainer:
        async def weight_sync_connect(self, spec):
            self.spec = spec

    side, trainer = TensorEngineSide(engine_tp=2), Trainer()
    a, b = Client("http://a"), Client("http://b")
    asyncio.run(side.connect(trainer, [a, b]))
    assert (trainer.spec.engines, trainer.spec.engine_tp) == (2, 2)
    index = BucketIndex(stage=0, seq=3, entries=(TensorEntry("x", "float32", (1,), 0),), nbytes=4)
    sent = [{0: (0, 0, "a0")}, {0: (0, 1, "a1")}, {0: (1, 0, "b0")}, {0: (1, 1, "b1")}]
    payload = side.payload(0, index, sent)
    assert payload == [["a0", "a1"], ["b0", "b1"]]
    asyncio.run(side.connect(trainer, [b, a]))  # after a recovery
    asyncio.run(side.load([b, a], index, payload))
    assert posted == {"http://a": ["a0", "a1"], "http://b": ["b0", "b1"]}
    with pytest.raises(RuntimeError, match=r"no trainer rank fed engine ranks \[\(1, 1\)\]"):
        side.payload(0, index, sent[:3])
    with pytest.raises(ValueError, match="http://c"):
        asyncio.run(side.connect(trainer, [Client("http://c")]))
