"""Synchronous RL end to end: warm-up on Megatron, rollouts on a real SGLang server (CPU), RL steps
with Keep Routing and Keep Sampling Mask on Megatron (a Ray actor), weights synced back to the engine."""
from megarl.metrics.sink import read_metrics
from megarl.train import main


def test_sync_rl_steps_reproduce_the_engine_logprobs(tmp_path):
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=sync", "steps=2", "rollout.prompts_per_step=8",
                 "rollout.samples_per_prompt=4", "warmup.steps=30", f"model.hf_path={tmp_path / 'base'}",
                 f"warmup.save_hf_path={tmp_path / 'warm'}", f"logging.run_dir={run}"]) == 0
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert 1 <= row["response/len_mean"] <= 3
        # first update on fresh data: the trainer reproduces the engine's log-probs (ratio 1 within 1e-3)
        assert row["mismatch/logprob_abs_diff"] < 1e-3, row
        # GRPO has a gradient exactly when some prompt group has mixed rewards
        assert (row["train/grad_norm"] > 0) == (row["groups/mixed_frac"] > 0), row
    assert (run / "engine_weights" / "model.safetensors").is_file()  # the weights the engine loaded last
    assert (run / "curves.png").is_file()
