"""Sharded resharding's slice map and point-to-point exchange (megarl/sync/slices.py,
megarl/wire/weight_shards.py), against the full tensors sliced another way.

A Qwen3-MoE-shaped tensor table (the tiny demo model's sizes) is split as a TP2xEP2 trainer holds it;
the engine ranks' parts follow SGLang's loaders. The unit tests apply the planned transfers in memory
(trainer and engine TP equal and unequal, KV heads replicated over engine ranks); the process test runs
the exchange over gloo between four trainer ranks and one TP2+EP2 engine (two ranks) and checks every
received slice bit for bit and the bytes each engine rank received.
"""
import dataclasses
import json

import pytest
import torch
import torch.multiprocessing as mp

from megarl.sync.engine_layout import EngineLayout
from megarl.sync.slices import EngineRank, Split, chunk, engine_piece, plan_transfers
from megarl.wire.weight_shards import Piece, assemble, entry_name, exchange, parse_entries

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, MOE_FFN, VOCAB, LAYERS = 64, 4, 2, 16, 8, 128, 384, 2


def qwen3_moe_table() -> dict[str, tuple[tuple[int, ...], Split]]:
    """HF name -> (shape, split) of a Qwen3-MoE with the tiny demo model's sizes (test fixture data:
    the transport reads splits from megatron-bridge's mappings instead)."""
    table = {"model.embed_tokens.weight": ((VOCAB, HIDDEN), Split(0, vocab=True)),
             "lm_head.weight": ((VOCAB, HIDDEN), Split(0, vocab=True)),
             "model.norm.weight": ((HIDDEN,), Split(None))}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        table[p + "self_attn.q_proj.weight"] = ((HEADS * HEAD_DIM, HIDDEN), Split(0))
        table[p + "self_attn.k_proj.weight"] = ((KV_HEADS * HEAD_DIM, HIDDEN), Split(0, kv_heads=KV_HEADS))
        table[p + "self_attn.v_proj.weight"] = ((KV_HEADS * HEAD_DIM, HIDDEN), Split(0, kv_heads=KV_HEADS))
        table[p + "self_attn.o_proj.weight"] = ((HIDDEN, HEADS * HEAD_DIM), Split(1))
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            table[p + norm + ".weight"] = ((HEAD_DIM,), Split(None))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            table[p + norm + ".weight"] = ((HIDDEN,), Split(None))
        table[p + "mlp.gate.weight"] = ((EXPERTS, HIDDEN), Split(None))
        for e in range(EXPERTS):
            for proj, shape, dim in (("gate_proj", (MOE_FFN, HIDDEN), 0), ("up_proj", (MOE_FFN, HIDDEN), 0),
                                     ("down_proj", (HIDDEN, MOE_FFN), 1)):
                table[f"{p}mlp.experts.{e}.{proj}.weight"] = (shape, Split(dim, expert=e))
    return table


def full_tensors(table) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, (shape, _) in table.items()}


def trainer_holdings(table, tp: int, ep: int, world: int) -> list[tuple[int, Piece]]:
    """What each rank of a trainer of ``world`` ranks holds with TP ``tp`` (TP rank ``r % tp``), experts
    over ``ep`` ranks (EP rank ``r % ep``) whole; data-parallel copies repeat."""
    out = []
    for rank in range(world):
        tp_rank, ep_rank = rank % tp, rank % ep
        for name, (shape, split) in table.items():
            if split.expert is not None:
                if split.expert // (EXPERTS // ep) == ep_rank:
                    out.append((rank, Piece.whole(name, "float32", shape)))
            elif split.dim is None or tp == 1:
                out.append((rank, Piece.whole(name, "float32", shape)))
            else:
                start, stop = chunk(shape[split.dim], tp, tp_rank)
                out.append((rank, Piece(name, "float32", shape, split.dim, start, stop)))
    return out


