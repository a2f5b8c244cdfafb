"""The trackers a run's rows go to besides metrics.jsonl (megarl/metrics/trackers.py): wandb offline and an
MLflow file store read back with the libraries' own readers equal metrics.jsonl, a tracker that raises
leaves the run's logging going, and a config naming a tracker that is not installed exits 2 at load."""
from __future__ import annotations

import json
import logging
import math
import sys
import time

import pytest

from megarl.metrics.sink import MetricsFile, read_metrics
from megarl.metrics.trackers import MAX_FAILURES, TrackerSettings, WandbConfig, mlflow_metric_name
from megarl.train import main

CONFIG = {"run_name": "r", "rollout": {"top_k": 20, "temperature": 1.0}, "logging": {"trackers": ["wandb"]}}
ROWS = {1: {"reward/mean": 0.125, "eval/pass@4": 0.5, "mismatch/kl": 3.3e-7},
        2: {"reward/mean": 0.375, "mismatch/kl": float("nan")},
        3: {"reward/mean": 0.625, "eval/pass@4": 0.75, "mismatch/kl": 1.7e-5}}


def _log_rows(run_dir, settings: TrackerSettings) -> list[dict]:
    sink = MetricsFile(run_dir, settings)
    for step, values in ROWS.items():
        sink.log(step, values)
    assert sink.trackers.failed == {}
    sink.close()
    return read_metrics(run_dir)


def _logged(rows: list[dict]) -> dict[int, dict[str, float]]:
    """metrics.jsonl's rows as {step: {key: value}}, the nulls (non-finite values) left out."""
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time") and v is not None} for r in rows}


@pytest.mark.unit
def test_an_mlflow_file_store_reads_back_the_rows_of_metrics_jsonl(tmp_path):
    from mlflow.tracking import MlflowClient

    rows = _log_rows(tmp_path, TrackerSettings(names=["mlflow"], run_name="r", config=CONFIG))
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("r")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params == {"run_name": "r", "rollout.top_k": "20", "rollout.temperature": "1.0",
                               "logging.trackers": "['wandb']"}
    back: dict[int, dict[str, float]] = {}
    for key in ("reward/mean", "eval/pass@4", "mismatch/kl"):
        for metric in client.get_metric_history(run.info.run_id, mlflow_metric_name(key)):
            back.setdefault(metric.step, {})[key] = metric.value
    assert back == _logged(rows)
    assert mlflow_metric_name("eval/pass@4") == "eval/pass_at_4"
    stamps = {m.step: m.timestamp for m in client.get_metric_history(run.info.run_id, "reward/mean")}
    assert stamps == {r["step"]: int(r["time"] * 1000) for r in rows}


def _wandb_records(run_dir, wait_s: float = 60.0):
    """The history rows ({step: {key: value}}) and the config of the offline run under ``run_dir``, read
    with wandb's own reader of its run files, once the file holds the run's exit record (wandb's service
    writes it in a process of its own: on a loaded machine after ``finish`` returned)."""
    deadline = time.monotonic() + wait_s
    while True:
        history, config, run, ended = _wandb_file(run_dir)
        if ended or time.monotonic() > deadline:
            return history, config, run
        time.sleep(0.5)


def _wandb_file(run_dir):
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    history, config, run, ended = {}, {}, None, False
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "run":
            run = record.run
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        ended |= kind == "exit"
    return history, config, run, ended


@pytest.mark.processes  # wandb runs its core service as a process of its own
def test_wandb_offline_reads_back_the_rows_of_metrics_jsonl(tmp_path):
    settings = TrackerSettings(names=["wandb"], run_name="r", config=CONFIG,
                               wandb=WandbConfig(project="p", tags=["a", "b"], group="g", mode="offline"))
    rows = _log_rows(tmp_path, settings)
    history, config, run = _wandb_records(tmp_path)
    assert history == _logged(rows)
    assert {k: v for k, v in config.items() if k != "_wandb"} == CONFIG
    assert (run.project, run.display_name, list(run.tags), run.run_group) == ("p", "r", ["a", "b"], "g")
    assert (tmp_path / "wandb_run_id").read_text() == run.run_id  # a resumed run logs into the same run


