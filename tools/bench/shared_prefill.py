"""A GRPO batch's shared prompts prefilled once (``rollout.shared_prefill_min_tokens``) against each copy
prefilling its own, on one SGLang engine, side by side.

Usage: python tools/bench/shared_prefill.py --json FILE [--lengths 32 128 512] [--groups 8 --samples 8]
       [--new-tokens 4] [--repeats R] [--work-dir D]

A tiny MoE like the demo's but with a 2048-token context and a wider model (hidden 256) serves the
batches. For each prompt length, ``repeats`` pairs of batches go out alternately without and with the
shared prefill (a drift of the machine moves both alike): ``groups`` random prompts of that length, each
``samples`` times in one batch, ``new-tokens`` tokens each (end of sequence ignored), through
``SGLangClient.generate_batch``, the engine's prefix cache flushed before each batch. Per batch: its
seconds (the prefill request included), the CPU seconds of the engine's processes, and the share of the
prompt tokens sent that the engine served from its cache. The JSON has every batch and, per length, the
medians and ``seconds_off_over_on`` / ``cpu_off_over_on`` (> 1: the shared prefill is faster).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def engine_cpu(pid: int) -> float:
    """CPU seconds of the engine's process tree so far."""
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in processes)


async def one_batch(engine, prompts: list[list[int]], new_tokens: int, min_tokens: int) -> dict[str, float]:
    """Seconds, engine CPU seconds and cached share of ``prompts`` sent as one batch."""
    from megarl.engines.client import SGLangClient
    from megarl.engines.types import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, top_k=20, ignore_eos=True)
    async with SGLangClient(engine.url, engine.model, shared_prefill_min_tokens=min_tokens) as client:
        await client.flush_cache()
        cpu, t0 = engine_cpu(engine.pid), time.perf_counter()
        samples = await client.generate_batch(prompts, params, group_ids=[""] * len(prompts))
        seconds, cpu = time.perf_counter() - t0, engine_cpu(engine.pid) - cpu
    return {"seconds": seconds, "engine_cpu_s": cpu,
            "cached_frac": sum(s.cached_tokens for s in samples) / sum(s.prefill_tokens for s in samples)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    from megarl.engines.server import EngineSettings, SGLangEngine
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

    work = work_directory(args.work_dir, "megarl-bench-")
    checkpoint = make_tiny_moe(work / "wide", TinyMoeSpec(max_position_embeddings=2048, hidden_size=256,
                                                          moe_ffn_hidden_size=512))
    tokens = args.groups * args.samples * (max(args.lengths) + args.new_tokens)
    settings = EngineSettings(model_path=str(checkpoint), dtype="float32", max_total_tokens=2 * tokens,
                              log_path=str(work / "server.log"))
    rng = random.Random(0)
    result: dict = {"workload": vars(args) | {"json": None}, "lengths": {}}
    with SGLangEngine(settings) as engine:
        asyncio.run(one_batch(engine, [[5, 6, 7]] * 2, 1, 0))  # the engine's first request pays its warm-up
        for length in args.lengths:
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for _ in range(args.repeats):
                prompts = [[rng.randrange(3, 300) for _ in range(length)] for _ in range(args.groups)]
                batch = [p for p in prompts for _ in range(args.samples)]
                for name, min_tokens in (("off", 0), ("on", 1)):
                    runs[name].append(asyncio.run(one_batch(engine, batch, args.new_tokens, min_tokens)))
            medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
            figures = {"seconds_off_over_on": medians["off"]["seconds"] / medians["on"]["seconds"],
                       "cpu_off_over_on": medians["off"]["engine_cpu_s"] / medians["on"]["engine_cpu_s"],
                       "medians": medians, "runs": runs}
            result["lengths"][str(length)] = figures
            print(f"{length}-token prompts, {args.groups} x {args.samples}: off {medians['off']['seconds']:.3f} s "
                  f"(cached {medians['off']['cached_frac']:.3f}), on {medians['on']['seconds']:.3f} s "
                  f"(cached {medians['on']['cached_frac']:.3f}): seconds off/on {figures['seconds_off_over_on']:.2f}, "
                  f"engine CPU off/on {figures['cpu_off_over_on']:.2f}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
