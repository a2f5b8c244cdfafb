"""Parallelism and memory planner: ``python -m megarl.plan recipe=NAME [overrides] [--json FILE] [--rehearse]``.

Prints the parameter counts, the LoRA adapters' sizes (with ``lora.enabled``), each trainer pipeline
stage's per-GPU memory, one engine GPU's weights and KV cache (a policy engine's, and each auxiliary
engine's whose checkpoint is here to read), the weight sync's bytes and time, the per-token metadata's
bytes and CPU seconds a step at each stage (:mod:`megarl.planner.metadata`), and
the placement (the node and device of every trainer and engine rank, the teacher's, judge's and
frozen roles' engines included, the weight-sync groups) as rich tables, and writes the same as JSON.
Exit status: 0 when the layout fits, 2 with one line per broken limit on stderr when it does not or
cannot be placed (one line naming the key), 1 for a recipe that does not load.

``--rehearse`` then rehearses the recipe's placement (:mod:`megarl.rehearsal`): its real start-up on fake
GPU nodes, scaled down, with stand-ins where the GPU work would run (needs root for the nodes' network
namespaces); it prints what the checks found, and the exit status is 2 when they found a problem.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megarl.config import ConfigError, load_config
from megarl.config.errors import PlacementError
from megarl.planner.layout import AuxiliaryPlan, LayoutPlan, broken_limits, gib_dict, plan_layout
from megarl.planner.lora import LoraPlan
from megarl.planner.metadata import STAGES, MetadataPlan
from megarl.planner.placement import PlacementPlan, ranges, span
from megarl.planner.weight_sync import WeightSyncPlan

log = logging.getLogger(__name__)

EXIT_DOES_NOT_FIT = 2


def _billions(n: int) -> str:
    return f"{n / 1e9:,.3f} B" if n >= 1e8 else f"{n:,}"


def render(plan: LayoutPlan, console: Console) -> None:
    """The plan as rich tables."""
    p = plan.params
    counts = Table(title="parameters (MTP modules counted apart)")
    for col in ("total", "active / token", "embedding", "head", "routed experts", "MTP"):
        counts.add_column(col, justify="right")
    counts.add_row(*(_billions(v) for v in (p.total, p.active, p.embedding, p.head, p.routed_experts, p.mtp)))
    console.print(counts)
    if plan.lora is not None:
        render_lora(plan.lora, console)

    trainer = Table(title=f"trainer: per-GPU memory (GB), {plan.trainer_gpus} GPUs")
    parts = ["weights", "grads", "optimizer", "activations", "reserved", "total", "host_optimizer"]
    if any(s.critic for s in plan.trainer):  # PPO's value model beside the policy (critic.enabled)
        parts.insert(5, "critic")
    for col in ("stage", "layers", *parts[:-1], "host optim."):
        trainer.add_column(col, justify="right")
    for s in plan.trainer:
        g = gib_dict(s)
        trainer.add_row(str(s.stage), str(s.layers), *(f"{g[k]:.1f}" for k in parts))
    console.print(trainer)

    e = plan.engine
    engine = Table(title=f"engine: per-GPU memory, {plan.engine_gpus // e.gpus_per_engine} engines "
                         f"x {e.gpus_per_engine} GPUs")
    columns = ["attention TP", "weights GB", "KV cache GB", "KV bytes/token", "KV tokens/engine", "pool GB"]
    values = [str(e.attention_tp), f"{e.weights / 2**30:.1f}", f"{e.kv_cache / 2**30:.1f}",
              f"{e.kv_bytes_per_token:,}", f"{e.kv_tokens_per_engine:,}", f"{e.pool / 2**30:.1f}"]
    if e.lora_slots:
        columns.insert(2, f"LoRA buffers GB ({e.lora_slots} slots)")
        values.insert(2, f"{e.lora_buffers / 2**30:.1f}")
    for col in columns:
        engine.add_column(col, justify="right")
    engine.add_row(*values)
    console.print(engine)
    if plan.auxiliary:
        render_auxiliary(plan.auxiliary, console)

    w = plan.sync
    payload = {"model": "", "adapter": " (LoRA adapters alone)", "merged": " (the model, LoRA merged)"}[w.payload]
    sync = Table(title=f"weight sync per engine{payload}; devices in all: {plan.total_gpus} (GPUs; on a machine "
                       "without one, CPU processes)")
    for col in ("bytes", "buckets", "largest tensor", "seconds"):
        sync.add_column(col, justify="right")
    sync.add_row(_bytes(w.bytes_per_sync), str(w.buckets), _bytes(w.largest_tensor_bytes), f"{w.seconds:.3g}")
    console.print(sync)
    render_sync_paths(w, console)
    render_metadata(plan.metadata, console)
    render_placement(plan.placement, console)


def render_sync_paths(w: WeightSyncPlan, console: Console) -> None:
    """Each sync path's projected seconds and the inputs of its formula; the recipe's path marked."""
    table = Table(title=f"weight sync paths (transfer only; this recipe: {w.path})")
    for col in ("path", "bytes on the links", "seconds", "formula", "inputs"):
        table.add_column(col, justify="right" if col in ("bytes on the links", "seconds") else "left")
    for name, p in w.paths.items():
        label = name + (" *" if name == w.path else "") + ("" if p.built else " (not built)")
        inputs = ", ".join(f"{k}={_bytes(v) if 'bytes' in k else f'{v:g}'}" for k, v in p.inputs.items())
        table.add_row(label, _bytes(p.bytes), f"{p.seconds:.3g}", p.formula, inputs)
    console.print(table)
    if w.delta_host_bytes:
        senders = ("each trainer rank keeps the slices it sends (its share of the model)" if w.path == "delta_sharded"
                   else "the same over the trainer's stage senders (what they last sent)")
        console.print(f"sync.delta keeps {_bytes(w.delta_host_bytes)} in host memory on each engine rank (its "
                      f"baseline); {senders}")


def render_metadata(m: MetadataPlan, console: Console) -> None:
    """The step's per-token metadata: bytes and CPU seconds at each stage, megarl's path beside SGLang's JSON."""
    table = Table(title=f"per-token metadata a step ({m.samples:,} samples, up to {m.tokens:,} tokens; rates of "
                        f"{m.rates_command}): bytes / CPU seconds")
    for col in ("path", *STAGES, "driver seconds"):
        table.add_column(col, justify="right")
    for name, p in (("new", m.new), ("old (JSON)", m.old)):
        cells = [_bytes(p.bytes[s]) + ("" if s == "response" else f" / {p.seconds[s]:.3g}") for s in STAGES]
        table.add_row(name, *cells, f"{p.driver_seconds:.3g}")
    console.print(table)
    console.print(f"driver seconds a step, new / old: {m.driver_ratio:.3f} (rank_input: each trainer DP rank's share)")


