"""The weight-sync rank side (megarl/sync/rank.py, link.py, stage_link.py): a trainer rank's links, one per
transport, made through the transport registry, and each sync run through one of them without naming a
transport; the trainer's sync calls written once (megarl/sync/trainer_protocol.py: one generic rank call)."""
from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from megarl.sync import rank
from megarl.sync.buckets import BucketIndex, TensorEntry
from megarl.sync.errors import WeightSyncError
from megarl.sync.link import RankContext, RankLink
from megarl.sync.report import SenderStats
from megarl.sync.trainer_protocol import RANK_CALLS, WeightSyncTrainer
from megarl.sync.transports import REGISTRY, LinkSpec, Transport

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RANK_SIDE = ("megarl/sync/rank.py", "megarl/sync/link.py", "megarl/sync/stage_link.py")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def transport_names(source: str, path: str) -> list[str]:
    """``path:line: ...`` for each place in ``source`` that names a transport: a string constant (not a
    docstring) equal to a registered transport's name, or an import of one transport's module."""
    tree = ast.parse(source, filename=path)
    docstrings, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and node.value in REGISTRY:
            found.append(f"{path}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in {*REGISTRY, "sharded_rank"}:
            found.append(f"{path}:{node.lineno}: from {node.module} import ...")
    return found


def test_the_rank_side_names_no_transport():
    """RankSync and the link interface dispatch without comparing a transport's name (the registry makes each
    link); the stage path knows no transport either."""
    found = [f for path in RANK_SIDE for f in transport_names((ROOT / path).read_text(), path)]
    assert not found, "the rank side names a transport:\n" + "\n".join(found)


def test_the_check_sees_a_branch_on_a_transport_name():
    branch = 'def begin(self, kind):\n    """A docstring naming \'sharded\' is fine."""\n    if kind == "sharded":\n' \
             '        from megarl.sync.sharded_rank import ShardedLink\n'
    assert sorted(transport_names(branch, "x.py")) == ["x.py:3: 'sharded'",
                                                       "x.py:4: from megarl.sync.sharded_rank import ..."]


class Recorded(RankLink):
    """A link of a transport that is not in the registry: records every call with its link name."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls, self.seq = name, calls, 0

    def begin(self, version, capacity, delta):
        self.calls.append((self.name, "begin", version, capacity, delta))

    def next(self):
        self.calls.append((self.name, "next"))
        self.seq += 1
        entry = TensorEntry("w", "float32", (2,), 0)
        return None if self.seq > 2 else BucketIndex(0, self.seq - 1, (entry,), 8, last=self.seq == 2)

    def send(self):
        self.calls.append((self.name, "send"))
        return f"{self.name}-payload-{self.seq}"

    def finish(self):
        self.calls.append((self.name, "finish"))
        return SenderStats(stage=0, bytes=16, buckets=2)

    def abort(self):
        self.calls.append((self.name, "abort"))
        raise WeightSyncError("a transfer had failed")

    def close(self):
        self.calls.append((self.name, "close"))


class NewSpec(LinkSpec):
    kind: ClassVar[str] = "new"


class OtherSpec(LinkSpec):
    kind: ClassVar[str] = "other"


@pytest.fixture
def two_new_transports(monkeypatch):
    """Two transports added to the registry (each one link class); the calls their links got, and a rank."""
    calls, made = [], []

    def link(spec, context: RankContext) -> RankLink:
        made.append((spec.kind, context.stage, context.is_sender, context.aborting))
        return Recorded(spec.kind, calls)

    for name in ("new", "other"):
        monkeypatch.setitem(REGISTRY, name, Transport(link, lambda settings: None))
    monkeypatch.setattr(rank, "pipeline_stage", lambda: 1)
    monkeypatch.setattr(rank, "is_stage_sender", lambda: True)
    return calls, made, rank.RankSync(model=None)


def test_a_new_transport_is_one_link_class_reached_through_the_registry(two_new_transports):
    calls, made, sync = two_new_transports
    sync.connect(NewSpec())
    sync.connect(OtherSpec())
    assert made == [("new", 1, True, sync._aborting), ("other", 1, True, sync._aborting)]
    sync.begin("other", 7, 64, None)
    sent = []
    while (index := sync.next()) is not None:
        sent.append((index.seq, sync.send()))
    stats = sync.finish()
    assert sent == [(0, "other-payload-1"), (1, "other-payload-2")] and stats.bytes == 16
    assert calls == [("other", "begin", 7, 64, None), ("other", "next"), ("other", "send"), ("other", "next"),
                     ("other", "send"), ("other", "next"), ("other", "finish")]
    with pytest.raises(RuntimeError, match="no 'gone' weight-sync link on this rank: connect first"):
        sync.begin("gone", 8, 64)
    sync.connect(NewSpec())  # replaces the older link of the same transport
    assert calls[-1] == ("new", "close")


def test_the_rank_runs_one_sync_at_a_time_and_an_abort_closes_every_link(two_new_transports):
    calls, _, sync = two_new_transports
    sync.connect(NewSpec())
    sync.connect(OtherSpec())
    with pytest.raises(RuntimeError, match="begin first"):
        sync.next()
    sync.begin("new", 1, 64)
    with pytest.raises(RuntimeError, match="already running"):
        sync.begin("other", 1, 64)
    sync.next()
    calls.clear()
    sync.abort()  # the running link's abort raised (a failed transfer): logged, the links are closed anyway
    assert calls == [("new", "abort"), ("new", "close"), ("other", "close")]
    with pytest.raises(RuntimeError, match="connect first"):
        sync.begin("new", 2, 64)


def test_the_rank_calls_are_rank_syncs_methods():
    public = {name for name, value in vars(rank.RankSync).items() if callable(value) and not name.startswith("_")}
    assert public == {*RANK_CALLS, "abort"}


def test_the_trainer_protocol_is_written_once():
    """Each driver-side call is one rank call through ``on_ranks``; the trainer's rank actor has one generic
    call (and the abort, in its own concurrency group) and its group no forwarder of its own."""
    from megarl.trainer.actor import TrainerGroup, TrainerRank

    class Trainer(WeightSyncTrainer):
        def __init__(self):
            self.calls = []

        async def on_ranks(self, call, *args):
            self.calls.append((call, *args))
            return [call]

    trainer, spec = Trainer(), NewSpec()

    async def every_call():
        return [await trainer.weight_sync_address(), await trainer.weight_sync_connect(spec),
                await trainer.weight_sync_disconnect("new"), await trainer.weight_sync_begin("new", 3, 64),
                await trainer.weight_sync_next(), await trainer.weight_sync_send(), await trainer.weight_sync_finish(),
                await trainer.weight_sync_abort()]

    results = asyncio.run(every_call())
    assert trainer.calls == [("address",), ("connect", spec), ("disconnect", "new"), ("begin", "new", 3, 64, None),
                             ("next",), ("send",), ("finish",), ("abort",)]
    assert results == [[c[0]] for c in trainer.calls]
    assert [n for n in vars(TrainerGroup) if n.startswith("weight_sync")] == []
    assert sorted(n for n in vars(TrainerRank) if n.startswith("weight_sync")) == ["weight_sync", "weight_sync_abort"]


def test_the_trainer_routes_the_rank_calls():
    """TrainerRank.weight_sync runs the RankSync method named (and nothing else); TrainerGroup sends the abort to
    the ranks' own concurrency group, every other call to the generic one."""
    from megarl.trainer.actor import TrainerGroup, TrainerRank

    rank_sync = SimpleNamespace(next=lambda: "index", begin=lambda *args: args)
    actor = SimpleNamespace(_weight_sync=rank_sync, trainable=None)
    assert TrainerRank.weight_sync(actor, "next") == "index"
    assert TrainerRank.weight_sync(actor, "begin", "disk", 2, 64, None) == ("disk", 2, 64, None)
    for call in ("abort", "_drop", "model"):
        with pytest.raises(ValueError, match=f"no rank call '{call}'"):
            TrainerRank.weight_sync(actor, call)

    group, sent = object.__new__(TrainerGroup), []

    async def call_all(method, *args):
        sent.append((method, *args))
        return [None]

    group._call_all = call_all
    asyncio.run(group.weight_sync_abort())
    asyncio.run(group.weight_sync_begin("disk", 4, 32))
    assert sent == [("weight_sync_abort",), ("weight_sync", "begin", "disk", 4, 32, None)]


def test_each_spec_holds_its_transports_fields_only():
    """A spec a transport: each engine side's spec is of its own class, named by its transport, pickled whole."""
    import pickle

    from megarl.sync.engine_layout import EngineLayout
    from megarl.sync.settings import SyncSettings
    from megarl.sync.transports import make_engine_side

    fields = {}
    for name in REGISTRY:
        side = make_engine_side(SyncSettings(transport=name, work_dir="/tmp/w", timeout_s=5.0, engine_tp=2))
        if name == "sharded":
            side.engine_layout = EngineLayout(tp=2, attn_tp=2)
        spec = side.link_spec(3)
        assert spec.kind == name == side.name and pickle.loads(pickle.dumps(spec)) == spec
        fields[name] = set(vars(spec))
    assert fields == {"distributed": {"group_prefix", "engine_ranks", "timeout_s"},
                      "tensor": {"engine_tp", "engines"},
                      "disk": {"work_dir"},
                      "sharded": {"group_prefix", "engine_ranks", "timeout_s", "engine_tp", "engine_layout",
                                  "rendezvous", "trainer_ranks"}}


def test_the_stage_path_sends_through_its_sender_on_the_stage_sender_only(monkeypatch):
    """The stage path on a sending rank packs the stage's stream into buckets for its sender and reports them;
    off the sender it gathers the same stream and sends nothing."""
    import threading

    from megarl.sync import stage_link
    from megarl.sync.transports.base import Sender

    class Collecting(Sender):
        def __init__(self):
            super().__init__()
            self.sent = []

        def new_buffer(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8)

        def prepare(self, bucket):
            return f"bucket-{bucket.index.seq}"

        def transfer(self, bucket):
            self.sent.append({name: t.clone() for name, t in bucket.views()})

    stream = [("a", torch.arange(4.0)), ("b", torch.ones(4)), ("c", torch.full((2,), 3.0))]
    pulled = []

    def hf_stream(model):
        for name, tensor in stream:
            pulled.append(name)
            yield name, tensor

    monkeypatch.setattr(stage_link, "stage_hf_stream", hf_stream)
    outcomes = {}
    for is_sender in (True, False):
        sender = Collecting()
        link = stage_link.StageLink(RankContext(None, 0, is_sender, None, threading.Event()), lambda made=sender: made)
        link.begin(1, 32, None)
        rounds = [(link.next(), link.send()) for _ in range(3)]  # every rank in lock-step: two buckets, the end
        outcomes[is_sender] = (rounds, link.finish(), sender.sent)
    rounds, stats, sent = outcomes[True]
    assert [(i.seq, i.last, payload) for i, payload in rounds[:2]] == [(0, False, "bucket-0"), (1, True, "bucket-1")]
    assert rounds[2] == (None, None) and (stats.bytes, stats.buckets, stats.tensors) == (40, 2, 3)
    assert [{n: t.tolist() for n, t in bucket.items()} for bucket in sent] == \
        [{"a": [0.0, 1.0, 2.0, 3.0], "b": [1.0] * 4}, {"c": [3.0, 3.0]}]
    assert outcomes[False] == ([(None, None)] * 3, None, []) and pulled == ["a", "b", "c"] * 2
