"""Sync vs async learning on the same recipe and the same number of trained samples, in one run.

Both modes start from the same warmed-up checkpoint (made once, first) and train ``steps`` steps of
``prompts_per_step x samples_per_prompt`` samples; each runs as its own ``python -m megarl.train``
process, one after the other, so neither shares the cores with the other. From each run's
``metrics.jsonl``:

  final_reward         mean reward of the last ``--last`` steps
  seconds_to_reward    RL-loop seconds (wait + train + sync, start-up excluded) until the mean reward of
                       the trailing ``--window`` steps first reaches ``--target`` (null: never)
  curve                mean reward per ``--window`` steps
  mismatch_max         largest per-step train-inference mismatch on fresh tokens (null: none fresh)

and, from the two runs side by side, ``async_minus_sync_final_reward`` and
``async_over_sync_seconds_to_reward``.

Usage: python tools/bench/learning.py --json FILE [--recipe tiny_moe_cpu --steps 300 --target 0.6
       --set key=value ...]   (``--set`` overrides apply to both modes)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def learning_figures(run_dir: Path, last: int, window: int, target: float) -> dict:
    """The figures above from ``run_dir/metrics.jsonl``."""
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no RL rows")
    rewards = [r["reward/mean"] for r in rows]
    elapsed, seconds_to_reward = 0.0, None
    for i, row in enumerate(rows):
        elapsed += row["time/wait_s"] + row["time/train_s"] + row["sync/seconds"]
        trailing = rewards[max(0, i + 1 - window): i + 1]
        if seconds_to_reward is None and i + 1 >= window and sum(trailing) / len(trailing) >= target:
            seconds_to_reward = elapsed
    tail = rewards[-last:]
    return {"steps": len(rows), "final_reward": sum(tail) / len(tail), "seconds_to_reward": seconds_to_reward,
            "loop_s": elapsed, "seconds_per_step": elapsed / len(rows),
            "curve": [round(sum(rewards[i:i + window]) / len(rewards[i:i + window]), 3)
                      for i in range(0, len(rewards), window)],
            "mixed_group_frac_curve": [round(sum(r["groups/mixed_frac"] for r in rows[i:i + window])
                                             / len(rows[i:i + window]), 3) for i in range(0, len(rows), window)],
            "mismatch_max": max((r["mismatch/logprob_abs_diff"] for r in rows if "mismatch/logprob_abs_diff" in r),
                                default=None)}


def train(overrides: list[str]) -> None:
    """``python -m megarl.train`` with ``overrides``; raises on a failed run."""
    command = [sys.executable, "-m", "megarl.train", *overrides]
    if subprocess.run(command, cwd=REPO).returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--recipe", default="tiny_moe_cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.6, help="the stated reward for seconds_to_reward")
    parser.add_argument("--window", type=int, default=25, help="steps per point of the curve")
    parser.add_argument("--last", type=int, default=50, help="steps averaged into final_reward")
    parser.add_argument("--modes", default="sync,async", help="comma-separated modes, in run order")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both modes")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    work = work_directory(args.work_dir, "megarl-learning-")
    common = [f"recipe={args.recipe}", f"model.hf_path={work / 'base'}", "model.make_tiny_if_missing=true",
              f"warmup.save_hf_path={work / 'warm'}",
              f"steps={args.steps}", "trainer.resume=false", *args.set]
    train([*common, "mode=warmup", f"logging.run_dir={work / 'warmup'}"])
    figures = {}
    for mode in args.modes.split(","):
        run_dir = work / mode
        train([*common, f"mode={mode}", f"logging.run_dir={run_dir}"])
        figures[mode] = learning_figures(run_dir, args.last, args.window, args.target)
        f = figures[mode]
        print(f"{mode:>12}: last-{args.last} reward {f['final_reward']:.3f}, {f['seconds_per_step']:.2f} s/step, "
              f"reward {args.target} after {f['seconds_to_reward']} s; curve {f['curve']}", flush=True)
    result = {"recipe": args.recipe, "steps": args.steps, "target_reward": args.target, "overrides": args.set,
              **{f"{mode}_final_reward": f["final_reward"] for mode, f in figures.items()},
              **{f"{mode}_seconds_to_reward": f["seconds_to_reward"] for mode, f in figures.items()},
              "runs": figures}
    if {"sync", "async"} <= figures.keys():
        sync, lag = figures["sync"], figures["async"]
        result["async_minus_sync_final_reward"] = lag["final_reward"] - sync["final_reward"]
        if sync["seconds_to_reward"] and lag["seconds_to_reward"]:
            result["async_over_sync_seconds_to_reward"] = lag["seconds_to_reward"] / sync["seconds_to_reward"]
        print(f"async - sync final reward: {result['async_minus_sync_final_reward']:+.3f}; async / sync seconds to "
              f"reward {args.target}: {result.get('async_over_sync_seconds_to_reward', 'n/a (not reached)')}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
