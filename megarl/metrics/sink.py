"""A run's metrics sink: ``metrics.jsonl`` in the run directory (one JSON object per line,
``{"step": N, "time": unix seconds, "<group>/<name>": value}``) and the same values in the run's
trackers (:mod:`megarl.metrics.trackers`: TensorBoard scalars under ``run_dir/tensorboard/`` by default,
wandb, MLflow)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from megarl.metrics.trackers import Trackers, TrackerSettings


class MetricsFile:
    """Appends one line per :meth:`log` call to ``metrics.jsonl``, flushed, so a killed run keeps what
    it logged, and hands the same row to the trackers of ``trackers`` (default: TensorBoard alone). Non-finite
    values are ``null`` in the JSONL and left out of the trackers. Create it on one rank only."""

    def __init__(self, run_dir: str | Path, trackers: TrackerSettings | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self.trackers = Trackers(trackers or TrackerSettings(), run_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        now = round(time.time(), 3)
        row = {"step": step, "time": now}
        for key, value in values.items():
            value = float(value)
            row[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.trackers.log(step, values, wall_time=now)

    def close(self) -> None:
        self._file.close()
        self.trackers.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run's ``metrics.jsonl``, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
