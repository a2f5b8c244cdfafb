"""``metrics.jsonl`` in the run directory: one JSON object per line, ``{"step": N, "<group>/<name>": value}``."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsFile:
    """Appends one line per :meth:`log` call and flushes it, so a killed run keeps what it logged."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        for key, value in values.items():
            value = float(value)
            row[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run's ``metrics.jsonl``, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
