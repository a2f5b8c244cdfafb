"""What the engine's route replay costs the demo's step, side by side in one run.

The demo's async recipe (``recipe=tiny_moe_cpu``: partial rollouts ``continue``, a retract pause at
every weight sync) runs with the replay (megarl's engines as they are) and without it
(``MEGARL_ROUTE_REPLAY=off``: a retracted request's prefix is routed afresh under the new weights, as
SGLang does on its own, and its tokens come back with those routes, not the ones they were sampled
with), in turn, ``--repeats`` times, on the same warmed-up checkpoint, so that a drift of the machine's
speed moves both alike. The figure is the cost alone: without the replay the stale tokens' routes
are not theirs, which no step time shows.

  step_s_replay / step_s_fresh   median seconds between consecutive steps' metrics rows (start-up and the
                                 first ``--skip`` steps excluded), per repeat and their median
  replay_over_fresh              step_s_replay / step_s_fresh of each repeat, and their median (the figure)

Usage: python tools/bench/route_replay.py --json FILE [--repeats R --steps N --skip K ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from demo_workload import add_workload_arguments, workload_overrides
from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VARIANTS = {"replay": {}, "fresh": {"MEGARL_ROUTE_REPLAY": "off"}}  # variant -> the engine's environment


def run_demo(work: Path, args: argparse.Namespace, variant: str, repeat: int) -> Path:
    """One run of the demo's recipe as ``variant``; returns its run directory."""
    run_dir = work / f"run_{variant}_{repeat}"
    command = [sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", *workload_overrides(work, args),
               f"logging.run_dir={run_dir}"]
    with open(work / f"{variant}_{repeat}.log", "wb") as out:
        subprocess.run(command, check=True, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                       env=dict(os.environ, **VARIANTS[variant]))
    return run_dir


def run_figures(run_dir: Path, skip: int) -> dict[str, float]:
    """A run's median step seconds and how many of its counted steps had boundary tokens."""
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r][skip:]
    times = [r["time"] for r in rows]
    return {"step_s": statistics.median(b - a for a, b in zip(times, times[1:])),
            "steps_with_boundary_tokens": sum(1 for r in rows if r.get("staleness/boundary_tokens"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, steps=60, prompts=64, max_new_tokens=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip", type=int, default=5, help="first RL steps left out of each run's figures")
    args = parser.parse_args()
    work = work_directory(args.work_dir, "megarl_route_replay_")
    work.mkdir(parents=True, exist_ok=True)
    figures: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            figures[variant].append(run_figures(run_demo(work, args, variant, repeat), args.skip))
            print(f"repeat {repeat} {variant}: {figures[variant][-1]}", flush=True)
    ratios = [r["step_s"] / f["step_s"] for r, f in zip(figures["replay"], figures["fresh"])]
    out = {"replay_over_fresh": statistics.median(ratios), "replay_over_fresh_per_repeat": ratios,
           **{f"step_s_{v}": statistics.median(f["step_s"] for f in figures[v]) for v in VARIANTS},
           "runs": figures, "workload": vars(args)}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "workload")}, indent=1))


if __name__ == "__main__":
    main()
