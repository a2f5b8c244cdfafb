"""TensorBoard event files of a run: one scalar series per metric key under ``run_dir/tensorboard/``.

Scalars are stored as float32 (TensorBoard's format); non-finite values are not written (the
series has a gap there, as ``metrics.jsonl`` has ``null``). Each :meth:`TensorBoardScalars.log`
flushes, so a killed run keeps every step it logged; a resumed run adds a new event file to the
same folder and TensorBoard shows both as one run.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

TENSORBOARD_DIR = "tensorboard"


class TensorBoardScalars:
    """Writes ``{key: value}`` at a step as TensorBoard scalars (tag = the metric key), one event a step."""

    def __init__(self, run_dir: str | Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._writer = EventFileWriter(str(self.log_dir))

    def log(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        """Add every finite value at ``step`` (``wall_time``: seconds since the epoch; now if None)."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        numbers = {key: float(value) for key, value in values.items()}
        scalars = [Summary.Value(tag=key, simple_value=v) for key, v in numbers.items() if math.isfinite(v)]
        self._writer.add_event(Event(wall_time=time.time() if wall_time is None else wall_time, step=step,
                                     summary=Summary(value=scalars)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
