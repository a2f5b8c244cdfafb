"""A PNG of a run's curves: reward and train-inference mismatch per RL step (warm-up loss when no RL ran)."""
from __future__ import annotations

from pathlib import Path

from megarl.metrics.sink import read_metrics

PANELS = (("reward/mean", "mean reward", "linear"),
          ("mismatch/logprob_abs_diff", "|trainer - rollout| log-prob", "log"),
          ("warmup/loss", "warm-up loss", "linear"))


def plot_run(run_dir: str | Path, out_name: str = "curves.png") -> tuple[Path, dict[str, list[tuple[int, float]]]]:
    """Write ``run_dir/out_name``; returns its path and the (step, value) series it drew per key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    series = {key: [(r["step"], r[key]) for r in rows if r.get(key) is not None] for key, _, _ in PANELS}
    panels = [p for p in PANELS if series[p[0]]]
    if not panels:
        raise ValueError(f"{run_dir}/metrics.jsonl has none of {[p[0] for p in PANELS]}")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (key, title, scale) in zip(axes[0], panels):
        steps, values = zip(*series[key])
        ax.plot(steps, values, linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(run_dir) / out_name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, {key: values for key, values in series.items() if values}