def engine_wants(table, tp: int, ep: int, offset: int, layout: EngineLayout | None = None) -> list[tuple[int, Piece]]:
    """(update-group rank, piece) of what each rank of an engine of ``layout`` (default: TP ``tp``, EP ``ep``)
    loads, its ranks from ``offset`` on."""
    layout = layout or EngineLayout.tensor_parallel(tp, ep)
    return [(offset + r, piece) for r in range(layout.tp) for name, (shape, split) in table.items()
            if (piece := engine_piece(name, "float32", shape, split, EngineRank(r, layout), EXPERTS)) is not None]


def check_in_memory(trainer_tp: int, engine_tp: int, engine_ep: int, layout: EngineLayout | None = None):
    """Apply the planned transfers in memory; every engine rank's wanted part must equal the full tensor's."""
    table, full = qwen3_moe_table(), None
    full = full_tensors(table)
    wants = engine_wants(table, engine_tp, engine_ep, offset=4, layout=layout)
    transfers = plan_transfers(trainer_holdings(table, trainer_tp, 2, 4), wants)
    got: dict[tuple[int, str], torch.Tensor] = {}
    for t in transfers:
        held_values = t.held.narrow(full[t.piece.name])
        values = t.piece.narrow(held_values, t.held)
        target = got.setdefault((t.dst, t.piece.name), torch.full(full[t.piece.name].shape, float("nan")))
        t.piece.narrow(target).copy_(values)
    for dst, wanted in wants:
        assert torch.equal(wanted.narrow(got[dst, wanted.name]), wanted.narrow(full[wanted.name])), (dst, wanted)
    return transfers, wants


@pytest.mark.unit
def test_tp2_ep2_trainer_into_tp2_ep2_engine_moves_about_half_the_model_per_engine_rank():
    transfers, wants = check_in_memory(trainer_tp=2, engine_tp=2, engine_ep=2)
    model_bytes = sum(Piece.whole(n, "float32", s).nbytes for n, (s, _) in qwen3_moe_table().items())
    for dst in (4, 5):
        received = sum(t.piece.nbytes for t in transfers if t.dst == dst)
        assert received == sum(p.nbytes for d, p in wants if d == dst)
        assert received <= 0.55 * model_bytes, f"engine rank {dst} receives {received / model_bytes:.3f} of the model"
    assert {t.src for t in transfers} == {0, 1, 2, 3}  # every trainer rank sends, none gathers


@pytest.mark.unit
def test_trainer_tp_differs_from_engine_tp_and_kv_heads_replicate():
    transfers, wants = check_in_memory(trainer_tp=2, engine_tp=4, engine_ep=2)
    k0 = {d: p for d, p in wants if p.name == "model.layers.0.self_attn.k_proj.weight"}
    assert (k0[4].start, k0[4].stop) == (k0[5].start, k0[5].stop) == (0, HEAD_DIM)  # 2 KV heads over 4 ranks
    assert (k0[6].start, k0[6].stop) == (HEAD_DIM, 2 * HEAD_DIM)
    q0 = [t for t in transfers if t.piece.name == "model.layers.0.self_attn.q_proj.weight" and t.dst == 5]
    assert [(t.src % 2, t.piece.start, t.piece.stop) for t in q0] == [(0, HEAD_DIM, 2 * HEAD_DIM)]
    check_in_memory(trainer_tp=4, engine_tp=2, engine_ep=1)  # an engine rank's chunk from two trainer ranks


@pytest.mark.unit
def test_plan_refuses_a_part_no_trainer_rank_holds():
    table = qwen3_moe_table()
    holdings = [(r, p) for r, p in trainer_holdings(table, 2, 2, 4) if not (r % 2 == 1 and p.name == "lm_head.weight")]
    with pytest.raises(ValueError, match="lm_head.weight: the trainer ranks hold 0 of the"):
        plan_transfers(holdings, engine_wants(table, 2, 1, offset=4))


