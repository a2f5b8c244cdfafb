"""Synchronous RL end to end through the pipeline driver: warm-up on Megatron, rollouts on a real
SGLang server (CPU), RL steps with Keep Routing and Keep Sampling Mask on Megatron (a Ray actor),
weights synced back into the engine after every step."""
import pytest
from ray_held import held_resources
from startup_order import record_startup

from megarl.metrics.sink import read_metrics
from megarl.train import main

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


@pytest.fixture(scope="module")
def warm(warmed_up):
    """The warmed-up checkpoint the run starts from (base and warm paths, tests/conftest.py). (Without the
    sampling mask the mismatch grows beyond 1e-3: measured 1.06 end to end; asserted in tests/test_layouts.py.)"""
    return warmed_up.overrides


def rl_rows(run):
    return [row for row in read_metrics(run) if "reward/mean" in row]


def sync_run(tmp_path, warm, *overrides):
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=sync", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
                 "warmup.steps=30", f"logging.run_dir={run}", *warm, *overrides]) == 0
    return run


def test_sync_rl_steps_reproduce_the_engine_logprobs(tmp_path, warm, monkeypatch):
    """Also with a KL term to the reference (the starting checkpoint) and full activation recompute:
    the KL is 0 at the first step (the policy is the reference) and positive once it has moved. The
    (disaggregated) engine loads while the trainer rank builds."""
    import ray

    startup = record_startup(monkeypatch)
    run = sync_run(tmp_path, warm, "steps=2", "algorithm.kl_coef=0.05", "trainer.recompute=full")
    assert len(startup["launch"]) == 1 and startup["launch"][0] < startup["built"][0], startup
    # the run used this process's Ray and left it connected, every CPU free again (ranks, engines gone)
    assert ray.is_initialized()
    assert held_resources(timeout_s=10) == {}
    rows = rl_rows(run)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert 1 <= row["response/len_mean"] <= 3
        # every update is on fresh data: the trainer reproduces the engine's log-probs, so the PPO
        # ratio is 1 within 1e-3 on every token
        assert row["mismatch/logprob_abs_diff"] < 1e-3, row
        assert row["mismatch/ratio_dev_max"] < 1e-3, row
        assert row["staleness/max"] == 0 and row["sync/version"] == row["step"]
        # GRPO has a gradient exactly when some prompt group has mixed rewards; from step 2 on the KL term
        # adds one whenever the policy has left the reference (a step without mixed groups still moves)
        if row["step"] == 1 or row["groups/mixed_frac"] > 0:
            assert (row["train/grad_norm"] > 0) == (row["groups/mixed_frac"] > 0), row
    assert rows[0]["train/kl"] == pytest.approx(0.0, abs=1e-9)
    assert rows[0]["train/grad_norm"] == 0 or rows[1]["train/kl"] > 1e-7, rows
    last = rows[-1]
    assert last["buffer/prompts_trained"] == 16 and last["buffer/trained"] + last["buffer/error"] == 64
    assert (run / "checkpoints" / "latest").read_text().strip() == "2"
    assert (run / "curves.png").is_file()


def test_updates_per_step_split_the_batch_into_mini_batches(tmp_path, warm):
    """``trainer.updates_per_step=2``: every RL step is two optimizer steps (the LR schedule's count
    in the checkpoint), on the batch's two halves."""
    from megatron.core import dist_checkpointing

    run = sync_run(tmp_path, warm, "steps=2", "trainer.updates_per_step=2")
    rows = rl_rows(run)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["staleness/max"] == 0 and row["sync/version"] == row["step"] for row in rows)
    common = dist_checkpointing.load_common_state_dict(str(run / "checkpoints" / "iter_0000002"))
    assert common["scheduler"]["num_steps"] == 4


def test_split_evenly_and_combine_updates():
    from megarl.pipeline.bookkeeping import combine_updates
    from megarl.pipeline.run import split_evenly
    from megarl.trainer.rl_step import RLStepResult

    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly(list(range(4)), 4) == [[0], [1], [2], [3]]
    first = RLStepResult(grad_norm=1.0, applied=True, metrics={"loss": 2.0, "mismatch/tokens_outside_mask": 10.0,
                                                                "mismatch/ratio_dev_max": 0.5})
    second = RLStepResult(grad_norm=3.0, applied=False, metrics={"loss": 4.0, "mismatch/tokens_outside_mask": 6.0,
                                                                 "mismatch/ratio_dev_max": 0.2, "kl": 0.1})
    both = combine_updates([first, second])
    assert both.grad_norm == 2.0 and not both.applied
    assert both.metrics == {"loss": 3.0, "mismatch/tokens_outside_mask": 16.0, "mismatch/ratio_dev_max": 0.5,
                            "kl": 0.1}
    assert combine_updates([first]) is first