def render_auxiliary(auxiliary: list[AuxiliaryPlan], console: Console) -> None:
    """The teacher's, judge's and frozen roles' engines: one GPU each's memory, from its checkpoint's config.json."""
    table = Table(title="auxiliary engines: per-GPU memory (devices of their own)")
    for col in ("engine", "checkpoint", "GPUs", "attention TP", "weights GB", "KV cache GB", "KV tokens/engine",
                "pool GB"):
        table.add_column(col, justify="right")
    for a in auxiliary:
        e = a.memory
        if e is None:
            table.add_row(a.name, a.hf_path, str(a.devices), a.why, *("-" * 4))
            continue
        table.add_row(a.name, a.hf_path, str(a.devices), str(e.attention_tp), f"{e.weights / 2**30:.1f}",
                      f"{e.kv_cache / 2**30:.1f}", f"{e.kv_tokens_per_engine:,}", f"{e.pool / 2**30:.1f}")
    console.print(table)


def render_lora(lora: LoraPlan, console: Console) -> None:
    """The adapters: what the trainer trains and what an adapter sync moves, against the full model."""
    table = Table(title=f"LoRA adapters: rank {lora.rank}, alpha {lora.alpha}, on {', '.join(lora.target_modules)}; "
                        f"sync: {lora.sync}")
    for col in ("adapted linears", "trained params", "of the model", "synced params (PEFT)", "bytes per sync",
                "model bytes", "ratio"):
        table.add_column(col, justify="right")
    table.add_row(f"{lora.adapted_linears:,}", _billions(lora.trainer_params), f"{lora.trainable_fraction:.2%}",
                  _billions(lora.synced_params), _bytes(lora.synced_bytes), _bytes(lora.model_bytes),
                  f"{lora.ratio:.4f} (1/{1 / lora.ratio:.0f})")
    console.print(table)


