"""Weight-sync throughput into one real SGLang engine, against the machine's limits, in one run.

A synthetic Qwen3-MoE of at least 1 GB of bf16 parameters (random init, built here) is served by
an SGLang engine; the trainer side is one Megatron rank in this process (the model built through
megatron-bridge, no optimizer) driven by the same :class:`megarl.sync.WeightSync` the RL driver
uses. Measured, each as GB/s of model bytes:

  memcpy               one copy of a model-sized bf16 tensor in this process (best of 3)
  raw_broadcast        model-sized broadcasts over a gloo group formed like the sync's (SGLang's
                       init_custom_process_group, loopback) to a helper process, no engine; the best
                       of 3 into the same buffers (the first also faults their pages in)
  distributed_<N>mb    end-to-end sync (pause -> buckets -> load -> continue) with N MiB buckets
  distributed_per_tensor   the naive way: one engine update call (and broadcast) per tensor
  tensor               the colocated transport (shared memory), 256 MiB buckets
  idle / in_flight     distributed 256 MiB syncs, alternating: on an idle engine, and with a
                       generation load running on it (requests in flight at the pause, resumed
                       after the sync), in ``--pause-mode`` (retract: the async driver's default)
  delta                delta syncs (``sync.delta``, distributed, 256 MiB buckets) after one Adam step
                       of the model (fp32 master weights, bf16 parameters, a random gradient) at lr 1e-6,
                       then after one at the demo's lr 5e-4
  sharded              into an engine of two ranks (TP2, experts EP2): one ``distributed`` sync (every
                       engine rank receives every bucket) and one ``sharded`` sync (each rank receives only
                       the slices it loads), 256 MiB buckets, bytes per engine rank as the transports count
  lora                 adapter-only syncs (megarl.sync.AdapterSync) of a rank ``--lora-rank`` LoRA
                       on the attention projections of the same model, into an engine started with
                       LoRA serving (SGLang's CPU path serves no expert adapters)

The machine may be shared: every sync runs ``--repeats`` times (the best counts) and the two
limits are measured before and after the syncs (the better counts), so a burst of foreign load
does not decide a ratio.

Top level: ``speedup_vs_per_tensor`` (best bucketed distributed / per-tensor),
``fraction_of_transport_limit`` (best bucketed distributed / raw broadcast; also against the
broadcast into fresh buffers, ``fraction_of_fresh_buffer_broadcast``),
``fraction_of_memcpy_colocated`` (tensor / memcpy), and ``sync_seconds_idle``,
``sync_seconds_in_flight`` (best of ``--repeats`` each) and their ratio ``in_flight_over_idle``;
``lora_sync_seconds`` beside ``full_sync_seconds`` (the best bucketed distributed sync), their ratio
``lora_over_full_seconds`` and ``lora_bytes_fraction`` (adapter bytes / model bytes);
``delta_bytes_fraction_lr1e-6`` (a delta sync's bytes on the wire / a whole sync's) and
``delta_changed_fraction_lr1e-6`` (changed elements / elements) after the lr 1e-6 step,
``delta_changed_fraction_demo`` after the lr 5e-4 one; ``sharded_over_broadcast_bytes_per_engine_rank``
(the most bytes an engine rank received through ``sharded`` / through ``distributed``, the two syncs of
``sharded`` in one run). ``--delta-only`` runs the delta syncs alone, ``--sharded-only`` the sharded pair.

Usage: python tools/bench/weight_sync.py --json FILE [--layers 4 --experts 64 --hidden 1024 --moe-ffn 768
       --repeats 2 --pause-mode retract --lora-rank 16 --delta-only --sharded-only]
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megarl.sync.trainer_protocol import WeightSyncTrainer  # noqa: E402  (megarl from this checkout)

log = logging.getLogger("bench.weight_sync")
BUCKETS_MB = (64, 256, 1024)
RAW_BROADCASTS = 3


def build_checkpoint(out: Path, layers: int, experts: int, hidden: int, moe_ffn: int) -> int:
    """A random bf16 Qwen3-MoE with the arithmetic tokenizer at ``out``; returns its parameter bytes."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megarl.models.tiny_moe import train_tokenizer
    from megarl.tasks import arithmetic

    tokenizer = train_tokenizer(arithmetic.corpus(9))
    config = Qwen3MoeConfig(
        vocab_size=384, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=moe_ffn,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="bfloat16",
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return nbytes


class LocalTrainer(WeightSyncTrainer):
    """The trainer interface WeightSync needs (megarl.sync.trainer_protocol.WeightSyncTrainer) over one
    in-process rank: each call runs the RankSync method on one worker thread, like a Ray actor would,
    and returns the one rank's result as a list."""

    def __init__(self, rank_sync):
        self.rank_sync = rank_sync
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    async def on_ranks(self, call: str, *args) -> list:
        return [await asyncio.get_running_loop().run_in_executor(self.pool, getattr(self.rank_sync, call), *args)]


class LocalAdapterTrainer:
    """What megarl.sync.AdapterSync needs from a trainer, over one in-process LoRA model."""

    def __init__(self, model, lora):
        self.model, self.lora = model, lora
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    async def save_hf_adapter(self, out_dir: str) -> str:
        from megarl.models.bridge import save_hf_adapter

        path = await asyncio.get_running_loop().run_in_executor(self.pool, save_hf_adapter, self.model, self.lora,
                                                                 out_dir)
        return str(path)


def memcpy_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _receiver(port: int, nbytes: int) -> None:
    import torch
    from sglang.srt.utils.common import init_custom_process_group

    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                      group_name="bench-raw", timeout=datetime.timedelta(seconds=600))
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for size in (1024,) + (nbytes,) * RAW_BROADCASTS:
        torch.distributed.broadcast(buffer[:size], group=group, group_src=0)


