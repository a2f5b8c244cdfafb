"""Rollout throughput of one real SGLang engine on the tiny checkpoint, with and without the
Keep Routing / Keep Sampling Mask metadata.

usage: python tools/bench/rollout.py [--json FILE] [--checkpoint DIR] [--new-tokens N] [--repeats R]
                                    [--max-total-tokens N]

For batch sizes 1, 8 and 32 it times ``SGLangClient.generate_batch`` (one request per batch,
``ignore_eos`` so every sample has exactly N new tokens) ``repeats`` times after one warm-up batch
each way, a batch without the metadata then one with it in every repeat (so a drift of the machine
moves both alike), and reports generated tokens per second (the median over repeats). The JSON has
one row per (batch size, metadata on/off) and the top-level ``metadata_overhead_ratio``: the median
over repeats of tokens/s without metadata over tokens/s with it, at batch 32 (> 1 means the
metadata costs throughput).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

BATCH_SIZES = (1, 8, 32)

log = logging.getLogger("bench.rollout")


async def measure(client, prompts, params, batch_size: int, repeats: int) -> list[dict]:
    """Rows without and with the metadata at ``batch_size``, the two timed alternately; each row's
    ``tokens_per_s_by_repeat`` keeps the repeats in order."""
    batch = [prompts[i % len(prompts)] for i in range(batch_size)]
    rows = []
    for metadata in (False, True):
        rows.append({"batch_size": batch_size, "metadata": metadata, "new_tokens": params.max_new_tokens,
                     "repeats": repeats, "tokens_per_s_by_repeat": [], "seconds_by_repeat": [],
                     "kwargs": dict(group_ids=[str(i) for i in range(batch_size)], return_routed_experts=metadata,
                                    return_sampling_mask=metadata)})
        await client.generate_batch(batch, params, **rows[-1]["kwargs"])  # warm-up
    for _ in range(repeats):
        for row in rows:
            t0 = time.perf_counter()
            samples = await client.generate_batch(batch, params, **row["kwargs"])
            dt = time.perf_counter() - t0
            row["tokens_per_s_by_repeat"].append(sum(len(s.response_ids) for s in samples) / dt)
            row["seconds_by_repeat"].append(dt)
    for row in rows:
        del row["kwargs"]
        row["tokens_per_s"] = statistics.median(row["tokens_per_s_by_repeat"])
        row["seconds_per_batch"] = statistics.median(row["seconds_by_repeat"])
    return rows


async def run(checkpoint: str, new_tokens: int, repeats: int, max_total_tokens: int, log_path: str) -> dict:
    from transformers import AutoTokenizer

    from megarl.engines.client import SGLangClient
    from megarl.engines.server import EngineSettings, SGLangEngine
    from megarl.engines.types import SamplingParams
    from megarl.tasks import arithmetic

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer(p.prompt)["input_ids"] for p in arithmetic.all_problems()]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_k=20, ignore_eos=True)
    settings = EngineSettings(model_path=checkpoint, dtype="float32", sampling_mask_max_tokens=20,
                              max_total_tokens=max_total_tokens, log_path=log_path)
    rows = []
    with SGLangEngine(settings) as engine:
        async with SGLangClient(engine.url, engine.model) as client:
            for batch_size in BATCH_SIZES:
                for row in await measure(client, prompts, params, batch_size, repeats):
                    log.info("batch %2d metadata %-5s: %8.1f tokens/s", batch_size, row["metadata"],
                             row["tokens_per_s"])
                    rows.append(row)
        startup_s = engine.startup_s
    bare, kept = (r["tokens_per_s_by_repeat"] for r in rows if r["batch_size"] == 32)
    return {
        "metadata_overhead_ratio": statistics.median(a / b for a, b in zip(bare, kept)),
        "results": rows,
        "engine": {"device": engine.device, "startup_s": startup_s, "checkpoint": checkpoint,
                   "max_total_tokens": max_total_tokens},
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here (they are printed either way)")
    parser.add_argument("--checkpoint", help="HF checkpoint directory (default: a fresh tiny demo checkpoint)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=8192,
                        help="engine KV-cache capacity (SGLang's own sizing takes half the host memory on CPU)")
    args = parser.parse_args(argv)
    from megarl.log import setup_logging

    setup_logging()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from megarl.models.tiny_moe import make_tiny_moe

            checkpoint = str(make_tiny_moe(Path(tmp) / "tiny_moe"))
        # the server log lives and goes with the run's temporary directory (a failed start quotes its tail)
        result = asyncio.run(run(checkpoint, args.new_tokens, args.repeats, args.max_total_tokens,
                                 str(Path(tmp) / "server.log")))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
