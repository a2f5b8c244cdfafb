"""Sharded resharding (``sync.transport=sharded``) into an SGLang engine with DP attention (TP2, ``--attn-dp-size
2``): each rank loads attention and the input embedding whole (an attention-TP group of one rank), the LM head
and the experts split over both ranks. After a sharded sync the engine's parameters (SGLang's own per-rank
hashes, ``/weights_checker``) equal those a disk load of the same weights gives. A slice map that splits
attention over both ranks, as an engine without DP attention has it, fails the sync on the engine (the rows
a rank's loader read but never received are NaN: megarl/engine_process/sharded_load.py's check), which is then held
paused (it never serves those weights) until a good sync.

SGLang's CPU path starts a DP-attention engine and loads weights into it but cannot run its forward (its
CPU attention backend lacks the DP-attention padding hook; megarl refuses ``rollout.engine_dp_attention`` on
CPU): the engine is compared by its parameters, not by generated tokens, and is started with SGLang's own
flag (``extra_args``). The trainer side is one rank holding every HF tensor whole (:class:`WholeTensorTrainer`:
the trainer protocol over the real link, slice map and exchange; a Megatron rank's own slices are
tests/test_weight_sync_sharded.py's); the driver is :class:`megarl.sync.WeightSync`, which reads the engine's
layout from its ``/server_info``.
"""
import asyncio
import dataclasses
import datetime
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sglang_engine import cpu_seconds, server_processes
from test_weight_sync_sharded import EXPERTS, qwen3_moe_table
from test_weight_sync_sharded_engine import rank_hashes

from megarl.config import load_config
from megarl.engines.client import SGLangClient
from megarl.engines.types import PauseMode
from megarl.parallel import free_port
from megarl.sync import WeightSync
from megarl.sync.buckets import BucketIndex, TensorEntry
from megarl.sync.engine_layout import EngineLayout
from megarl.sync.errors import WeightSyncError
from megarl.sync.report import SenderStats
from megarl.sync.settings import SyncSettings
from megarl.sync.slices import EngineRank, engine_piece, plan_transfers
from megarl.sync.transports.sharded import entries_by_engine, join_link
from megarl.wire.weight_shards import LOAD_FORMAT, Piece, exchange, join_all

pytestmark = pytest.mark.processes


class WholeTensorTrainer:
    """The trainer protocol (:class:`megarl.sync.trainer_protocol.WeightSyncTrainer`) of one rank that holds
    every HF tensor of ``tensors`` whole and sends one bucket per sync over the sharded link; ``layout``
    (None: the one the driver read from the engines) is the engine layout its slice map plans for."""

    def __init__(self, tensors: dict[str, torch.Tensor], layout: EngineLayout | None = None):
        self.tensors, self.layout, self.splits = tensors, layout, {n: s for n, (_, s) in qwen3_moe_table().items()}
        self.spec = self.group = self.transfers = self.thread = None
        self.pending, self.errors = False, []

    async def weight_sync_address(self) -> list:
        return [{"stage": 0, "host": "127.0.0.1", "port": free_port("127.0.0.1"), "backend": "gloo"}]

    async def weight_sync_connect(self, spec) -> list:
        self.spec, self.group = spec, await asyncio.to_thread(join_link, spec, 0)
        return [None]

    async def weight_sync_begin(self, kind: str, version: int, capacity: int, delta=None) -> list:
        self.pending = True
        return [None]

    async def weight_sync_next(self) -> list:
        if not self.pending:
            return [None]
        self.pending, layout = False, self.layout or self.spec.engine_layout
        wants = [(1 + r, piece) for r in range(layout.tp) for name, t in self.tensors.items()
                 if (piece := engine_piece(name, "float32", tuple(t.shape), self.splits[name], EngineRank(r, layout),
                                           EXPERTS))]
        held = [(0, Piece.whole(n, "float32", tuple(t.shape))) for n, t in self.tensors.items()]
        self.transfers = plan_transfers(held, wants)
        entries = tuple(TensorEntry(n, "float32", tuple(t.shape), 0) for n, t in self.tensors.items())
        return [BucketIndex(0, 0, entries, sum(e.nbytes for e in entries), last=True)]

    async def weight_sync_send(self) -> list:
        def send():
            try:
                join_all(self.group, torch.device("cpu"), datetime.timedelta(seconds=60))
                exchange(0, self.transfers, lambda t: t.piece.narrow(self.tensors[t.piece.name]), self.group,
                         torch.device("cpu"), datetime.timedelta(seconds=60))
            except Exception as e:  # the sync fails on the engine's side too; raised again by finish
                self.errors.append(e)

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()
        return [(LOAD_FORMAT, entries_by_engine(self.transfers, 1, self.spec.engine_tp, 1))]

    async def weight_sync_finish(self) -> list:
        await asyncio.to_thread(self.thread.join)
        if self.errors:
            raise self.errors[0]
        per_rank = {t.dst: sum(x.piece.nbytes for x in self.transfers if x.dst == t.dst) for t in self.transfers}
        return [SenderStats(stage=0, bytes=sum(per_rank.values()), buckets=1, tensors=len(self.tensors),
                            per_engine_rank=per_rank)]

    async def weight_sync_disconnect(self, kind: str) -> list:
        return await self.weight_sync_abort()

    async def weight_sync_abort(self) -> list:
        group, self.group = self.group, None
        if group is not None:
            torch.distributed.distributed_c10d._abort_process_group(group)
        return [None]


