"""A run directory belongs to one run: starting over sets the old run aside, a resume follows ``latest`` of the
run it resumes (the trainer's and the conversion tool's choice of checkpoint alike), a resume in another mode or
with nothing left to train is refused in one line, old checkpoints are pruned to ``trainer.keep_checkpoints``.
Checkpoints here are stand-ins (files and their completion record), as the driver sees them before any rank
starts."""
import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.metrics.sink import MetricsFile, read_metrics
from megarl.pipeline.run_dir import NothingLeftToTrain, open_run_dir, resume_command, set_aside, start_over_command
from megarl.train import what_a_rerun_does
from megarl.trainer.checkpoint import (
    CheckpointError,
    _file_record,
    _write_completion_record,
    newest_complete,
    prune_checkpoints,
    step_dir,
)
from megarl.trainer.convert import checkpoint_dir

pytestmark = pytest.mark.unit


def save(root: Path, step: int) -> None:
    """A complete stand-in checkpoint of ``step`` under ``root``; ``latest`` names it."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "shard.distcp").write_bytes(bytes(range(256)) * step)
    _write_completion_record(path, step, {"shard.distcp": _file_record(path / "shard.distcp")})
    (root / "latest").write_text(f"{step}\n")


def stopped_run(run: Path, steps: int, mode: str = "async", save_every: int = 4) -> None:
    """What a run stopped after ``steps`` leaves: checkpoints, metrics rows, an event file, its config.yaml."""
    for step in range(1, steps + 1):
        if step % save_every == 0 or step == steps:
            save(run / "checkpoints", step)
    metrics = MetricsFile(run)
    for step in range(1, steps + 1):
        metrics.log(step, {"reward/mean": step / 10})
    metrics.close()
    (run / "config.yaml").write_text(f"mode: {mode}\nsteps: 300\n")


def config(run: Path, *overrides: str):
    return load_config(["recipe=tiny_moe_cpu", f"logging.run_dir={run}", "logging.trackers=[]", *overrides])


def test_a_restarted_run_resumes_its_own_latest_with_its_own_metrics(tmp_path):
    run = tmp_path / "run"
    stopped_run(run, 12)  # the first run, stopped at step 12
    with_tensorboard = config(run, "trainer.resume=false")
    MetricsFile(run, None).close()  # its TensorBoard event file too (the default tracker)
    assert list((run / "tensorboard").iterdir())
    open_run_dir(with_tensorboard, ["recipe=tiny_moe_cpu", "trainer.resume=false"])  # the same command, starting over
    (aside,) = (run / "previous").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "tensorboard"]
    assert [r["step"] for r in read_metrics(aside)] == list(range(1, 13))
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "previous"]  # nothing of the old run left
    stopped_run(run, 3)  # the second run, stopped at step 3
    resumed = config(run)
    open_run_dir(resumed, ["recipe=tiny_moe_cpu"])
    assert newest_complete(run / "checkpoints") == (step_dir(run / "checkpoints", 3), ())
    assert checkpoint_dir(run / "checkpoints") == step_dir(run / "checkpoints", 3)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert what_a_rerun_does(resumed, ["recipe=tiny_moe_cpu", "trainer.resume=false"]).startswith(
        "`python -m megarl.train recipe=tiny_moe_cpu` resumes after step 3 (")


def test_a_resume_never_crosses_past_latest(tmp_path):
    """A directory an older version left: the abandoned run's iter_* beside the new run's, ``latest`` = 3."""
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12, 2, 3):
        save(root, step)
    path, skipped = newest_complete(root)
    assert path == step_dir(root, 3)
    assert skipped == tuple(f"iter_{s:07d} (past latest, step 3)" for s in (12, 8, 4))
    assert checkpoint_dir(root) == step_dir(root, 3)
    (step_dir(root, 3) / "shard.distcp").write_bytes(b"torn")
    assert newest_complete(root)[0] == step_dir(root, 2)  # the run's own previous one, not step 12
    (root / "latest").write_text("x\n")
    with pytest.raises(CheckpointError, match="latest: expected a step number"):
        newest_complete(root)


def test_checkpoints_are_pruned_to_the_newest_kept(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (20, 2, 4, 6, 8):  # step 20: past latest (another run's), left alone
        save(root, step)
    assert [p.name for p in prune_checkpoints(root, 2)] == ["iter_0000002", "iter_0000004"]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000006", "iter_0000008", "iter_0000020", "latest"]
    save(root, 10)
    assert prune_checkpoints(root, 0) == []  # 0: every one kept
    assert [p.name for p in prune_checkpoints(root, 1)] == ["iter_0000006", "iter_0000008"]
    assert newest_complete(root)[0] == step_dir(root, 10)


def test_a_resume_in_another_mode_or_with_nothing_left_says_so_in_one_line(tmp_path):
    run = tmp_path / "run"
    stopped_run(run, 300, mode="async", save_every=100)
    command = ["recipe=tiny_moe_cpu", "mode=sync", "steps=20"]
    with pytest.raises(ConfigError) as refused:
        open_run_dir(config(run, "mode=sync", "steps=20"), command)
    assert str(refused.value) == (
        f"mode: {run} holds a mode=async run at step 300, which mode=sync does not continue; "
        f"`python -m megarl.train recipe=tiny_moe_cpu mode=sync steps=20 trainer.resume=false` starts over "
        f"(the old run set aside under {run}/previous/), or choose another logging.run_dir")
    with pytest.raises(NothingLeftToTrain) as done:
        open_run_dir(config(run, "mode=async"), ["recipe=tiny_moe_cpu"])
    assert str(done.value).startswith(f"{run} already reached step 300 of steps=300: nothing left to train; "
                                      "steps=N above 300 continues it, `python -m megarl.train")
    assert "\n" not in str(done.value) and not (run / "previous").exists()  # nothing was moved
    open_run_dir(config(run, "mode=async", "steps=400"), ["recipe=tiny_moe_cpu", "steps=400"])  # steps left: resumes
    assert (step_dir(run / "checkpoints", 300)).is_dir()
    open_run_dir(config(run, "mode=sync", "trainer.resume=false"), [])  # starting over in another mode
    assert not (run / "checkpoints").exists() and len(list((run / "previous").iterdir())) == 1


def test_commands_that_resume_and_start_over():
    assert resume_command(["recipe=x", "trainer.resume=false", "steps=3"]) == "python -m megarl.train recipe=x steps=3"
    assert resume_command(["recipe=x", "+trainer.resume=true"]) == "python -m megarl.train recipe=x"
    assert start_over_command(["recipe=x", "a=b c"]) == "python -m megarl.train recipe=x 'a=b c' trainer.resume=false"


def test_setting_aside_keeps_earlier_runs_and_mlflow_store(tmp_path):
    assert set_aside(tmp_path) is None  # an empty directory: nothing to move
    (tmp_path / "mlruns").mkdir()
    assert set_aside(tmp_path) is None
    (tmp_path / "engine-0.log").write_text("old\n")
    first = set_aside(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    second = set_aside(tmp_path)
    assert first != second and (first / "engine-0.log").is_file() and (second / "metrics.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlruns", "previous"]


def test_a_server_log_is_rotated_when_its_server_starts_past_the_bound(tmp_path):
    from megarl.log import rotate_log

    log = tmp_path / "engine-0.log"
    assert not rotate_log(log, max_bytes=10)  # no log yet
    for start in range(4):
        log.write_text(f"start {start}\n" + "x" * 20)
        assert rotate_log(log, max_bytes=10, backups=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-0.log.1", "engine-0.log.2"]
    assert (tmp_path / "engine-0.log.1").read_text().startswith("start 3") and \
        (tmp_path / "engine-0.log.2").read_text().startswith("start 2")
    log.write_text("small\n")
    assert not rotate_log(log, max_bytes=10) and log.read_text() == "small\n"


def test_a_warm_up_whose_checkpoint_exists_is_skipped_with_a_log_line(tmp_path, caplog, monkeypatch):
    import logging

    from megarl import train

    warm = tmp_path / "sft"
    warm.mkdir()
    (warm / "config.json").write_text("{}")
    monkeypatch.setattr(train, "warmup", lambda cfg: pytest.fail("the warm-up ran again"))
    cfg = config(tmp_path / "run", f"warmup.save_hf_path={warm}", "warmup.steps=100")
    with caplog.at_level(logging.INFO, logger="megarl.train"):
        assert train.rl_start(cfg, tmp_path / "base") == str(warm)
    assert [r.getMessage() for r in caplog.records] == [
        f"warm-up skipped: its checkpoint {warm} exists (warmup.steps=100 is not run again; delete it or set "
        "warmup.save_hf_path to warm up anew)"]
    no_warmup = config(tmp_path / "run", "warmup.steps=0")
    assert train.rl_start(no_warmup, tmp_path / "base") == str(tmp_path / "base")
