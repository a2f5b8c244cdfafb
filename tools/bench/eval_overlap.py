"""The training stream while held-out evaluations share the engines, in async mode: the demo with and
without ``eval.*``, side by side.

usage: python tools/bench/eval_overlap.py [--json FILE] [--steps N] [--interval K] [--skip-steps S]
                                          [--warmup-steps W] [--eval-prompts P]

The demo recipe (one CPU engine, one trainer rank) is warmed up once (``--warmup-steps``), then run twice from
that checkpoint in async mode for ``--steps`` steps: ``eval`` evaluates every ``--interval`` steps (the recipe's
``eval.*`` with ``eval.prompts`` = ``--eval-prompts``), ``no_eval`` does not. The training stream's rate is the
samples it started a second (``buffer/samples_started`` between two steps' rows over the seconds between them),
per step after the first ``--skip-steps``. A step of the ``eval`` run is *during* an evaluation when its
interval overlaps one: an evaluation starts as its version's row is written and lasts ``eval/seconds``.

JSON: per run ``samples_per_s`` (over the counted steps), ``step_s_mean``; for ``eval`` also
``samples_per_s_during`` and ``samples_per_s_outside`` (the mean per-step rate of the steps during and
outside evaluations), ``during_over_outside``, the evaluations' own ``eval/stream_samples_per_s`` over
``eval/stream_samples_per_s_outside`` (``logged_during_over_outside``), ``eval_seconds_mean`` and
``eval_wait_s_mean`` (how long a sync waited for an evaluation); and ``eval_over_no_eval``: the eval run's
``samples_per_s`` over the other's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def stream_rates(rows: list[dict], skip: int) -> list[tuple[float, float, float]]:
    """(start, end, samples started a second) of each step after the first ``skip`` (unix seconds)."""
    steps = [r for r in rows if "reward/mean" in r]
    started = "buffer/samples_started"
    return [(a["time"], b["time"], (b[started] - a[started]) / (b["time"] - a["time"]))
            for a, b in zip(steps[skip:], steps[skip + 1:])]


def eval_windows(rows: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of each evaluation after training began: from its version's step row, ``eval/seconds`` long."""
    at = {r["step"]: r["time"] for r in rows if "reward/mean" in r}
    return [(at[r["step"]], at[r["step"]] + r["eval/seconds"]) for r in rows if "eval/reward" in r and r["step"] in at]


def figures(run_dir: Path, skip: int) -> dict:
    from megarl.metrics.sink import read_metrics

    rows = read_metrics(run_dir)
    rates = stream_rates(rows, skip)
    seconds = rates[-1][1] - rates[0][0]
    started = [r for r in rows if "reward/mean" in r]
    out = {"steps_counted": len(rates), "step_s_mean": seconds / len(rates),
           "samples_per_s": (started[-1]["buffer/samples_started"] - started[skip]["buffer/samples_started"]) / seconds}
    windows = eval_windows(rows)
    if not windows:
        return out
    during = [r for a, b, r in rates if any(a < end and start < b for start, end in windows)]
    outside = [r for a, b, r in rates if not any(a < end and start < b for start, end in windows)]
    evals = [r for r in rows if "eval/reward" in r and r["step"] > 0]
    logged = [r["eval/stream_samples_per_s"] / r["eval/stream_samples_per_s_outside"] for r in evals
              if r.get("eval/stream_samples_per_s_outside")]
    out |= {"evaluations": len(evals), "steps_during": len(during), "steps_outside": len(outside),
            "samples_per_s_during": statistics.fmean(during), "samples_per_s_outside": statistics.fmean(outside),
            "eval_seconds_mean": statistics.fmean(r["eval/seconds"] for r in evals),
            "eval_wait_s_mean": statistics.fmean(r["eval/wait_s"] for r in evals),
            "logged_during_over_outside": statistics.fmean(logged) if logged else None}
    out["during_over_outside"] = out["samples_per_s_during"] / out["samples_per_s_outside"]
    return out


def run(args) -> dict:
    from megarl.train import main

    with tempfile.TemporaryDirectory() as tmp:
        base, warm = f"{tmp}/base", f"{tmp}/warm"
        common = ["recipe=tiny_moe_cpu", f"model.hf_path={base}", "model.make_tiny_if_missing=true",
                  f"warmup.save_hf_path={warm}",
                  f"warmup.steps={args.warmup_steps}"]
        if main([*common, "mode=warmup", f"logging.run_dir={tmp}/warmup"]) != 0:
            raise RuntimeError("the warm-up failed")
        result = {"steps": args.steps, "interval": args.interval, "skip_steps": args.skip_steps,
                  "eval_prompts": args.eval_prompts}
        for name, overrides in (("eval", [f"eval.interval={args.interval}", f"eval.prompts={args.eval_prompts}"]),
                                ("no_eval", ["eval.interval=0"])):
            run_dir = Path(tmp) / name
            if main([*common, "mode=async", f"steps={args.steps}", f"logging.run_dir={run_dir}", *overrides]) != 0:
                raise RuntimeError(f"the {name} run failed")
            result[name] = figures(run_dir, args.skip_steps)
    result["eval_over_no_eval"] = result["eval"]["samples_per_s"] / result["no_eval"]["samples_per_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--skip-steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--eval-prompts", type=int, default=20)
    args = parser.parse_args(argv)
    result = run(args)
    e = result["eval"]
    print(f"training stream {e['samples_per_s_during']:.0f} samples/s during evaluations, "
          f"{e['samples_per_s_outside']:.0f} outside (x{e['during_over_outside']:.2f}); with evaluations "
          f"{e['samples_per_s']:.0f}, without {result['no_eval']['samples_per_s']:.0f} samples/s "
          f"(x{result['eval_over_no_eval']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
