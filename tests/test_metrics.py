"""metrics.jsonl rows, the TensorBoard scalars written beside them, GPU stats from NVML, and the
curves PNG drawn from the rows."""
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from megarl.metrics.gpu import GpuStats
from megarl.metrics.plot import plot_run
from megarl.metrics.sink import MetricsFile, read_metrics

pytestmark = pytest.mark.unit


def test_rows_round_trip_and_non_finite_values_become_null(tmp_path):
    sink = MetricsFile(tmp_path)
    sink.log(1, {"reward/mean": 0.25, "mismatch/logprob_abs_diff": float("nan")})
    sink.log(2, {"reward/mean": 0.5, "mismatch/logprob_abs_diff": 1e-4})
    sink.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.25), (2, 0.5)]
    assert rows[0]["mismatch/logprob_abs_diff"] is None and math.isclose(rows[1]["mismatch/logprob_abs_diff"], 1e-4)


def test_plot_draws_the_logged_series(tmp_path):
    """Reward in one panel; the mismatch of the tokens of the trainer's weights (mean and maximum) and
    stale-token drift together in the other (step 1 had no stale tokens, so no drift row); the fresh
    tokens' own mismatch stays in metrics.jsonl."""
    sink = MetricsFile(tmp_path)
    for step in range(1, 6):
        sink.log(step, {"reward/mean": step / 10, "mismatch/current_logprob_abs_diff": 1e-4 * step,
                        "mismatch/current_logprob_abs_diff_max": 1e-3 * step, "mismatch/logprob_abs_diff": 1.0,
                        **({"staleness/logprob_drift": 1e-2 * step} if step > 1 else {})})
    sink.close()
    path, series = plot_run(tmp_path)
    assert series == {"reward/mean": [(s, s / 10) for s in range(1, 6)],
                      "mismatch/current_logprob_abs_diff": [(s, 1e-4 * s) for s in range(1, 6)],
                      "mismatch/current_logprob_abs_diff_max": [(s, 1e-3 * s) for s in range(1, 6)],
                      "staleness/logprob_drift": [(s, 1e-2 * s) for s in range(2, 6)]}
    assert Image.open(path).size == (1000, 350)  # two panels of 5 x 3.5 inches at 100 dpi


def test_plot_of_a_run_with_only_drift_or_only_warmup(tmp_path):
    sink = MetricsFile(tmp_path)
    sink.log(1, {"staleness/logprob_drift": 0.1})
    sink.close()
    path, series = plot_run(tmp_path)
    assert series == {"staleness/logprob_drift": [(1, 0.1)]} and Image.open(path).size == (500, 350)
    warmup = tmp_path / "warmup"
    sink = MetricsFile(warmup)
    sink.log(1, {"warmup/loss": 5.0})
    sink.close()
    assert plot_run(warmup)[1] == {"warmup/loss": [(1, 5.0)]}


