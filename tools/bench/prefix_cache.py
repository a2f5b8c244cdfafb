"""Prefix-cache reuse of multi-turn episodes with one engine and with two, side by side in one run.

The calculator recipe (``recipe=tiny_moe_calculator``: two-turn episodes, each turn fed the episode
so far, SGLang's radix cache on) runs ``--steps`` steps with ``rollout.num_engines=1`` and with 2,
alternately, ``--repeats`` times each, from the same warmed-up checkpoint. Per run the figure is the
mean over its steps of ``rollout/cached_token_frac`` (of the prompt tokens the requests sent, the
share the engines served from their prefix cache); the JSON has every run's figure, the medians per
engine count, and ``two_over_one_cached_token_frac`` = the median with two engines / with one: 1.0
when placing a prompt group's requests on the engine that served the group loses nothing to the
second engine. The figure also counts prefixes shared across groups (a sum's first token and first
digit: 2 of a 7-token prompt), whose hits depend on how busy each engine is when a weight update
flushes its cache, not on placement alone: an engine still busy at the update re-prefills its
retracted requests first, and the next step's groups, arriving together, then find those prefixes;
an idle engine prefills the whole burst at once on an empty cache (docs/status.md).

Usage: python tools/bench/prefix_cache.py --json FILE [--steps N --repeats R --mode async|sync --work-dir D]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def mean_cached_frac(run_dir: Path) -> float:
    from megarl.metrics.sink import read_metrics

    values = [r["rollout/cached_token_frac"] for r in read_metrics(run_dir) if "rollout/cached_token_frac" in r]
    if not values:
        raise RuntimeError(f"{run_dir}: no rollout/cached_token_frac in its metrics")
    return statistics.fmean(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="async", choices=("async", "sync"), help="the recipe's mode is async")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    from megarl.log import setup_logging
    from megarl.train import main as train

    setup_logging()
    work = work_directory(args.work_dir, "megarl-bench-")
    common = ["recipe=tiny_moe_calculator", f"model.hf_path={work / 'base'}", f"warmup.save_hf_path={work / 'warm'}",
              f"steps={args.steps}", f"mode={args.mode}", "trainer.resume=false"]
    figures: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.repeats):
        for engines in (1, 2):
            run_dir = work / f"engines{engines}-{r}"
            if train([*common, f"rollout.num_engines={engines}", f"logging.run_dir={run_dir}"]) != 0:
                return 1
            figures[engines].append(mean_cached_frac(run_dir))
            print(f"repeat {r}, {engines} engine(s): mean cached_token_frac {figures[engines][-1]:.3f}")
    medians = {n: statistics.median(v) for n, v in figures.items()}
    result = {"two_over_one_cached_token_frac": medians[2] / medians[1], "cached_token_frac_one_engine": medians[1],
              "cached_token_frac_two_engines": medians[2], "runs": {str(n): v for n, v in figures.items()},
              "workload": {"recipe": "tiny_moe_calculator", "steps": args.steps, "repeats": args.repeats,
                           "mode": args.mode}}
    print(f"cached_token_frac: one engine {medians[1]:.3f}, two engines {medians[2]:.3f} "
          f"(medians of {args.repeats}): two / one {result['two_over_one_cached_token_frac']:.2f}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