def raw_broadcast_gbps(nbytes: int) -> list[float]:
    """GB/s of RAW_BROADCASTS ``nbytes`` broadcasts over a loopback gloo group to another
    process, into the same buffers (after a tiny warm-up), in order."""
    import torch
    from sglang.srt.utils.common import init_custom_process_group

    from megarl.parallel import free_port

    port = free_port()
    helper = mp.get_context("spawn").Process(target=_receiver, args=(port, nbytes))
    helper.start()
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                      group_name="bench-raw", timeout=datetime.timedelta(seconds=600))
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    torch.distributed.broadcast(buffer[:1024], group=group, group_src=0)
    gbps = []
    for _ in range(RAW_BROADCASTS):
        t0 = time.perf_counter()
        torch.distributed.broadcast(buffer, group=group, group_src=0)
        gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
    helper.join(60)
    torch.distributed.destroy_process_group(group)
    return gbps


def _settings(transport: str, mb: float, work_dir: Path):
    from megarl.config import load_config
    from megarl.sync import SyncSettings

    return dataclasses.replace(SyncSettings.from_config(load_config(["recipe=tiny_moe_cpu"]).sync),
                               transport=transport, bucket_mb=mb, work_dir=str(work_dir), timeout_s=1800)


async def run_syncs(trainer, engine, work_dir: Path, repeats: int) -> dict:
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import PauseMode
    from megarl.sync import WeightSync

    cases = [("distributed", mb) for mb in BUCKETS_MB] + [("distributed", 0), ("tensor", 256)]
    out = {}
    version = 0
    async with SGLangClient(engine.url, engine.model, request_timeout_s=1800) as client:
        for transport, mb in cases:
            name = f"{transport}_per_tensor" if mb == 0 else (f"{transport}_{mb}mb" if transport == "distributed"
                                                              else transport)
            sync = WeightSync(_settings(transport, mb, work_dir), trainer, [client])
            await sync.setup()
            reports = []
            for _ in range(repeats):
                version += 1
                reports.append(await sync.update(version, PauseMode.ABORT))
                assert await client.weight_version() == version
            await sync.close()
            report = max(reports, key=lambda r: r.gbps)
            out[name] = {"gbps": report.gbps, "seconds": report.total_s, "bytes": report.bytes,
                         "buckets": report.buckets, "gather_s": report.gather_s, "convert_s": report.convert_s,
                         "send_s": report.send_s, "load_s": report.load_s,
                         "peak_bucket_bytes": report.peak_bucket_bytes, "all_gbps": [r.gbps for r in reports]}
            log.info("%s: %.3f GB/s (best of %s; %.1f s, %d buckets)", name, report.gbps,
                     [round(r.gbps, 3) for r in reports], report.total_s, report.buckets)
    return out


