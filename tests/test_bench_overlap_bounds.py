"""tools/bench/async_vs_sync.py: its two bounds on async's speed-up over the sync run against a
simulated one-step-off pipeline, step by step; its CPU ceiling against CPU seconds sampled at a known rate."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))  # last: bench/agents.py is no SDK
from async_vs_sync import CorePinner, cpu_ceiling, overlap_bound, paused_bound  # noqa: E402


def simulated_async_step(rollout_s: float, train_s: float, sync_s: float, engine_paused: bool,
                         steps: int = 200) -> float:
    """Seconds a step of a one-step-off pipeline: batch k is generated once the engine is done with batch
    k - 1 and the sync of step k - 2 has ended (its weights are at most one version old at step k), step
    k trains it once it is there and the step before has synced, then syncs; with ``engine_paused`` the
    engine generates nothing during a sync (its work resumes after it)."""
    sync_end = {-1: 0.0, 0: 0.0}
    pauses: list[tuple[float, float]] = []
    engine_free = 0.0
    for k in range(1, steps + 1):
        t, left = max(engine_free, sync_end[k - 2]), rollout_s
        for a, b in pauses if engine_paused else []:
            if b <= t:
                continue
            if a >= t + left:
                break
            left -= max(0.0, a - t)
            t = b
        engine_free = t + left  # batch k is ready
        train_end = max(sync_end[k - 1], engine_free) + train_s
        sync_end[k] = train_end + sync_s
        pauses.append((train_end, sync_end[k]))
    return (sync_end[steps] - sync_end[steps // 2]) / (steps - steps // 2)


@pytest.mark.parametrize("rollout_s,train_s,sync_s", [(0.26, 0.17, 0.04), (0.54, 0.70, 0.04), (0.3, 0.1, 0.2),
                                                      (0.2, 0.2, 0.05), (1.0, 0.4, 0.0)])
def test_the_bounds_are_the_simulated_pipelines_speed_up(rollout_s, train_s, sync_s):
    sync_run = {"wait_s_mean": rollout_s, "train_s_mean": train_s, "sync_s_mean": sync_s}
    sync_step = rollout_s + train_s + sync_s
    paused = sync_step / simulated_async_step(rollout_s, train_s, sync_s, engine_paused=True)
    overlapped = sync_step / simulated_async_step(rollout_s, train_s, sync_s, engine_paused=False)
    assert paused_bound(sync_run) == pytest.approx(paused, rel=1e-9)
    assert overlap_bound(sync_run) == pytest.approx(overlapped, rel=1e-9)
    assert paused_bound(sync_run) <= overlap_bound(sync_run) + 1e-12
    assert (paused_bound(sync_run) == pytest.approx(overlap_bound(sync_run))) == (sync_s == 0 or train_s >= rollout_s)


def test_the_cpu_ceiling_is_where_the_async_runs_cpu_a_step_fills_every_core():
    """An async run of 0.25 s steps that use 0.2 CPU-s a step per core of the machine (sampled every
    0.1 s as the bench's pinner does): with every core busy a step would take 0.2 s, so against a
    0.6 s sync step the ceiling is 3x; the measured busy share (0.8) gives the same."""
    import psutil

    cores, step_s, sync_step_s = psutil.cpu_count(), 0.25, 0.6
    cpu_per_step = 0.2 * cores
    pinner = CorePinner({})
    pinner.history = [(100 + 0.1 * i, {"machine": 50 + cpu_per_step / step_s * 0.1 * i}) for i in range(60)]
    busy = pinner.busy(100.45, 105.55)["machine"]
    assert busy == pytest.approx(0.8)
    assert cpu_ceiling(sync_step_s, step_s, busy) == pytest.approx(sync_step_s / (cpu_per_step / cores))
    assert cpu_ceiling(sync_step_s, step_s, busy) == pytest.approx(3.0)


def test_a_window_under_two_cpu_samples_is_an_error_naming_the_remedy():
    pinner = CorePinner({})
    pinner.history = [(100.0, {"machine": 1.0}), (100.25, {"machine": 1.2}), (100.5, {"machine": 1.4})]
    with pytest.raises(ValueError, match="under two CPU samples.*more --steps"):
        pinner.busy(100.1, 100.4)
    assert pinner.busy(100.0, 100.25)["machine"] > 0
