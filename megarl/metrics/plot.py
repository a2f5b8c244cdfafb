"""A PNG of a run's curves: reward, and the train-inference mismatch of the tokens sampled by the
weights the trainer holds (fresh and boundary: its mean and maximum) beside the drift of stale tokens,
per RL step (warm-up loss when no RL ran); the held-out evaluation and the experts' load when the run
logged them."""
from __future__ import annotations

import fnmatch
from pathlib import Path

from megarl.metrics.sink import read_metrics

# (title, y scale, ((key, legend label), ...)): a panel is drawn when any of its keys was logged
PANELS = (("mean reward", "linear", (("reward/mean", None),)),
          ("|trainer - rollout| log-prob", "log",
           (("mismatch/current_logprob_abs_diff", "mismatch (fresh + boundary tokens)"),
            ("mismatch/current_logprob_abs_diff_max", "mismatch, max (fresh + boundary)"),
            ("staleness/logprob_drift", "drift (stale tokens)"))),
          ("warm-up loss", "linear", (("warmup/loss", None),)),
          ("held-out evaluation", "linear",
           (("eval/reward", "reward (sampled)"), ("eval/greedy/reward", "reward (greedy)"),
            ("eval/pass@*", "pass@{}"))),
          ("expert load: busiest / mean (worst layer)", "linear",
           (("experts/engine/max_over_mean", "engine's routes"),
            ("experts/trainer/max_over_mean", "trainer's router"))))
# a key with ``*`` stands for every logged key it matches (fnmatch), its label formatted with what the ``*`` matched


def _expanded(rows: list[dict]) -> list[tuple]:
    """:data:`PANELS` with their wildcard keys replaced by the logged keys they match, in order."""
    logged = list(dict.fromkeys(k for r in rows for k in r))
    panels = []
    for title, scale, lines in PANELS:
        out = []
        for key, label in lines:
            if "*" not in key:
                out.append((key, label))
                continue
            head, tail = key.split("*", 1)
            out += [(k, label.format(k[len(head):len(k) - len(tail)])) for k in logged if fnmatch.fnmatchcase(k, key)]
        panels.append((title, scale, tuple(out)))
    return panels


def plot_run(run_dir: str | Path, out_name: str = "curves.png") -> tuple[Path, dict[str, list[tuple[int, float]]]]:
    """Write ``run_dir/out_name``; returns its path and the (step, value) series it drew per key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    panels = _expanded(rows)
    keys = [key for _, _, lines in panels for key, _ in lines]
    series = {key: [(r["step"], r[key]) for r in rows if r.get(key) is not None] for key in keys}
    panels = [p for p in panels if any(series[key] for key, _ in p[2])]
    if not panels:
        raise ValueError(f"{run_dir}/metrics.jsonl has none of {keys}")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (title, scale, lines) in zip(axes[0], panels):
        for key, label in lines:
            if series[key]:
                steps, values = zip(*series[key])
                ax.plot(steps, values, linewidth=1, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
        if len(lines) > 1:
            ax.legend(fontsize="small")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(run_dir) / out_name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, {key: values for key, values in series.items() if values}
