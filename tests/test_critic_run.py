"""PPO with a critic end to end through the driver (sync mode, a real SGLang engine on CPU, one trainer rank):
the policy and the critic train every step, every critic metric is in every row, and the critic built from a
given checkpoint (``critic.hf_path``) whose final norm is scaled up starts with values far from the returns
and brings its value loss down step after step. (The loud values share a large offset; an Adam step moves
every head weight by about the learning rate, so the values by about ``critic.lr`` times the summed hidden
state: 1e-4 here closes the offset over four steps, where the recipe's 1e-3 overshoots it.) The same
command with one step more resumes from the run's checkpoint: the critic comes back trained (a fresh one
would start from the loud values again)."""
import shutil

import pytest

from megarl.metrics.sink import read_metrics
from megarl.train import main

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)
CRITIC_METRICS = ("critic/value_loss", "critic/value_clipfrac", "critic/grad_norm", "critic/explained_variance",
                  "critic/value_error", "critic/values_mean")
NORM_SCALE = 30.0


def loud_backbone(src, dst):
    """A copy of the HF checkpoint ``src`` at ``dst`` with its final norm scaled by :data:`NORM_SCALE`: a value
    head on it starts NORM_SCALE times further from 0 than on ``src``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * NORM_SCALE
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_ppo_trains_policy_and_critic_and_resumes(tmp_path, warmed_up):
    run = tmp_path / "run"
    critic_start = loud_backbone(warmed_up.warm, tmp_path / "loud")
    args = ["recipe=tiny_moe_ppo_cpu", "mode=sync", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
            "warmup.steps=30", f"critic.hf_path={critic_start}", "critic.lr=1e-4", f"logging.run_dir={run}",
            *warmed_up.overrides]
    assert main([*args, "steps=4"]) == 0
    assert (run / "checkpoints" / "iter_0000004" / "critic").is_dir()
    assert main([*args, "steps=5"]) == 0  # resumes after step 4
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert all(key in row for key in CRITIC_METRICS), sorted(row)
        assert row["train/grad_norm"] > 0 and row["critic/grad_norm"] > 0
        assert 0.0 <= row["critic/value_clipfrac"] <= 1.0
    losses = [row["critic/value_loss"] for row in rows]
    assert losses[0] > 1.0, losses  # the loud backbone's values are far from returns in [0, 1]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:4])), losses
    assert losses[4] < losses[0] / 4, losses  # the resumed critic is the trained one
