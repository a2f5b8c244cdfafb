"""Score centering against truncated importance sampling (TIS), and both, on one recipe, side by side.

The variants start from the same warmed-up checkpoint (made once, first) and train ``--steps`` steps each, one
``python -m megarl.train`` process after the other (none shares the cores with another), in ``--mode``
(default async: one-step-stale samples, the off-policy case the corrections are for):

  none   no correction (``algorithm.off_policy_correction=none``)
  tis    token-level TIS (``off_policy_correction=tis``, ``is_threshold`` from the recipe)
  sc     score centering alone (``algorithm.score_centering=exact``, no IS weight)
  both   TIS and score centering (the centred score carries the token's TIS weight)

From each run's ``metrics.jsonl``:

  curve            mean reward per ``--window`` steps
  final_reward     mean reward of the last ``--last`` steps
  seconds_per_step RL-loop seconds (wait + train + sync) per step
  mismatch         per-step means over the run of the trainer-against-engine metrics every variant logs:
                   off_policy/kl, k3_kl, chi2_token, rollout_is_std, log_ppl_abs_diff, and staleness/logprob_drift
                   (stale tokens); score_centering/support_tv where the variant centres

Usage: python tools/bench/score_centering.py --json FILE [--recipe tiny_moe_cpu --steps 200 --variants
       none,tis,sc,both --set key=value ...]   (``--set`` overrides apply to every variant and the warm-up)
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

VARIANTS = {
    "none": ["algorithm.off_policy_correction=none", "algorithm.score_centering=none"],
    "tis": ["algorithm.off_policy_correction=tis", "algorithm.score_centering=none"],
    "sc": ["algorithm.off_policy_correction=none", "algorithm.score_centering=exact"],
    "both": ["algorithm.off_policy_correction=tis", "algorithm.score_centering=exact"],
}
MISMATCH = ("off_policy/kl", "off_policy/k3_kl", "off_policy/chi2_token", "off_policy/rollout_is_std",
            "off_policy/log_ppl_abs_diff", "staleness/logprob_drift", "score_centering/support_tv")


def run_figures(run_dir: Path, last: int, window: int) -> dict:
    """The figures above from ``run_dir/metrics.jsonl``."""
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no RL rows")
    rewards = [r["reward/mean"] for r in rows]
    loop_s = sum(r["time/wait_s"] + r["time/train_s"] + r["sync/seconds"] for r in rows)
    mismatch = {}
    for key in MISMATCH:
        values = [r[key] for r in rows if key in r]
        if values:
            mismatch[key] = sum(values) / len(values)
    tail = rewards[-last:]
    return {"steps": len(rows), "final_reward": sum(tail) / len(tail), "seconds_per_step": loop_s / len(rows),
            "curve": [round(sum(rewards[i:i + window]) / len(rewards[i:i + window]), 3)
                      for i in range(0, len(rewards), window)], "mismatch": mismatch}


def train(overrides: list[str]) -> None:
    """``python -m megarl.train`` with ``overrides``; raises on a failed run."""
    command = [sys.executable, "-m", "megarl.train", *overrides]
    if subprocess.run(command, cwd=REPO).returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}")


def table(figures: dict[str, dict]) -> str:
    """The variants side by side: final reward, curve, the mismatch means."""
    keys = [k for k in MISMATCH if any(k in f["mismatch"] for f in figures.values())]
    head = f"{'variant':>8} {'final':>6} {'s/step':>6} " + " ".join(f"{k.split('/')[-1]:>16}" for k in keys)
    lines = [head]
    for name, f in figures.items():
        cells = " ".join(f"{f['mismatch'][k]:>16.4g}" if k in f["mismatch"] else f"{'-':>16}" for k in keys)
        lines.append(f"{name:>8} {f['final_reward']:>6.3f} {f['seconds_per_step']:>6.2f} {cells}")
    lines += [f"{name:>8} curve {f['curve']}" for name, f in figures.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--recipe", default="tiny_moe_cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--variants", default="none,tis,sc,both", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--window", type=int, default=25, help="steps per point of the curve")
    parser.add_argument("--last", type=int, default=50, help="steps averaged into final_reward")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")

    work = work_directory(args.work_dir, "megarl-score-centering-")
    common = [f"recipe={args.recipe}", f"model.hf_path={work / 'base'}", "model.make_tiny_if_missing=true",
              f"warmup.save_hf_path={work / 'warm'}",
              f"steps={args.steps}", "trainer.resume=false", *args.set]
    if not (work / "warm" / "config.json").is_file():
        train([*common, "mode=warmup", f"logging.run_dir={work / 'warmup'}"])
    figures = {}
    for name in variants:
        run_dir = work / name
        train([*common, f"mode={args.mode}", *VARIANTS[name], f"logging.run_dir={run_dir}"])
        figures[name] = run_figures(run_dir, args.last, args.window)
        print(f"{name:>8}: last-{args.last} reward {figures[name]['final_reward']:.3f}, curve "
              f"{figures[name]['curve']}", flush=True)
    print(table(figures))
    result = {"recipe": args.recipe, "steps": args.steps, "mode": args.mode, "overrides": args.set,
              "variants": {name: VARIANTS[name] for name in variants}, "runs": figures}
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