async def _generation_load(client, stop: asyncio.Event, versions: list) -> None:
    """Batches of long answers, one after another until ``stop``; the versions of their tokens go to ``versions``."""
    from megarl.engines.types import SamplingParams

    params = SamplingParams(max_new_tokens=96, temperature=1.0, ignore_eos=True)
    while not stop.is_set():
        samples = await client.generate_batch([[5, 6, 7, 8]] * 4, params, group_ids=[""] * 4,
                                              return_routed_experts=False, return_sampling_mask=False)
        versions += [sample.model_version.tolist() for sample in samples]


async def run_in_flight(trainer, engine, work_dir: Path, repeats: int, mode: str, version: int) -> dict:
    """Distributed 256 MiB syncs in ``mode``, alternately on the idle engine and with requests in flight."""
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import PauseMode
    from megarl.sync import WeightSync

    seconds = {"idle": [], "in_flight": []}
    across = 0
    async with SGLangClient(engine.url, engine.model, request_timeout_s=1800) as client, \
            SGLangClient(engine.url, engine.model, request_timeout_s=1800) as generator:
        sync = WeightSync(_settings("distributed", 256, work_dir), trainer, [client])
        await sync.setup()
        for _ in range(repeats):
            for case in seconds:
                stop, versions, load = asyncio.Event(), [], None
                if case == "in_flight":
                    load = asyncio.ensure_future(_generation_load(generator, stop, versions))
                    await asyncio.sleep(2.0)  # decoding when the pause comes
                version += 1
                report = await sync.update(version, PauseMode(mode))
                assert await client.weight_version() == version
                if load is not None:
                    stop.set()
                    await load
                    across += sum(v[0] == version - 1 and v[-1] == version for v in versions)
                seconds[case].append(report.total_s)
                log.info("sync %s (%s): %.2f s", case, mode, report.total_s)
        await sync.close()
    return {"pause_mode": mode, "seconds_idle": seconds["idle"], "seconds_in_flight": seconds["in_flight"],
            "requests_across_syncs": across}


def adam_step(model, lr: float, seed: int) -> None:
    """One Adam step of every parameter the way a bf16 Megatron run takes it: fp32 master copies of the
    bf16 parameters, a random gradient, the update rounded back into the parameters."""
    import torch

    params = [p for chunk in model.chunks for p in chunk.parameters()]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    g = torch.Generator().manual_seed(seed)
    for master in masters:
        master.grad = torch.randn(master.shape, generator=g) * 1e-3
    torch.optim.Adam(masters, lr=lr).step()
    with torch.no_grad():
        for param, master in zip(params, masters):
            param.copy_(master)


async def run_delta_syncs(trainer, model, engine, work_dir: Path) -> dict:
    """A whole delta-mode sync, then a delta sync after an Adam step at lr 1e-6 and one after lr 5e-4."""
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import PauseMode
    from megarl.sync import WeightSync

    out = {}
    async with SGLangClient(engine.url, engine.model, request_timeout_s=1800) as client:
        settings = dataclasses.replace(_settings("distributed", 256, work_dir), delta=True)
        sync = WeightSync(settings, trainer, [client], initial_version=200)
        await sync.setup()
        whole = await sync.update(201, PauseMode.ABORT)
        for version, (name, lr) in enumerate((("lr1e-6", 1e-6), ("demo", 5e-4)), start=202):
            await asyncio.to_thread(adam_step, model, lr, version)
            report = await sync.update(version, PauseMode.ABORT)
            assert report.delta and await client.weight_version() == version
            out[name] = {"lr": lr, "bytes": report.bytes, "whole_bytes": whole.bytes, "seconds": report.total_s,
                         "whole_seconds": whole.total_s, "changed_elements": report.changed_elements,
                         "elements": report.elements}
            log.info("delta after an Adam step at lr %g: %.2f MB of %.2f MB, %.5f of the elements changed, %.2f s",
                     lr, report.bytes / 1e6, whole.bytes / 1e6, report.changed_elements / report.elements,
                     report.total_s)
        await sync.close()
    return out