@pytest.fixture(scope="module")
def dp_attention_engine(tiny_checkpoint, tmp_path_factory):
    """An SGLang CPU engine of two ranks with DP attention over both (float32, 1024 KV tokens)."""
    from megarl.engines.server import EngineSettings, SGLangEngine

    settings = EngineSettings(model_path=tiny_checkpoint, dtype="float32", max_total_tokens=1024, tp=2,
                              mem_fraction_static=0.75, extra_args=("--attn-dp-size", "2"),
                              log_path=str(tmp_path_factory.mktemp("sglang_dp_attention") / "server.log"))
    with SGLangEngine(settings) as eng:
        yield eng


@pytest.fixture(scope="module")
def moved_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with every tensor moved by random noise (the weights a sync brings)."""
    out = tmp_path_factory.mktemp("moved") / "tiny_moved"
    shutil.copytree(tiny_checkpoint, out)
    gen = torch.Generator().manual_seed(3)
    tensors = load_file(out / "model.safetensors")
    tensors = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in tensors.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def sync_settings(tmp_path) -> SyncSettings:
    base = SyncSettings.from_config(load_config(["recipe=tiny_moe_cpu"]).sync)
    return dataclasses.replace(base, transport="sharded", engine_tp=2, timeout_s=120, work_dir=str(tmp_path / "sync"))


async def sharded_sync(client, trainer, tmp_path, version: int):
    sync = WeightSync(sync_settings(tmp_path), trainer, [client])
    try:
        return await sync.update(version, PauseMode.ABORT)
    finally:
        await sync.close()


async def sync_then_disk(engine, moved, tmp_path) -> dict:
    """The engine's /server_info and the hashes of its parameters as started, after a sharded sync planned
    for the engine's layout (one planned for the wrong layout fails first) and after a disk load of the same
    weights."""
    async with SGLangClient(engine.url, engine.model) as client:
        info = await client.server_info()
        out = {"info": info, "start": await rank_hashes(client)}
        tensors = load_file(moved / "model.safetensors")
        with pytest.raises(WeightSyncError, match=r"parameters of this engine rank hold NaN after the sync") as error:
            await sharded_sync(client, WholeTensorTrainer(tensors, EngineLayout.tensor_parallel(2)), tmp_path, 5)
        assert error.value.held == [engine.url]  # it may hold part of the weights: paused, out of the set
        await client.continue_generation()
        out["report"] = await sharded_sync(client, WholeTensorTrainer(tensors), tmp_path, 6)
        out["sharded"] = await rank_hashes(client)
        await client.update_weights_from_disk(str(moved), version=7)
        out["disk"] = await rank_hashes(client)
        return out


def test_sharded_sync_into_a_dp_attention_engine_loads_what_a_disk_load_does(dp_attention_engine, moved_checkpoint,
                                                                               tmp_path):
    seen = asyncio.run(sync_then_disk(dp_attention_engine, moved_checkpoint, tmp_path))
    assert seen["info"]["enable_dp_attention"] and seen["info"]["attn_dp_size"] == 2 == seen["info"]["tp_size"]
    assert seen["sharded"] == seen["disk"]  # every parameter of both ranks, as SGLang hashes it
    assert seen["sharded"] != seen["start"]  # the weights moved (not a vacuous comparison)
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(moved_checkpoint / "model.safetensors").values())
    report = seen["report"]
    assert report.transport == "sharded" and report.version == 6
    print(f"\n[measured] DP-attention engine: bytes per engine rank / model bytes "
          f"{report.bytes_per_engine_rank / model_bytes:.3f}")


def test_the_idle_dp_attention_engine_leaves_the_cores_alone(dp_attention_engine):
    """Its processes (server, data-parallel controller, two schedulers, detokenizer) use almost no CPU while
    idle: SGLang's controller polls the tokenizer's socket without a wait, a whole core, unless
    :mod:`megarl.engine_process.controller_wait` lets it wait on the socket."""
    processes = server_processes(dp_attention_engine)
    assert any("data_parallel_controller" in p.name() for p in processes), [p.name() for p in processes]
    before = cpu_seconds(processes)
    time.sleep(3.0)
    used = cpu_seconds(processes) - before
    assert used < 0.6, f"the idle engine's {len(processes)} processes used {used:.2f} s of CPU in 3 s"