def test_tensorboard_scalars_read_back_equal_the_logged_values(tmp_path):
    """Every finite value comes back from the event file (as float32) at its step; NaN is left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = {1: {"reward/mean": 0.125, "mismatch/kl": 3.3e-7, "perf/tokens_per_s": 1234.5},
              2: {"reward/mean": 0.375, "mismatch/kl": float("nan"), "perf/tokens_per_s": 987.25},
              5: {"reward/mean": 0.6, "mismatch/kl": 1.7e-5, "perf/tokens_per_s": 2048.0}}
    sink = MetricsFile(tmp_path)
    for step, values in logged.items():
        sink.log(step, values)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["mismatch/kl", "perf/tokens_per_s", "reward/mean"]
    for key in ("reward/mean", "mismatch/kl", "perf/tokens_per_s"):
        want = [(step, np.float32(v[key])) for step, v in logged.items() if math.isfinite(v[key])]
        assert [(e.step, np.float32(e.value)) for e in events.Scalars(key)] == want, key
    times = [row["time"] for row in read_metrics(tmp_path)]
    assert [e.wall_time for e in events.Scalars("reward/mean")] == pytest.approx(times, abs=1e-3)


class FakeNvml:
    """pynvml's API over two fake devices (bytes and percent as NVML reports them)."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init=False, util_unsupported=()):
        self.fail_init, self.util_unsupported, self.shutdowns = fail_init, util_unsupported, 0
        self.devices = [dict(used=3 * 2**30 + 2**29, total=80 * 2**30, gpu=37),
                        dict(used=123_456_789, total=150_592_290_816, gpu=100)]

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, handle):
        d = self.devices[handle]
        return SimpleNamespace(used=d["used"], total=d["total"], free=d["total"] - d["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle in self.util_unsupported:
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=self.devices[handle]["gpu"], memory=0)


def test_gpu_stats_convert_nvml_bytes_to_gib_per_device():
    nvml = FakeNvml(util_unsupported=(1,))
    stats = GpuStats(nvml)
    sample = stats.sample()
    assert sample == {"gpu/0/memory_used_gb": 3.5, "gpu/0/memory_total_gb": 80.0, "gpu/0/utilization_pct": 37.0,
                      "gpu/1/memory_used_gb": pytest.approx(0.11497809), "gpu/1/memory_total_gb": 140.25}
    stats.close()
    stats.close()
    assert nvml.shutdowns == 1 and stats.sample() == {}


def test_gpu_stats_are_empty_when_nvml_does_not_start(caplog):
    with caplog.at_level(logging.INFO, logger="megarl.metrics.gpu"):
        stats = GpuStats(FakeNvml(fail_init=True))
        assert stats.sample() == {} and stats.sample() == {}
        stats.close()
    assert [r.getMessage() for r in caplog.records] == ["no GPU metrics: NVML did not start (Driver Not Loaded)"]


def test_gpu_stats_on_this_machine_match_what_torch_sees():
    """The real pynvml: {} on a machine without an NVIDIA driver, one entry set per device with one."""
    import torch

    stats = GpuStats()
    sample = stats.sample()
    stats.close()
    if not torch.cuda.is_available():
        assert sample == {}
    else:
        assert {k.split("/")[1] for k in sample} >= {str(i) for i in range(torch.cuda.device_count())}
        assert 0 < sample["gpu/0/memory_used_gb"] <= sample["gpu/0/memory_total_gb"]


def test_load_stats_of_a_layer_by_hand():
    """counts [4, 0, 2, 2]: mean 2, busiest 4; one expert of four idle; shares (.5, .25, .25) give
    -(.5 ln .5 + 2 * .25 ln .25) / ln 4 = 0.75."""
    from megarl.metrics.expert_load import load_distance, load_stats

    assert load_stats(np.array([4, 0, 2, 2])) == pytest.approx({"max_over_mean": 2.0, "idle_frac": 0.25,
                                                                "entropy": 0.75})
    assert load_stats(np.array([3, 3, 3])) == pytest.approx({"max_over_mean": 1.0, "idle_frac": 0.0, "entropy": 1.0})
    assert load_distance(np.array([4, 0, 2, 2]), np.array([0, 4, 2, 2])) == pytest.approx(0.5)


def test_route_counts_and_the_step_metrics_per_layer():
    """Two samples' routes [T-1, L=2, k=2] over 4 experts counted per layer; layer 2 of the trainer idle."""
    from megarl.metrics.expert_load import expert_load_metrics, route_counts

    a = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]]], dtype=np.int16)  # 2 tokens
    b = np.array([[[1, 0], [3, 2]]], dtype=np.int16)  # 1 token
    counts = route_counts([a, b], 4)
    assert counts.tolist() == [[3, 2, 1, 0], [0, 0, 3, 3]]
    trainer = np.array([[2, 2, 1, 1], [0, 0, 0, 0]], dtype=np.float64)  # a layer with no tokens is left out
    metrics = expert_load_metrics(counts, trainer, [1, 2])
    assert metrics["experts/engine/L1/max_over_mean"] == pytest.approx(3 / 1.5)
    assert metrics["experts/engine/L2/idle_frac"] == 0.5 and metrics["experts/engine/idle_frac"] == 0.375
    assert metrics["experts/engine/max_over_mean"] == 2.0  # the worst layer's
    assert metrics["experts/L1/load_tv"] == pytest.approx(0.5 * (1 + 0 + 0 + 1) / 6) == metrics["experts/load_tv"]
    assert "experts/trainer/L2/entropy" not in metrics and "experts/L2/load_tv" not in metrics


def test_plot_draws_the_evaluation_and_the_expert_load_when_logged(tmp_path):
    """pass@k's key is found whatever k the run used; eval rows are sparse, between the steps' rows."""
    sink = MetricsFile(tmp_path)
    for step in range(1, 5):
        sink.log(step, {"reward/mean": step / 10, "experts/engine/max_over_mean": 1 + step / 10,
                        "experts/trainer/max_over_mean": 1.5})
        if step % 2 == 0:
            sink.log(step, {"eval/reward": step / 8, "eval/pass@1": step / 8, "eval/pass@8": step / 4})
    sink.close()
    path, series = plot_run(tmp_path)
    assert series["eval/pass@8"] == [(2, 0.5), (4, 1.0)] and series["eval/pass@1"] == [(2, 0.25), (4, 0.5)]
    assert series["experts/trainer/max_over_mean"] == [(s, 1.5) for s in range(1, 5)]
    assert Image.open(path).size == (1500, 350)  # reward, evaluation, expert load
