"""metrics.jsonl rows and the curves PNG drawn from them."""
import math

from PIL import Image

from megarl.metrics.plot import plot_run
from megarl.metrics.sink import MetricsFile, read_metrics


def test_rows_round_trip_and_non_finite_values_become_null(tmp_path):
    sink = MetricsFile(tmp_path)
    sink.log(1, {"reward/mean": 0.25, "mismatch/logprob_abs_diff": float("nan")})
    sink.log(2, {"reward/mean": 0.5, "mismatch/logprob_abs_diff": 1e-4})
    sink.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.25), (2, 0.5)]
    assert rows[0]["mismatch/logprob_abs_diff"] is None and math.isclose(rows[1]["mismatch/logprob_abs_diff"], 1e-4)


def test_plot_draws_the_logged_series(tmp_path):
    sink = MetricsFile(tmp_path)
    for step in range(1, 6):
        sink.log(step, {"reward/mean": step / 10, "mismatch/logprob_abs_diff": 1e-4 * step})
    sink.close()
    path, series = plot_run(tmp_path)
    assert series == {"reward/mean": [(s, s / 10) for s in range(1, 6)],
                      "mismatch/logprob_abs_diff": [(s, 1e-4 * s) for s in range(1, 6)]}
    assert Image.open(path).size == (1000, 350)  # two panels of 5 x 3.5 inches at 100 dpi