def _bytes(n: int) -> str:
    """GiB above 1 GiB, else MiB or kiB (the tiny model's adapters are kilobytes)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def render_placement(placement: PlacementPlan, console: Console) -> None:
    """Which node and device holds each rank, and the weight-sync groups."""
    nodes = Table(title=f"placement ({placement.placement}): {placement.nodes} node{'s' * (placement.nodes != 1)} x "
                        f"{placement.gpus_per_node} GPUs")
    for col in ("node", "devices", "trainer ranks", "stage", "engine", "engine ranks"):
        nodes.add_column(col, justify="right")
    for seg in placement.segments():
        nodes.add_row(str(seg.node), span(seg.devices), span(seg.trainer_ranks),
                      "-" if seg.stage is None else str(seg.stage), "-" if seg.engine is None else str(seg.engine),
                      span(seg.engine_ranks))
    console.print(nodes)

    groups = Table(title="weight-sync groups (one per pipeline stage)" if placement.placement != "colocated" else
                   "weight-sync routes (one per pipeline stage): the sender broadcasts each bucket to the trainer "
                   "rank on every engine GPU, which serves it to the engine rank there (CUDA IPC)")
    for col in ("stage", "sender (node:device)", "engine ranks", "group size", "nodes"):
        groups.add_column(col, justify="right")
    engine_nodes = sorted({d.node for ranks in placement.engines for d in ranks})
    for g in placement.sync_groups:
        sender = placement.trainer[g.sender]
        groups.add_row(str(g.stage), f"rank {g.sender} ({sender.node}:{sender.device})",
                       f"{len(placement.engines)} engines x {len(placement.engines[0])}", str(g.size),
                       ranges(sorted(set(engine_nodes) | {sender.node})))
    console.print(groups)


def rehearse_and_report(args: list[str], console: Console) -> int:
    """Rehearse the recipe of ``args`` (with the other overrides) and print its report; its exit status."""
    from megarl.rehearsal.cluster import RehearsalUnavailable, rehearse

    recipe = next(a for a in args if a.startswith("recipe=")).split("=", 1)[1]
    try:
        [report] = rehearse([recipe], [a for a in args if not a.startswith("recipe=")])
    except RehearsalUnavailable as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 1
    if "skipped" in report:
        console.print(f"placement rehearsal: not rehearsed: {report['skipped']}")
        return 0
    console.print(f"placement rehearsal on {report.get('nodes', '?')} fake nodes, scaled by "
                  f"{' '.join(report.get('overrides', []))}: " + ("every check passed" if not report["problems"] else
                                                                  f"{len(report['problems'])} problems"))
    for problem in report["problems"]:
        print(f"plan: rehearsal: {problem}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT if report["problems"] else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    rehearsal = "--rehearse" in args
    args = [a for a in args if a != "--rehearse"]
    json_path = None
    if "--json" in args:
        i = args.index("--json")
        if i + 1 >= len(args):
            print("plan: --json needs a file name", file=sys.stderr)
            return 1
        json_path = Path(args[i + 1])
        del args[i:i + 2]
    try:
        cfg = load_config(args)
        plan = plan_layout(cfg)
    except PlacementError as exc:
        print(f"plan: cannot be placed: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except ConfigError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 1
    console = Console(width=None if sys.stdout.isatty() else 130)
    render(plan, console)
    if plan.sync.payload != "adapter" and plan.sync.largest_tensor_bytes > cfg.sync.bucket_mb * 2**20:
        log.warning("the largest tensor (%.0f MB) exceeds sync.bucket_mb=%d and travels in a bucket of its own",
                    plan.sync.largest_tensor_bytes / 2**20, cfg.sync.bucket_mb)
    for a in plan.auxiliary:
        if a.memory is None:
            log.warning("the %s engine's memory is %s (%s)", a.name, a.why, a.key)
    broken = broken_limits(plan, cfg)
    if json_path is not None:
        json_path.write_text(json.dumps(dict(plan.to_dict(), fits=not broken, broken_limits=broken), indent=2))
    for line in broken:
        print(f"plan: does not fit: {line}", file=sys.stderr)
    if broken:
        return EXIT_DOES_NOT_FIT
    return rehearse_and_report(args, console) if rehearsal else 0


if __name__ == "__main__":
    sys.exit(main())