class Raising:
    """A tracker whose ``log`` raises at the steps ``bad``."""

    def __init__(self, bad):
        self.bad, self.logged, self.closed = set(bad), [], False

    def log(self, step, values, wall_time):
        if step in self.bad:
            raise ConnectionError(f"tracker down at step {step}")
        self.logged.append(step)

    def close(self):
        self.closed = True


@pytest.mark.unit
def test_a_tracker_that_raises_is_logged_and_the_rows_go_on(tmp_path, monkeypatch, caplog):
    """A failing row is logged (traceback once); after MAX_FAILURES failures in a row the tracker is dropped;
    metrics.jsonl and the other trackers get every row."""
    flaky, broken = Raising(bad={2}), Raising(bad=range(3, 100))
    made = {"flaky": flaky, "broken": broken}
    monkeypatch.setattr("megarl.metrics.trackers.start_tracker", lambda name, settings, run_dir: made[name])
    sink = MetricsFile(tmp_path, TrackerSettings(names=["flaky", "broken"]))
    with caplog.at_level(logging.ERROR, logger="megarl.metrics.trackers"):
        for step in range(1, 9):
            sink.log(step, {"reward/mean": step / 10})
    sink.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))
    assert flaky.logged == [1, 3, 4, 5, 6, 7, 8] and flaky.closed
    assert broken.logged == [1, 2] and not broken.closed  # dropped after steps 3..2+MAX_FAILURES
    assert sink.trackers.failed == {"flaky": "ConnectionError: tracker down at step 2",
                                    "broken": f"ConnectionError: tracker down at step {2 + MAX_FAILURES}"}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 + MAX_FAILURES and sum(r.exc_info is not None for r in errors) == 2
    assert errors[-1].getMessage().endswith("the run goes on without it")


@pytest.mark.unit
def test_a_tracker_that_fails_to_start_is_left_out(tmp_path, caplog):
    """wandb online without a login fails in wandb.init: logged, and metrics.jsonl and TensorBoard go on."""
    def no_login(*args, **kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    import wandb

    settings = TrackerSettings(names=["tensorboard", "wandb"], config=CONFIG)
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(wandb, "init", no_login)
        sink = MetricsFile(tmp_path, settings)
    sink.log(1, {"reward/mean": 1.0})
    sink.close()
    assert sink.trackers.names == [] and list(sink.trackers.failed) == ["wandb"]
    assert (tmp_path / "tensorboard").is_dir() and math.isclose(read_metrics(tmp_path)[0]["reward/mean"], 1.0)


@pytest.mark.unit
@pytest.mark.parametrize("tracker,package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_that_is_not_installed_exits_2_at_load_naming_the_install_step(tmp_path, monkeypatch, capsys,
                                                                                 tracker, package):
    monkeypatch.setitem(sys.modules, package, None)  # what importing it finds when it is not installed
    assert main(["recipe=tiny_moe_cpu", f"logging.trackers=[tensorboard,{tracker}]",
                 f"logging.run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megarl: config error: logging.trackers: {tracker} is not installed: ")
    assert "tools/setup_venv.sh" in err and "==" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


@pytest.mark.unit
def test_the_tracker_settings_of_a_run_hold_its_logging_section_and_whole_resolved_config():
    from megarl.config import load_config
    from megarl.config.components import tracker_settings

    cfg = load_config(["recipe=tiny_moe_cpu", "logging.trackers=[tensorboard,mlflow]", "run_name=r7"])
    settings = tracker_settings(cfg)
    assert list(settings.names) == ["tensorboard", "mlflow"] and settings.run_name == "r7"
    assert settings.mlflow == cfg.logging.mlflow and settings.wandb == cfg.logging.wandb
    assert settings.config["run_name"] == "r7" and settings.config["trainer"]["lr"] == cfg.trainer.lr
    assert settings.config["logging"]["trackers"] == ["tensorboard", "mlflow"]
