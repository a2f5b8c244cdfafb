"""A demo run in async mode that evaluates held-out sums at the configured steps (before training, every two
steps and after the last), each row of one weight version, with its rows in metrics.jsonl, an MLflow file
store and an offline wandb run alike."""
import math

import pytest
from test_trackers import _wandb_records

from megarl.metrics.sink import read_metrics
from megarl.metrics.trackers import mlflow_metric_name
from megarl.train import main

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

EVAL_KEYS = {"eval/reward", "eval/pass@1", "eval/pass@4", "eval/response_len_mean", "eval/greedy/reward",
             "eval/greedy/pass", "eval/greedy/response_len_mean", "eval/weight_version", "eval/prompts", "eval/errors",
             "eval/seconds", "eval/wait_s", "eval/stream_samples_per_s"}


@pytest.fixture(scope="module")
def run(warmed_up, tmp_path_factory):
    run = tmp_path_factory.mktemp("eval") / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=async", "steps=5", "rollout.prompts_per_step=8",
                 "rollout.samples_per_prompt=4", "warmup.steps=30", f"logging.run_dir={run}", *warmed_up.overrides,
                 "eval.interval=2", "eval.before_training=true", "eval.prompts=12",
                 "logging.trackers=[tensorboard,mlflow,wandb]", "logging.wandb.mode=offline"]) == 0
    return run


def test_eval_rows_at_the_configured_steps_each_of_one_weight_version(run):
    rows = read_metrics(run)
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]  # before training, every 2 steps, after the last
    steps = [r["step"] for r in rows if "reward/mean" in r or "eval/reward" in r]
    assert steps == [0, 1, 2, 2, 3, 4, 4, 5, 5]  # an evaluation's row follows its step's
    for row in evals:
        assert EVAL_KEYS <= row.keys(), EVAL_KEYS - row.keys()
        assert row["eval/weight_version"] == row["step"] and row["eval/prompts"] == 12 and row["eval/errors"] == 0
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@4"] <= 1 and 1 <= row["eval/response_len_mean"] <= 3
    # the warmed-up model answers some held-out sums it never trained on (RL or warm-up held none out)
    assert max(r["eval/greedy/pass"] for r in evals) > 0


def test_the_trackers_hold_the_rows_of_metrics_jsonl(run):
    """MLflow (read back with its client) and wandb (its offline run file) have every value metrics.jsonl has."""
    from mlflow.tracking import MlflowClient

    rows = read_metrics(run)
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("tiny_moe_cpu").experiment_id])
    history, config, _ = _wandb_records(run)
    assert config["eval"]["interval"] == 2 and found.data.params["eval.interval"] == "2"
    for key in ("reward/mean", "eval/pass@4", "experts/engine/max_over_mean", "train/grad_norm"):
        want = {r["step"]: r[key] for r in rows if r.get(key) is not None}
        assert want, key
        got = {m.step: m.value for m in client.get_metric_history(found.info.run_id, mlflow_metric_name(key))}
        assert got == pytest.approx(want), key
        assert {step: values[key] for step, values in history.items() if key in values} == pytest.approx(want), key
    assert all(math.isfinite(v) for values in history.values() for v in values.values() if isinstance(v, float))