# Resolved server arguments (the /server_info fields the layout reads) of engines with DP attention, the LM head
# over the attention-TP group, and MoE data parallelism; the last without DP attention.
SERVER_LAYOUTS = [
    {"tp_size": 4, "attn_dp_size": 4, "ep_size": 2, "enable_dp_attention": True},
    {"tp_size": 4, "attn_dp_size": 2, "ep_size": 4, "enable_dp_attention": True, "enable_dp_lm_head": True},
    {"tp_size": 4, "attn_dp_size": 2, "ep_size": 2, "moe_dp_size": 2, "enable_dp_attention": True},
    {"tp_size": 8, "attn_dp_size": 1, "ep_size": 2},
]


def sglang_rows(name: str, shape: tuple, split: Split, info: dict, tp_rank: int):
    """(dim, start, stop) of HF tensor ``name`` that SGLang's loader of engine rank ``tp_rank`` reads (None:
    none; dim None: whole), computed with SGLang's own functions from its resolved server arguments ``info``."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size
    from sglang.srt.runtime_context import derive_attention_ranks, derive_parallel_widths, derive_spawn_ranks

    tp, moe_dp, ep = info["tp_size"], info.get("moe_dp_size", 1), info["ep_size"]
    widths = derive_parallel_widths(tp_size=tp, attn_cp_size=1, attn_dp_size=info["attn_dp_size"], moe_ep_size=ep,
                                    moe_dp_size=moe_dp, dcp_size=1, dcp_enabled=False)
    attn_tp = widths["attn_tp_size"]
    attn_rank, _ = derive_attention_ranks(tp_rank=tp_rank, attn_tp_size=attn_tp, attn_cp_size=1)
    if split.expert is not None:
        ranks = derive_spawn_ranks(world_rank=tp_rank, tp_size=tp, ep_join_rank_offset=0, attn_cp_size=1,
                                   attn_tp_size=attn_tp, moe_dp_size=moe_dp, moe_ep_size=ep)
        if split.expert // (EXPERTS // ep) != ranks["moe_ep_rank"]:  # FusedMoE: contiguous runs per EP rank
            return None
        rank, size = ranks["moe_tp_rank"], widths["moe_tp_size"]
    elif split.vocab:
        rank, size = (attn_rank, attn_tp) if "embed" in name or info.get("enable_dp_lm_head") else (tp_rank, tp)
        padding = 64 if pad_vocab_size(shape[0], 64) % size == 0 else 64 * size
        padded = pad_vocab_size(shape[0], padding)
        index = VocabParallelEmbedding._get_indices(padded, padded, shape[0], shape[0], rank, size)
        return (None, 0, 0) if size == 1 else (0, index.org_vocab_start_index, index.org_vocab_end_index)
    elif ".self_attn." in name:
        rank, size = attn_rank, attn_tp
        if split.kv_heads and split.kv_heads < size:  # QKVParallelLinear: shard kv_tp_rank // num_kv_head_replicas
            replicas = size // split.kv_heads
            rank, size = rank // replicas, size // replicas
    else:
        rank, size = tp_rank, tp
    if split.dim is None or size == 1:
        return None, 0, 0
    per = shape[split.dim] // size
    return split.dim, rank * per, (rank + 1) * per


@pytest.mark.unit
@pytest.mark.parametrize("info", SERVER_LAYOUTS, ids=["dp-attention", "dp-lm-head", "moe-dp", "tp8-ep2"])
def test_slice_map_follows_the_engines_resolved_layout(info):
    """Under DP attention the attention and the embedding are split over the attention-TP group (whole on each
    rank when it is one rank), the head per enable_dp_lm_head, experts per EP and MoE-DP: each engine rank's
    piece of every tensor is the rows SGLang's own sharding functions give; a TP2xEP2 trainer's slices cover
    them, bit for bit."""
    from megarl.sync.engine_layout import layout_from_server_info

    layout = layout_from_server_info(info)
    table = {**qwen3_moe_table(), "model.layers.0.mlp.gate_proj.weight": ((MOE_FFN, HIDDEN), Split(0)),
             "model.layers.0.mlp.down_proj.weight": ((HIDDEN, MOE_FFN), Split(1))}  # a dense MLP: over all ranks
    for tp_rank in range(layout.tp):
        for name, (shape, split) in table.items():
            piece = engine_piece(name, "float32", shape, split, EngineRank(tp_rank, layout), EXPERTS)
            got = None if piece is None else (piece.dim, piece.start, piece.stop)
            assert got == sglang_rows(name, shape, split, info, tp_rank), (tp_rank, name)
    if info["tp_size"] == 4:
        check_in_memory(trainer_tp=2, engine_tp=layout.tp, engine_ep=layout.ep, layout=layout)


@pytest.mark.unit
@pytest.mark.parametrize("key, value", [
    ("ep_num_redundant_experts", 8), ("enable_eplb", True), ("init_expert_location", "random"),
    ("elastic_ep_backend", "mooncake"), ("moe_a2a_backend", "deepep"), ("attn_cp_size", 2), ("dp_size", 2),
    ("enable_dense_mlp_attn_tp", True), ("shared_experts_tp_size", 1), ("quantization", "fp8"),
    ("moe_dense_tp_size", 1),
])
def test_engine_settings_the_slice_map_does_not_handle_are_refused_naming_the_key(key, value):
    from megarl.sync.engine_layout import layout_from_server_info

    info = {"tp_size": 4, "attn_dp_size": 4, "ep_size": 4, "moe_dp_size": 1, "enable_dp_lm_head": False,
            "ep_num_redundant_experts": 0, "enable_eplb": False, "moe_a2a_backend": "none", "attn_cp_size": 1}
    assert layout_from_server_info(info) == EngineLayout(tp=4, attn_tp=1, ep=4)
    with pytest.raises(ValueError, match=rf"^the engine runs with {key}={value!r}, .*use sync.transport=distributed$"):
        layout_from_server_info({**info, key: value})
    with pytest.raises(ValueError, match="does not map shared experts"):
        engine_piece("model.layers.0.mlp.shared_experts.gate_proj.weight", "float32", (8, 4), Split(0),
                     EngineRank(0, EngineLayout.tensor_parallel(2)), EXPERTS)


@pytest.mark.unit
def test_vocab_rows_pad_to_sglang_padding_and_entries_round_trip():
    assert chunk(100, 2, 0, pad_to=64) == (0, 64) and chunk(100, 2, 1, pad_to=64) == (64, 100)
    with pytest.raises(ValueError, match="do not split into 3 equal chunks"):
        chunk(64, 3, 0)
    transfers, _ = check_in_memory(trainer_tp=2, engine_tp=2, engine_ep=2)
    names = [entry_name(t) for t in transfers]
    parsed = parse_entries(names, [t.piece.dtype for t in transfers], [list(t.piece.shape) for t in transfers])
    assert parsed == [(t.src, t.dst, t.piece) for t in transfers]
    with pytest.raises(ValueError, match="is not a megarl_sharded entry"):
        parse_entries(["model.norm.weight"], ["float32"], [[HIDDEN]])
    full = torch.arange(24.0).view(4, 6)
    halves = [Piece("w", "float32", (4, 6), 1, 0, 2), Piece("w", "float32", (4, 6), 1, 2, 6)]
    whole = Piece.whole("b", "float32", (6,))
    (w, assembled), (b, bias) = assemble([(p, p.narrow(full)) for p in halves] + [(whole, full[0])])
    assert (w, b) == ("w", "b") and torch.equal(assembled, full) and torch.equal(bias, full[0])


def _exchange_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    table = qwen3_moe_table()
    full = full_tensors(table)
    holdings = trainer_holdings(table, 2, 2, 4)
    transfers = plan_transfers(holdings, engine_wants(table, 2, 2, offset=4))
    received = exchange(rank, transfers, lambda t: t.piece.narrow(t.held.narrow(full[t.piece.name]), t.held),
                        None, torch.device("cpu"))
    wrong = [p.name for p, values in received if not torch.equal(values, p.narrow(full[p.name]))]
    nbytes = sum(p.nbytes for p, _ in received)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump({"wrong": wrong, "bytes": nbytes, "pieces": len(received)}, f)
    torch.distributed.destroy_process_group()


@pytest.mark.processes
def test_exchange_over_gloo_moves_each_slice_once_to_its_engine_rank(tmp_path):
    from megarl.parallel import free_port

    mp.spawn(_exchange_worker, args=(6, free_port("127.0.0.1"), str(tmp_path)), nprocs=6, join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(6)]
    model_bytes = sum(Piece.whole(n, "float32", s).nbytes for n, (s, _) in qwen3_moe_table().items())
    assert all(not r["wrong"] for r in results), [r["wrong"][:3] for r in results]
    assert [r["pieces"] for r in results[:4]] == [0] * 4  # trainer ranks receive nothing
    for r in results[4:]:
        assert 0.45 * model_bytes < r["bytes"] <= 0.55 * model_bytes, r["bytes"] / model_bytes


def _local_export_worker(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    from megarl.models.bridge import ModelSettings, build_megatron_model, export_hf_state
    from megarl.parallel import Layout
    from megarl.sync.local_export import local_tasks, task_slices
    from megarl.sync.sharded_rank import bucket_runs
    from megarl.trainer.distributed import init_rank, shutdown_rank

    layout = Layout(world_size=4, tp=2, ep=2)
    init_rank(rank, layout, "127.0.0.1", port, backend="gloo")
    torch.set_num_threads(1)
    model = build_megatron_model(checkpoint, layout, ModelSettings(transformer_impl="local"))
    groups = model.bridge.hf_pretrained.config.num_key_value_heads
    tasks = local_tasks(model)
    slices = [s for task in tasks for s in task_slices(task, groups)]
    reference = export_hf_state(model)  # megatron-bridge's gathered export
    wrong = [s.piece.name for s in slices if not torch.equal(s.tensor.cpu(), s.piece.narrow(reference[s.piece.name]))]
    buckets = [[s.piece.name for i in run for s in task_slices(tasks[i], groups)]
               for run in bucket_runs(tasks, BUCKET_CAPACITY)]
    torch.save({"wrong": wrong, "held": [(rank, s.piece, s.split) for s in slices], "buckets": buckets,
                "shapes": {n: tuple(t.shape) for n, t in reference.items()}}, f"{out_dir}/{rank}.pt")
    shutdown_rank()


BUCKET_CAPACITY = 2**18  # bytes: the tiny model's 1.9 MB in about eight buckets


@pytest.mark.processes
def test_trainer_ranks_local_slices_equal_the_gathered_export_and_cover_every_engine_rank(tiny_checkpoint,
                                                                                          tmp_path):
    """TP2xEP2 trainer: each rank's HF slices (bridge mappings over its own groups) are bit-equal to the
    full export's rows; together they cover what every rank of a TP2+EP2 engine loads. The sync's buckets
    are cut by the model bytes they cover: the HF tensors of one bucket over all ranks (what an engine rank
    assembles at most) stay within the bucket capacity, and the model takes about as many buckets as its
    bytes fill."""
    from megarl.parallel import free_port

    mp.spawn(_local_export_worker, args=(free_port("127.0.0.1"), tiny_checkpoint, str(tmp_path)), nprocs=4, join=True)
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(4)]
    assert all(not r["wrong"] for r in results), [r["wrong"][:3] for r in results]
    held = [(rank, piece) for r in results for rank, piece, _ in r["held"]]
    splits = {piece.name: split for r in results for _, piece, split in r["held"]}
    shapes = results[0]["shapes"]
    assert set(splits) == set(shapes)
    assert splits["model.layers.0.self_attn.o_proj.weight"].dim == 1 and splits["lm_head.weight"].vocab
    assert splits["model.layers.1.mlp.experts.5.down_proj.weight"].expert == 5
    assert any(p.dim == 0 and p.stop - p.start < shapes[p.name][0] for _, p in held)  # some slices are partial
    engine = EngineLayout.tensor_parallel(2, 2)
    wants = [(4 + r, piece) for r in range(2) for name, split in splits.items()
             if (piece := engine_piece(name, "float32", shapes[name], split, EngineRank(r, engine), EXPERTS))]
    transfers = plan_transfers(held, wants)  # raises when an engine rank's part is not held
    model_bytes = sum(Piece.whole(n, "float32", s).nbytes for n, s in shapes.items())
    assert max(sum(t.piece.nbytes for t in transfers if t.dst == d) for d in (4, 5)) <= 0.55 * model_bytes
    assert len({len(r["buckets"]) for r in results}) == 1  # every rank cuts the same number of buckets
    covered = [set().union(*names) for names in zip(*(r["buckets"] for r in results))]
    assert sorted(n for bucket in covered for n in bucket) == sorted(shapes)  # each tensor in one bucket
    per_bucket = [sum(Piece.whole(n, "float32", shapes[n]).nbytes for n in bucket) for bucket in covered]
    assert max(per_bucket) <= BUCKET_CAPACITY, per_bucket
    assert len(per_bucket) <= 2 * -(-model_bytes // BUCKET_CAPACITY), per_bucket
    print(f"\n[measured] {len(per_bucket)} buckets of {BUCKET_CAPACITY} B capacity, the most model bytes in one: "
          f"{max(per_bucket)}")


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.world_size=2"], r"^sync.transport: sharded resharding plans one pipeline stage"),
    (["lora.enabled=true"], r"^sync.transport: sharded resharding sends the base weights' slices"),
    (["model.arch.num_shared_experts=1"], r"^sync.transport: sharded resharding does not map shared experts"),
])
def test_config_refuses_what_sharded_resharding_does_not_do(overrides, message):
    from megarl.config import ConfigError, load_config

    assert load_config(["recipe=tiny_moe_cpu", "sync.transport=sharded"]).sync.transport == "sharded"
    with pytest.raises(ConfigError, match=message):
        load_config(["recipe=tiny_moe_cpu", "sync.transport=sharded", *overrides])


@pytest.mark.unit
def test_bytes_per_engine_rank_sums_the_senders_counters_per_destination():
    from megarl.sync.report import SenderStats

    stats = [SenderStats(stage=0, bytes=10, per_engine_rank={4: 6, 5: 3}),
             SenderStats(stage=0, bytes=10, per_engine_rank={4: 1, 5: 7})]
    assert stats[0].merge(stats[1]).most_bytes_per_engine_rank == 10
    assert SenderStats(stage=0, bytes=20).most_bytes_per_engine_rank == 20  # broadcast: every rank gets it all


@pytest.mark.unit
@pytest.mark.parametrize("engine_tp, engine_ep, dp_attention", [(2, 2, False), (4, 2, False), (4, 4, False),
                                                                (2, 2, True), (4, 1, True)])
def test_planner_counts_what_the_slice_map_sends_each_engine_rank(engine_tp, engine_ep, dp_attention):
    from megarl.config import load_config
    from megarl.planner.arch import resolve_arch
    from megarl.planner.weight_sync import engine_rank_params

    arch = resolve_arch(load_config(["recipe=tiny_moe_cpu"]))  # the sizes of qwen3_moe_table
    assert (arch.hidden_size, arch.num_experts, arch.num_query_groups) == (HIDDEN, EXPERTS, KV_HEADS)
    layout = EngineLayout(tp=engine_tp, attn_tp=1 if dp_attention else engine_tp, ep=engine_ep)
    wants = engine_wants(qwen3_moe_table(), engine_tp, engine_ep, offset=0, layout=layout)
    per_rank = {sum(p.nbytes for d, p in wants if d == rank) // 4 for rank in range(engine_tp)}
    assert per_rank == {engine_rank_params(arch, engine_tp, layout.attn_tp)}


@pytest.mark.unit
def test_buckets_cut_by_parameter_bytes_and_each_engine_rank_keeps_its_entries():
    from megarl.engine_process.sharded_load import own_transfers
    from megarl.sync.sharded_rank import cut
    from megarl.sync.transports.sharded import entries_by_engine

    assert cut([4, 4, 4, 10, 1], 8) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert cut([4, 4], 0) == [range(0, 1), range(1, 2)] and cut([], 8) == []
    table = qwen3_moe_table()
    transfers = plan_transfers(trainer_holdings(table, 2, 2, 4), engine_wants(table, 2, 2, 4) +
                               engine_wants(table, 2, 2, 6))  # two engines of two ranks
    per_engine = entries_by_engine(transfers, trainer_ranks=4, engine_tp=2, num_engines=2)
    for engine, (names, dtypes, shapes) in enumerate(per_engine):
        for rank in (4 + 2 * engine, 5 + 2 * engine):
            assert own_transfers(names, dtypes, shapes, rank) == [
                dataclasses.replace(t, held=t.piece) for t in transfers if t.dst == rank]


def sharded_delta_sync(full, transfers, senders, baselines, loaded, plan, version):
    """One delta-mode sync of ``full`` over ``transfers`` in memory (trainer ranks 0-3 -> one engine):
    each sender's :class:`SliceDelta` encodes its slices, each engine rank applies what it receives to its
    :class:`SliceBaseline` and "loads" its part of every tensor it is handed into ``loaded``. Returns (the
    stats, whether the sync sent changed elements, bytes on the wire)."""
    from megarl.engine_process.sharded_load import SliceBaseline, own_transfers
    from megarl.sync.report import SenderStats
    from megarl.sync.transports.sharded import entries_by_engine
    from megarl.wire.weight_shards import assemble, pack_pair, unpack_pair

    stats, wire, deltas = SenderStats(stage=0), {}, set()
    for src, sender in enumerate(senders):
        deltas.add(sender.begin(plan, version))
        mine = {t: t.piece.narrow(t.held.narrow(full[t.piece.name]), t.held) for t in transfers if t.src == src}
        wire.update(sender.encode(mine, lambda dst: True, stats))
    (delta,) = deltas
    values = {entry_name(t): tensor for t, tensor in wire.items()}
    engine_tp = len({t.dst for t in transfers})
    ((names, dtypes, shapes),) = entries_by_engine(list(wire), trainer_ranks=4, engine_tp=engine_tp, num_engines=1)
    for rank in range(4, 4 + engine_tp):
        own, received = own_transfers(names, dtypes, shapes, rank), []
        for src in range(4):  # each pair's pieces packed flat by the sender, unpacked by the receiver
            pair = [t for t in own if t.src == src]
            buffer = pack_pair([values[entry_name(t)] for t in pair], "cpu")
            received += zip([t.piece for t in pair], unpack_pair(buffer, [t.piece for t in pair]))
        baseline = baselines.setdefault(rank, SliceBaseline())
        for name, tensor in assemble(baseline.apply(own, received, not delta, "cpu")):
            loaded[(rank, name)] = tensor
    for sender in senders:
        sender.finish()
    return stats, delta, sum(t.numel() * t.element_size() for t in values.values())


def engine_parts(loaded, wants) -> dict:
    return {(rank, piece.name): piece.narrow(loaded[(rank, piece.name)]) for rank, piece in wants}


@pytest.mark.unit
@pytest.mark.parametrize("engine_tp, engine_ep", [(2, 2), (1, 1)])
def test_delta_over_sharded_slices_loads_what_a_full_sync_loads(engine_tp, engine_ep):
    """Trainer TP2xEP2 -> engine TP2+EP2, or TP1 (each tensor from two senders) in memory: after syncs that
    change 1 in 1000 elements, none, and all of them, each engine rank's part of every tensor equals the
    trainer's, bit for bit; the small changes travel in a small fraction of the bytes, all changed whole."""
    from megarl.sync.delta import DeltaPlan
    from megarl.sync.sharded_rank import SliceDelta

    table = qwen3_moe_table()
    full, wants = full_tensors(table), engine_wants(table, engine_tp, engine_ep, offset=4)
    transfers = plan_transfers(trainer_holdings(table, 2, 2, 4), wants)
    whole = sum(t.piece.nbytes for t in transfers)
    senders, baselines, loaded, gen = [SliceDelta() for _ in range(4)], {}, {}, torch.Generator().manual_seed(1)
    history = []
    for version, fraction in enumerate([1.0, 1e-3, 0.0, 1e-3, 1.0, 1e-3], start=1):
        for tensor in full.values():
            changed = torch.rand(tensor.shape, generator=gen) < fraction
            tensor[changed] += 1.0
        stats, delta, nbytes = sharded_delta_sync(full, transfers, senders, baselines, loaded,
                                                  DeltaPlan(version - 1 if version > 1 else None, 0.5), version)
        expected = {(rank, piece.name): piece.narrow(full[piece.name]) for rank, piece in wants}
        got = engine_parts(loaded, wants)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), f"version {version}: engine parts differ"
        history.append((delta, nbytes, stats.changed_elements / stats.elements))
    assert [delta for delta, _, _ in history] == [False, True, True, True, True, True]
    assert history[0][1] == whole and history[4][1] == whole  # first sync; every element changed: whole
    assert history[2][1] == 0 and history[2][2] == 0  # nothing changed: nothing travels
    for _, nbytes, changed in (history[1], history[3], history[5]):
        assert 0 < nbytes < 0.02 * whole and 0 < changed < 0.01


