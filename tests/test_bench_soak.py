"""tools/bench/soak.py: growth between the baseline sample and the last, per process and per role, the
processes that came and went, the step rates, and the metrics rows read as they are written."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))  # last: bench/agents.py is no SDK
from soak import compare, new_rows, report, step_rate  # noqa: E402


def proc(pid, role, rss, fds, threads):
    return {"pid": pid, "role": role, "rss": rss, "fds": fds, "threads": threads}


def sample(step, processes, store=(100, 2), run_dir=1000):
    return {"step": step, "processes": processes, "object_store": {"bytes": store[0], "objects": store[1]},
            "run_dir": run_dir}


def test_growth_is_per_process_alive_at_both_and_per_role_summed():
    base = sample(200, [proc(1, "driver", 1000, 10, 4), proc(2, "trainer", 3000, 20, 8), proc(3, "other", 5, 1, 1)])
    last = sample(2000, [proc(1, "driver", 1100, 10, 4), proc(2, "trainer", 3000, 25, 8), proc(4, "other", 7, 1, 1)],
                  store=(160, 3), run_dir=1500)
    out = compare(base, last)
    assert [(p["pid"], p["rss_growth_pct"], p["fds_growth_pct"]) for p in out["per_process"]] == [(1, 10.0, 0.0),
                                                                                               (2, 0.0, 25.0)]
    assert out["per_role"]["driver"] == {"rss_growth_pct": 10.0, "fds_growth_pct": 0.0, "threads_growth_pct": 0.0}
    assert "other" not in out["per_role"]  # pid 3 ended, pid 4 started: neither was alive at both
    assert [p["pid"] for p in out["started"]] == [4] and [p["pid"] for p in out["ended"]] == [3]
    assert (out["object_store_growth_bytes"], out["object_store_growth_objects"], out["run_dir_growth_pct"]) == \
        (60, 1, 50.0)


def test_step_rates_after_the_baseline_and_at_the_end():
    rows = [{"step": s, "time": 100.0 + s * (0.5 if s <= 30 else 1.0)} for s in range(1, 61)]
    assert step_rate(rows, 20, 30) == pytest.approx(2.0)
    assert step_rate(rows, 50, 60) == pytest.approx(1.0)
    samples = [sample(s, [proc(1, "driver", 1, 1, 1)]) for s in (1, 10, 20, 30, 40, 50, 60)]
    r = report(rows, samples, baseline_step=20, every=10)
    assert (r["baseline_step"], r["last_step"], r["step_rate_ratio"]) == (20, 60, 0.5)
    with pytest.raises(SystemExit, match="no sample after the baseline step 70"):
        report(rows, samples, baseline_step=70, every=10)


def test_rows_are_read_as_written_and_a_line_not_yet_ended_waits(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n" + json.dumps({"eval/reward": 1}) + "\n"
                    + '{"step": 2, "rew')
    rows, offset = new_rows(path, 0)
    assert [r["step"] for r in rows] == [1]
    with open(path, "a") as f:
        f.write('ard/mean": 0.25}\n')
    rows, offset = new_rows(path, offset)
    assert rows == [{"step": 2, "reward/mean": 0.25}] and offset == path.stat().st_size
