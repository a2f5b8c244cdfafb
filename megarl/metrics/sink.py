"""A run's metrics sink: ``metrics.jsonl`` in the run directory (one JSON object per line,
``{"step": N, "time": unix seconds, "<group>/<name>": value}``) and the same values as TensorBoard
scalars under ``run_dir/tensorboard/``."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from megarl.metrics.tensorboard import TensorBoardScalars


class MetricsFile:
    """Appends one line per :meth:`log` call to ``metrics.jsonl`` and the same step to the
    TensorBoard event file, flushing both, so a killed run keeps what it logged. Non-finite values
    are ``null`` in the JSONL and left out of TensorBoard. Create it on one rank only."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tensorboard = TensorBoardScalars(run_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        now = round(time.time(), 3)
        row = {"step": step, "time": now}
        for key, value in values.items():
            value = float(value)
            row[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._tensorboard.log(step, values, wall_time=now)

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run's ``metrics.jsonl``, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