async def run_lora_syncs(trainer, engine, work_dir: Path, repeats: int) -> dict:
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import PauseMode
    from megarl.sync import AdapterSync

    async with SGLangClient(engine.url, engine.model, request_timeout_s=1800) as client:
        sync = AdapterSync(_settings("disk", 0, work_dir), trainer, [client])
        reports = []
        for version in range(1, repeats + 1):
            reports.append(await sync.update(version, PauseMode.ABORT))
            assert await client.weight_version() == version
        await sync.close()
    best = min(reports, key=lambda r: r.total_s)
    log.info("lora: %.3f s for %.2f MB (best of %s)", best.total_s, best.bytes / 1e6,
             [round(r.total_s, 3) for r in reports])
    return {"seconds": best.total_s, "bytes": best.bytes, "export_s": best.gather_s, "load_s": best.load_s,
            "all_seconds": [r.total_s for r in reports]}


def _engine(model_dir: Path, log_path: Path, **kwargs):
    from megarl.engines.server import EngineSettings, SGLangEngine

    engine = SGLangEngine(EngineSettings(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=512,
                                         startup_timeout_s=900, log_path=str(log_path), **kwargs))
    engine.start()
    return engine


def run_full_model(tmp: Path, args, delta_only: bool) -> dict:
    """The syncs of the whole model (bucketed, per tensor, colocated, in flight; the delta syncs; the sharded
    pair into an engine of two ranks)."""
    from megarl.models.bridge import ModelSettings, build_megatron_model
    from megarl.parallel import Layout, free_port
    from megarl.sync.rank import RankSync
    from megarl.trainer.distributed import init_rank

    init_rank(0, Layout(), "127.0.0.1", free_port(), backend="gloo")
    model = build_megatron_model(tmp / "model", Layout(), ModelSettings(transformer_impl="local"), dtype="bfloat16")
    trainer = LocalTrainer(RankSync(model))
    if args.sharded_only:
        return {"sharded": run_sharded(tmp, trainer)}
    engine = _engine(tmp / "model", tmp / "server.log")
    results = {}
    try:
        if not delta_only:
            results["syncs"] = asyncio.run(run_syncs(trainer, engine, tmp / "sync", args.repeats))
            results["in_flight"] = asyncio.run(run_in_flight(trainer, engine, tmp / "sync", args.repeats,
                                                             args.pause_mode, version=100))
        results["delta"] = asyncio.run(run_delta_syncs(trainer, model, engine, tmp / "sync"))
    finally:
        engine.stop()
    if not delta_only:
        results["sharded"] = run_sharded(tmp, trainer)
    return results


async def run_sharded_pair(trainer, engine, work_dir: Path) -> dict:
    """One ``distributed`` and one ``sharded`` sync into ``engine`` (two ranks): their numbers."""
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import PauseMode
    from megarl.sync import WeightSync

    out = {}
    async with SGLangClient(engine.url, engine.model, request_timeout_s=1800) as client:
        for version, transport in enumerate(("distributed", "sharded"), start=200):
            sync = WeightSync(dataclasses.replace(_settings(transport, 256, work_dir), engine_tp=2), trainer, [client])
            await sync.setup()
            try:
                report = await sync.update(version, PauseMode.ABORT)
            finally:
                await sync.close()
            out[transport] = {"bytes_per_engine_rank": report.bytes_per_engine_rank, "seconds": report.total_s,
                              "bytes": report.bytes, "buckets": report.buckets}
            log.info("%s into TP2+EP2: %.1f MB per engine rank, %.1f s", transport,
                     report.bytes_per_engine_rank / 1e6, report.total_s)
    return out


def run_sharded(tmp: Path, trainer) -> dict:
    engine = _engine(tmp / "model", tmp / "server_tp2.log", tp=2, ep=2)
    try:
        return asyncio.run(run_sharded_pair(trainer, engine, tmp / "sharded"))
    finally:
        engine.stop()


def run_lora(tmp: Path, args) -> dict:
    from megarl.engines.server import lora_serving
    from megarl.models.bridge import ModelSettings, build_megatron_model
    from megarl.models.lora import LoraConfig
    from megarl.parallel import Layout

    lora = LoraConfig(enabled=True, rank=args.lora_rank, alpha=2 * args.lora_rank, dropout=0.0,
                      target_modules=("linear_qkv", "linear_proj"), sync="adapter")
    lora_model = build_megatron_model(tmp / "model", Layout(), ModelSettings(transformer_impl="local", lora=lora),
                                      dtype="bfloat16")
    engine = _engine(tmp / "model", tmp / "server_lora.log", **lora_serving(lora))
    try:
        return asyncio.run(run_lora_syncs(LocalAdapterTrainer(lora_model, lora), engine, tmp / "lora", args.repeats))
    finally:
        engine.stop()


