"""tools/bench/process_cpu.py: CPU seconds a step from samples taken every second, against the rate the
samples were made from (a window rarely starts and ends on a sample)."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))  # last: bench/agents.py is no SDK
from process_cpu import CpuSampler  # noqa: E402


def sampler_of(rates: dict[int, tuple[str, float, float]], times: list[float]) -> CpuSampler:
    """A sampler holding samples at ``times`` of processes pid -> (role, CPU seconds a second, start time)."""
    sampler = CpuSampler()
    sampler.samples = [(t, {pid: (role, rate * (t - born)) for pid, (role, rate, born) in rates.items() if t >= born})
                       for t in times]
    return sampler


def test_a_step_gets_the_rate_of_use_times_its_seconds_when_the_window_falls_between_samples():
    sampler = sampler_of({1: ("trainer", 0.3, 0.0), 2: ("driver", 0.1, 0.0), 3: ("driver", 0.05, 0.0)},
                         [0.5, 1.5, 2.5, 3.5, 4.5])
    # 8 steps from t=0.2 to t=4.2: 0.525 s a step; samples inside at 0.5 .. 3.5 only
    per_step = sampler.per_step(0.2, 4.2, 8)
    assert per_step == pytest.approx({"driver": 0.15 * 0.5, "trainer": 0.3 * 0.5}, abs=1e-4)


def test_a_process_started_inside_the_window_counts_what_was_seen_of_it():
    sampler = sampler_of({1: ("trainer", 1.0, 0.0), 2: ("sglang_http", 1.0, 2.0)}, [0.0, 1.0, 2.0, 3.0, 4.0])
    per_step = sampler.per_step(0.0, 4.0, 4)
    assert per_step["trainer"] == pytest.approx(1.0)
    assert per_step["sglang_http"] == pytest.approx(0.5)  # 2 CPU-s seen over the 4 s span


def test_a_window_with_fewer_than_two_samples_is_not_sampled():
    sampler = sampler_of({1: ("trainer", 1.0, 0.0)}, [0.0, 1.0, 2.0])
    assert sampler.per_step(0.2, 1.8, 4) is None
    assert sampler.per_step(0.0, 1.0, 4) == {"trainer": 0.25}