@pytest.mark.unit
def test_sharded_delta_after_a_failed_sync_goes_whole_and_a_delta_needs_a_baseline():
    from megarl.engine_process.sharded_load import SliceBaseline
    from megarl.sync.delta import DeltaPlan
    from megarl.sync.report import SenderStats
    from megarl.sync.sharded_rank import SliceDelta
    from megarl.wire.weight_shards import Piece, Transfer

    sender, piece = SliceDelta(), Piece("w", "float32", (4, 2), 0, 0, 2)
    transfer = Transfer(0, 1, piece, piece)
    assert sender.begin(DeltaPlan(None, 0.5), 1) is False
    sender.encode({transfer: torch.zeros(2, 2)}, lambda dst: True, SenderStats(stage=0))
    sender.finish()
    assert sender.begin(DeltaPlan(1, 0.5), 2) is True  # the engines hold version 1, which it sent
    sender.encode({transfer: torch.ones(2, 2)}, lambda dst: True, SenderStats(stage=0))  # ... and the sync fails here
    assert sender.begin(DeltaPlan(1, 0.5), 3) is False  # its copy is partly version 2's: whole
    wire = sender.encode({transfer: torch.eye(2)}, lambda dst: True, SenderStats(stage=0))
    assert list(wire) == [transfer]
    with pytest.raises(KeyError, match="holds no baseline"):  # a restarted engine rank handed a delta
        values = Piece.whole(entry_name(transfer) + ":delta.values", "float32", (1,))
        indices = Piece.whole(entry_name(transfer) + ":delta.indices", "int32", (1,))
        SliceBaseline().apply([Transfer(0, 1, values, values), Transfer(0, 1, indices, indices)],
                              [(values, torch.ones(1)), (indices, torch.zeros(1, dtype=torch.int32))], False, "cpu")