def summarize(results: dict, nbytes: int) -> None:
    """The top-level figures (see the module docstring), into ``results``."""
    if "sharded" in results:
        pair = results["sharded"]
        results["sharded_over_broadcast_bytes_per_engine_rank"] = (pair["sharded"]["bytes_per_engine_rank"]
                                                                   / pair["distributed"]["bytes_per_engine_rank"])
    if "delta" not in results:
        return
    delta = results["delta"]
    results["delta_bytes_fraction_lr1e-6"] = delta["lr1e-6"]["bytes"] / delta["lr1e-6"]["whole_bytes"]
    results["delta_changed_fraction_lr1e-6"] = delta["lr1e-6"]["changed_elements"] / delta["lr1e-6"]["elements"]
    results["delta_changed_fraction_demo"] = delta["demo"]["changed_elements"] / delta["demo"]["elements"]
    if "syncs" not in results:
        return
    results["memcpy_gbps"] = max(results["memcpy_gbps_runs"])
    results["raw_broadcast_gbps"] = max(max(run) for run in results["raw_broadcast_gbps_runs"])
    # the first broadcast of a run also faults the receiver's buffer in: what a sync into fresh buffers gets
    results["raw_broadcast_fresh_buffer_gbps"] = max(run[0] for run in results["raw_broadcast_gbps_runs"])
    log.info("memcpy %.2f GB/s, raw gloo broadcast %.3f GB/s", results["memcpy_gbps"], results["raw_broadcast_gbps"])
    syncs = results["syncs"]
    best = max(v["gbps"] for k, v in syncs.items() if k.endswith("mb"))
    results["speedup_vs_per_tensor"] = best / syncs["distributed_per_tensor"]["gbps"]
    results["fraction_of_transport_limit"] = best / results["raw_broadcast_gbps"]
    results["fraction_of_fresh_buffer_broadcast"] = best / results["raw_broadcast_fresh_buffer_gbps"]
    results["fraction_of_memcpy_colocated"] = syncs["tensor"]["gbps"] / results["memcpy_gbps"]
    results["sync_seconds_idle"] = min(results["in_flight"]["seconds_idle"])
    results["sync_seconds_in_flight"] = min(results["in_flight"]["seconds_in_flight"])
    results["in_flight_over_idle"] = results["sync_seconds_in_flight"] / results["sync_seconds_idle"]
    results["full_sync_seconds"] = min(v["seconds"] for k, v in syncs.items() if k.endswith("mb"))
    results["lora_sync_seconds"] = results["lora"]["seconds"]
    results["lora_over_full_seconds"] = results["lora_sync_seconds"] / results["full_sync_seconds"]
    results["lora_bytes_fraction"] = results["lora"]["bytes"] / nbytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-ffn", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pause-mode", default="retract", choices=("abort", "retract", "in_place"),
                        help="pause of the idle / in-flight syncs")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the adapter-only syncs' LoRA")
    parser.add_argument("--delta-only", action="store_true", help="only the delta syncs (and their whole one)")
    parser.add_argument("--sharded-only", action="store_true", help="only the sharded pair (distributed, sharded)")
    args = parser.parse_args(argv)

    from megarl.log import setup_logging

    setup_logging()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        nbytes = build_checkpoint(tmp / "model", args.layers, args.experts, args.hidden, args.moe_ffn)
        log.info("synthetic Qwen3-MoE: %.2f GB of bf16 parameters (%.0f s)", nbytes / 1e9, time.perf_counter() - t0)
        results = {"model_bytes": nbytes}
        if not (args.delta_only or args.sharded_only):
            results.update(memcpy_gbps_runs=[memcpy_gbps(nbytes)], raw_broadcast_gbps_runs=[raw_broadcast_gbps(nbytes)])
        results.update(run_full_model(tmp, args, args.delta_only))
        if not (args.delta_only or args.sharded_only):
            results["lora"] = run_lora(tmp, args)
            results["memcpy_gbps_runs"].append(memcpy_gbps(nbytes))
            results["raw_broadcast_gbps_runs"].append(raw_broadcast_gbps(nbytes))
    summarize(results, nbytes)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k not in ("syncs", "in_flight", "lora", "delta", "sharded")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
