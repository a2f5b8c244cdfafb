"""tools/bench/async_vs_sync.py: the share of a role's cores it kept busy over a run's counted steps,
from the pinner's passes (CPU seconds so far at each wall-clock time)."""
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.unit

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))  # last: bench/agents.py is no SDK
from async_vs_sync import CorePinner  # noqa: E402


def test_busy_is_cpu_seconds_over_core_seconds_between_the_passes_inside_the_window():
    pinner = CorePinner({"engine": [1], "trainer": [0, 1]})
    pinner.history = [(10.0, {"machine": 0.0, "engine": 0.0, "trainer": 0.0}),
                      (11.0, {"machine": 1.0, "engine": 0.5, "trainer": 1.0}),
                      (13.0, {"machine": 3.0, "engine": 2.5, "trainer": 1.0}),
                      (14.0, {"machine": 5.0, "engine": 3.5, "trainer": 3.0})]
    # the window 10.5-13.5 reads the passes at 11 and 13: two seconds of wall clock
    busy = pinner.busy(10.5, 13.5)
    assert busy == {"machine": round(2.0 / (psutil.cpu_count() * 2.0), 3), "engine": 1.0, "trainer": 0.0}
    assert pinner.busy(10.0, 14.0)["trainer"] == round(3.0 / (2 * 4.0), 3)
