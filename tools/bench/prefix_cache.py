"""Prefix-cache reuse of multi-turn episodes with one engine and with two, side by side in one run.

The calculator recipe (``recipe=tiny_moe_calculator``: two-turn episodes, each turn fed the episode so
far, SGLang's radix cache on) runs ``--steps`` steps with ``rollout.num_engines=1`` and with 2,
alternately, ``--repeats`` times each, from the same warmed-up checkpoint. Per run the figure is the
mean over its steps of ``rollout/cached_token_frac`` (of the prompt tokens the requests sent, the share
the engines served from their prefix cache) and its seconds a step (first to last step); the JSON has
every run's figures, the medians per engine count, and ``two_over_one_cached_token_frac`` = the median
with two engines / with one: 1.0 when placing a prompt group's requests on the engine that served the
group loses nothing to the second engine. The figure also counts prefixes shared across groups (a sum's
first token and first digit: 2 of a 7-token prompt), whose hits depend on how busy each engine is when a
weight update flushes its cache, not on placement alone: an engine still busy at the update re-prefills
its retracted requests first, and the next step's groups, arriving together, then find those prefixes;
an idle engine prefills the whole burst at once on an empty cache, each copy of a group's prompt
computing it, unless the prompts a batch repeats are prefilled once first (``--set
rollout.shared_prefill_min_tokens=1``: the recipe's 7-token prompts are under its default)
(docs/status.md).

Usage: python tools/bench/prefix_cache.py --json FILE [--steps N --repeats R --mode async|sync --work-dir D
       --set KEY=VALUE ...]
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


def run_figures(run_dir: Path) -> tuple[float, float]:
    """(mean of the steps' ``rollout/cached_token_frac``, seconds a step from the first RL row to the last)."""
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "rollout/cached_token_frac" in r]
    if len(rows) < 2:
        raise RuntimeError(f"{run_dir}: fewer than two steps with rollout/cached_token_frac in its metrics")
    seconds = (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"])
    return statistics.fmean(r["rollout/cached_token_frac"] for r in rows), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="async", choices=("async", "sync"), help="the recipe's mode is async")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run (e.g. rollout.shared_prefill_min_tokens=1)")
    args = parser.parse_args()

    from megarl.log import setup_logging
    from megarl.train import main as train

    setup_logging()
    work = work_directory(args.work_dir, "megarl-bench-")
    common = ["recipe=tiny_moe_calculator", f"model.hf_path={work / 'base'}", "model.make_tiny_if_missing=true",
              f"warmup.save_hf_path={work / 'warm'}",
              f"steps={args.steps}", f"mode={args.mode}", "trainer.resume=false", *args.set]
    figures: dict[int, list[float]] = {1: [], 2: []}
    step_s: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.repeats):
        for engines in (1, 2):
            run_dir = work / f"engines{engines}-{r}"
            if train([*common, f"rollout.num_engines={engines}", f"logging.run_dir={run_dir}"]) != 0:
                return 1
            frac, seconds = run_figures(run_dir)
            figures[engines].append(frac)
            step_s[engines].append(seconds)
            print(f"repeat {r}, {engines} engine(s): mean cached_token_frac {frac:.3f}, {seconds:.3f} s a step")
    medians = {n: statistics.median(v) for n, v in figures.items()}
    result = {"two_over_one_cached_token_frac": medians[2] / medians[1], "cached_token_frac_one_engine": medians[1],
              "cached_token_frac_two_engines": medians[2], "runs": {str(n): v for n, v in figures.items()},
              "seconds_per_step": {str(n): v for n, v in step_s.items()},
              "workload": {"recipe": "tiny_moe_calculator", "steps": args.steps, "repeats": args.repeats,
                           "mode": args.mode, "overrides": args.set}}
    print(f"cached_token_frac: one engine {medians[1]:.3f}, two engines {medians[2]:.3f} "
          f"(medians of {args.repeats}): two / one {result['two_over_one_cached_token_frac']:.2f}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
