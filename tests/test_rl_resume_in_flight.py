"""In-flight rollouts survive a restart (megarl/pipeline/carried.py): the async driver killed (SIGKILL)
in the middle of long generations, once a checkpoint carries partial groups, and run again.

The run generates 48 tokens a sample from the untrained tiny MoE (it seldom ends a response early),
checkpointing every two steps. The rerun resumes from the newest complete checkpoint; every group it
carried is trained (staleness bound 3: none is too old): a buffered one with the samples it held, a
partial one continued from its samples, each trained sample starting with the tokens (and their
log-probs and versions) recorded before the kill. No prompt is trained twice in the run's lineage, and
the ledger, which carried the groups as buffered and in flight, accounts for every sample.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
from resume_runs import rl_steps

from megarl.metrics.sink import read_metrics
from megarl.pipeline.carried import CarriedRollouts
from megarl.train import main

pytestmark = pytest.mark.usefixtures("ray_local")  # the drivers join the test process's Ray (conftest)
STEPS = 12  # the kill comes at the first checkpoint carrying a partial group (step 2 or 4, seldom later)
PROMPTS, SAMPLES = 4, 4


def arguments(tmp_path: Path) -> list[str]:
    return ["recipe=tiny_moe_cpu", f"steps={STEPS}", "trainer.save_interval=2", f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.samples_per_prompt={SAMPLES}", "rollout.max_new_tokens=48", "buffer.max_staleness=3",
            "warmup.steps=0", f"model.hf_path={tmp_path / 'base'}", "model.make_tiny_if_missing=true",
            f"logging.run_dir={tmp_path / 'run'}"]


def carried_at(checkpoint: Path) -> CarriedRollouts | None:
    """The rollouts a complete checkpoint carries (None while it is not complete)."""
    from megatron.core import dist_checkpointing  # imported before the driver starts: a loaded machine takes
    # longer to import it than the driver takes for its steps

    if not (checkpoint / "complete.json").is_file():
        return None
    position = dist_checkpointing.load_common_state_dict(str(checkpoint))["megarl"]["data_position"]
    return CarriedRollouts.from_plain(position["carried"])[0]


def latest(run: Path) -> Path | None:
    from megarl.trainer.checkpoint import step_dir

    marker = run / "checkpoints" / "latest"
    return step_dir(run / "checkpoints", int(marker.read_text())) if marker.is_file() else None


def kill_once_partial_groups_are_carried(tmp_path: Path) -> None:
    """Run the driver; SIGKILL it as soon as a complete checkpoint carries a partial group."""
    import megatron.core.dist_checkpointing  # noqa: F401 (carried_at's import, paid before the driver runs)

    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    with open(tmp_path / "driver.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megarl.train", *arguments(tmp_path)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        read = set()  # the complete checkpoints read (each once)
        while proc.poll() is None and time.monotonic() < deadline:
            checkpoint = latest(tmp_path / "run")
            carried = carried_at(checkpoint) if checkpoint is not None and checkpoint not in read else None
            if carried is not None:
                read.add(checkpoint)
                if carried.partial:
                    break
            time.sleep(0.05)
        assert proc.poll() is None, (f"driver ended before a checkpoint carried a partial group (rc {proc.returncode})"
                                     f":\n{(tmp_path / 'driver.log').read_text()[-4000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    deadline = time.monotonic() + 30  # the killed driver's SGLang server ends itself
    while time.monotonic() < deadline and any(
            "megarl.engine_process.sglang_main" in (p.info["cmdline"] or [])
            and str(tmp_path / "base") in p.info["cmdline"]
            for p in psutil.process_iter(["cmdline"])):
        time.sleep(0.5)


def test_a_killed_run_continues_the_groups_its_checkpoint_carried(tmp_path, warmed_up, monkeypatch):
    from megarl.pipeline.run import Pipeline

    shutil.copytree(warmed_up.base, tmp_path / "base")
    run = tmp_path / "run"
    kill_once_partial_groups_are_carried(tmp_path)
    resumed_from = latest(run)  # the rank may have completed a newer checkpoint after its driver died
    carried = carried_at(resumed_from)
    assert carried is not None and carried.partial, f"{resumed_from} carries no partial group"

    trained: dict[str, list] = {}  # group id -> its trained samples, from the rerun's steps
    original = Pipeline.rl_batch

    def spy(self, samples, step):
        for s in samples:
            trained.setdefault(s.group_id, []).append(s)
        return original(self, samples, step)

    monkeypatch.setattr(Pipeline, "rl_batch", spy)
    assert main(arguments(tmp_path)) == 0

    for group in carried.buffered:  # trained as it was
        got = trained[str(group.index)]
        assert [s.response_ids for s in got] == [s.response_ids for s in group.samples]
    recorded = 0
    for entry in carried.partial:  # each sample continued from the tokens it had
        got = trained[str(entry.index)]
        assert len(got) == len(entry.group.samples)
        for before, after in zip(entry.group.samples, got):
            n = len(before.response_ids)
            assert after.response_ids[:n] == before.response_ids and after.prompt_ids == before.prompt_ids
            np.testing.assert_array_equal(after.model_version[:n], before.model_version)
            np.testing.assert_array_equal(after.rollout_logprobs[:n], before.rollout_logprobs)
            recorded += n
    assert recorded > 0, "the carried partial groups held no token"
    start = int(resumed_from.name.split("_")[-1])
    log = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, STEPS + 1)) and rl_steps(run) == list(range(1, STEPS + 1))
    lineage = [i for row in log for i in row["prompts"]]
    assert len(set(lineage)) == len(lineage) == PROMPTS * STEPS  # no prompt trained twice
    assert carried.indices <= set(lineage) - {i for row in log[:start] for i in row["prompts"]}
    last = [row for row in read_metrics(run) if "reward/mean" in row][-1]
    assert last["buffer/prompts_trained"] == PROMPTS * STEPS
    ended = sum(last[f"buffer/{o}"] for o in ("trained", "dropped_stale", "dropped_filter", "aborted_resubmitted",
                                               "error"))
    assert last["buffer/samples_started"] == ended + last["buffer/samples_in_flight"] + last["buffer/samples_buffered"]
    print(f"\n[measured] resumed from step {start}: {len(carried.buffered)} buffered and {len(carried.partial)} "
          f"partial groups carried, {recorded} recorded tokens continued")
