"""Multi-turn RL end to end: the calculator recipe (megarl/tasks/calculator.py) warmed up on Megatron,
episodes with tool calls generated on a real SGLang server (CPU), trained with Keep Routing and Keep
Sampling Mask on Megatron: the trainer's forward over whole episodes (policy turns and the tool's
tokens) reproduces the engine's per-turn log-probs and replays its routing."""
import json

import pytest

from megarl.metrics.sink import read_metrics
from megarl.train import main

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


def test_calculator_episodes_train_on_whole_trajectories(tmp_path):
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_calculator", "mode=sync", "steps=2", "warmup.steps=40",
                 "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
                 f"model.hf_path={tmp_path / 'base'}", f"warmup.save_hf_path={tmp_path / 'sft'}",
                 f"logging.run_dir={run}"]) == 0
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 1.0 < row["episode/turns_mean"] <= 2.0, row  # tool calls in the batch: some episodes took 2 turns
        assert abs(sum(v for k, v in row.items() if k.startswith("episode/end_")) - 1.0) < 1e-9
        # the trainer reproduces the engine's log-probs on every policy token of every turn (fresh data),
        # with the engine's routing replayed on every token, the tool's included
        assert row["mismatch/logprob_abs_diff"] < 1e-4, row
        assert row["routing/agreement"] == 1.0, row
        assert row["mismatch/tokens_outside_mask"] == 0, row
    config = json.loads(json.dumps(read_metrics(run)[0]))  # the warm-up rows are there too
    assert "warmup/loss" in config


def test_a_two_role_agent_trains_through_the_gateway(tmp_path):
    """``task.agent`` with two roles served by the policy (tests/agent_examples.py): each role's calls are
    samples of their own, grouped per role, counted in the ledger, and reproduced by the trainer."""
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=sync", "steps=1", "warmup.steps=0", "task.agent=agent_examples:"
                 "solver_and_verifier", "task.roles=[solver,verifier]", "rollout.prompts_per_step=4",
                 "rollout.samples_per_prompt=2", f"model.hf_path={tmp_path / 'base'}", f"logging.run_dir={run}"]) == 0
    [row] = [row for row in read_metrics(run) if "reward/mean" in row]
    assert row["reward/mean"] == (1.0 - 0.5) / 2  # the agent's reward per role, one sample per role and episode
    assert row["buffer/trained"] == 4 * 2 * 2, row  # prompts x episodes x roles
    assert row["mismatch/logprob_abs_diff"] < 1e-4 and row["routing/agreement"] == 1.0, row
    trained = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [len(t["prompts"]) for t in trained] == [4]
