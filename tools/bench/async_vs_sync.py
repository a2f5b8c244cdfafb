"""Async vs sync RL on the same workload, side by side in one run.

The workload has long-tailed response lengths: the warmed-up tiny model usually ends its answer
after 2-3 tokens, but sampled at a raised temperature a few responses miss the end-of-sequence
token and run to ``--max-new-tokens``. Both modes train the same number of steps on the same
number of samples from the same starting checkpoint; the figures come from each run's
``metrics.jsonl`` and cover the RL loop only (start-up of Ray, trainer and engine excluded):

  tokens/s            generated response tokens of the trained samples / loop seconds
  trainer idle frac   seconds the trainer waited for data / loop seconds

Usage: python tools/bench/async_vs_sync.py --json FILE [--steps N --prompts P --samples G ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from demo_workload import add_workload_arguments, workload_overrides

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def loop_figures(run_dir: Path, samples_per_step: int) -> dict:
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    seconds = sum(r["time/wait_s"] + r["time/train_s"] + r["sync/seconds"] for r in rows)
    waited = sum(r["time/wait_s"] for r in rows)
    tokens = sum(r["response/len_mean"] * samples_per_step for r in rows)
    return {"steps": len(rows), "loop_s": seconds, "response_tokens": tokens, "tokens_per_s": tokens / seconds,
            "trainer_idle_frac": waited / seconds, "reward_first": rows[0]["reward/mean"],
            "reward_last": rows[-1]["reward/mean"],
            "staleness_mean": sum(r["staleness/mean"] for r in rows) / len(rows),
            "response_len_mean": tokens / (len(rows) * samples_per_step)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, steps=8, prompts=32, max_new_tokens=48)
    parser.add_argument("--temperature", type=float, default=1.3)
    args = parser.parse_args()

    from megarl.log import setup_logging
    from megarl.train import main as train

    setup_logging()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl-bench-"))
    common = [*workload_overrides(work, args), f"rollout.temperature={args.temperature}"]
    if train(["recipe=tiny_moe_cpu", "mode=warmup", f"logging.run_dir={work / 'warmup'}", *common]) != 0:
        return 1
    figures = {}
    for mode in ("sync", "async"):
        run_dir = work / mode
        if train(["recipe=tiny_moe_cpu", f"mode={mode}", f"logging.run_dir={run_dir}", *common]) != 0:
            return 1
        figures[mode] = loop_figures(run_dir, args.prompts * args.samples)
    result = {
        "async_over_sync_throughput": figures["async"]["tokens_per_s"] / figures["sync"]["tokens_per_s"],
        "trainer_idle_frac_async": figures["async"]["trainer_idle_frac"],
        "trainer_idle_frac_sync": figures["sync"]["trainer_idle_frac"],
        "workload": {"steps": args.steps, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                     "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        **figures,
    }
    for mode in ("sync", "async"):
        f = figures[mode]
        print(f"{mode:>5}: {f['tokens_per_s']:8.1f} tokens/s, trainer idle {f['trainer_idle_frac']:.2f}, "
              f"{f['loop_s']:.1f} s for {f['steps']} steps, mean response {f['response_len_mean']:.1f} tokens")
    print(f"async / sync throughput: {result['async_over_sync_throughput']:.2f}x")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
