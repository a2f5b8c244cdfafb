"""Multi-turn RL end to end: the calculator recipe (megarl/tasks/calculator.py) warmed up on Megatron,
episodes with tool calls generated on a real SGLang server (CPU), trained with Keep Routing and Keep
Sampling Mask on Megatron: the trainer's forward over whole episodes (policy turns and the tool's
tokens) reproduces the engine's per-turn log-probs and replays its routing. The same for agent programs
through the OpenAI-compatible gateway: two roles (their episodes in an agent worker), a frozen role, and an
OpenAI Agents SDK agent calling its tool."""
import json

import pytest
import torch

from megarl.metrics.sink import read_metrics
from megarl.train import main

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


def test_calculator_episodes_train_on_whole_trajectories(tmp_path):
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_calculator", "mode=sync", "steps=2", "warmup.steps=40",
                 "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
                 f"model.hf_path={tmp_path / 'base'}", "model.make_tiny_if_missing=true",
                 f"warmup.save_hf_path={tmp_path / 'sft'}",
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


def test_a_two_role_agent_trains_through_the_gateway(tmp_path, tiny_checkpoint):
    """``task.agent`` with two roles served by the policy (tests/agent_examples.py), its episodes run in an
    agent worker (``task.agent_workers``; the worker process costs a few CPU-seconds): each role's calls are
    samples of their own, grouped per role, counted in the ledger, and reproduced by the trainer."""
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=sync", "steps=1", "warmup.steps=0", "task.agent=agent_examples:"
                 "solver_and_verifier", "task.roles=[solver,verifier]", "task.agent_workers=1",
                 "task.agent_worker_cpus=0", "rollout.prompts_per_step=4",
                 "rollout.samples_per_prompt=2", f"model.hf_path={tiny_checkpoint}", f"logging.run_dir={run}"]) == 0
    [row] = [row for row in read_metrics(run) if "reward/mean" in row]
    assert row["reward/mean"] == (1.0 - 0.5) / 2  # the agent's reward per role, one sample per role and episode
    assert row["buffer/trained"] == 4 * 2 * 2, row  # prompts x episodes x roles
    assert row["mismatch/logprob_abs_diff"] < 1e-4 and row["routing/agreement"] == 1.0, row
    trained = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [len(t["prompts"]) for t in trained] == [4]


def test_a_frozen_model_serves_a_role_and_only_the_policys_roles_train(tmp_path, tiny_checkpoint, tokenizer):
    """``task.role_engines`` with ``hf_path``: the verifier is a frozen model on an engine of its own (the
    tiny model edited to write only '7' or end-of-sequence, tests/hf_oracle.py), the solver the policy:
    the verifier answers as that model does (also after the first weight update: never synced), and its
    calls are not trained on."""
    import agent_examples
    import hf_oracle

    (tmp_path / "sevens").mkdir()
    sevens = hf_oracle.eos_or_seven_checkpoint(tiny_checkpoint, tmp_path / "sevens", tokenizer)
    agent_examples.FROZEN_VERDICTS.clear()
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=sync", "steps=2", "warmup.steps=0",
                 "task.agent=agent_examples:solver_and_frozen_verifier", "task.roles=[solver,verifier]",
                 f"task.role_engines=[{{role:verifier,hf_path:'{sevens}'}}]", "rollout.prompts_per_step=4",
                 "rollout.samples_per_prompt=2", f"model.hf_path={tiny_checkpoint}", f"logging.run_dir={run}",
                 "rollout.max_new_tokens=4"]) == 0  # the gateway caps a call's max_tokens (4) at this
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    assert [row["buffer/trained"] for row in rows] == [4 * 2, 2 * 4 * 2]  # the solver's samples alone
    assert all(row["reward/mean"] == 1.0 for row in rows)  # the solver's reward, no verifier sample
    assert all(row["mismatch/logprob_abs_diff"] < 1e-4 and row["routing/agreement"] == 1.0 for row in rows), rows
    # the verifier's answers are the frozen model's greedy ones (HF, same prompt ids), made of sevens
    from transformers import AutoModelForCausalLM

    frozen = AutoModelForCausalLM.from_pretrained(sevens, dtype=torch.float32).eval()
    assert len(agent_examples.FROZEN_VERDICTS) >= 2 * 4 * 2
    for messages, answer in agent_examples.FROZEN_VERDICTS:
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)
        with torch.no_grad():
            out = frozen.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert answer == tokenizer.decode(out[0, len(ids):], skip_special_tokens=True), (messages, answer)
    assert {c for _, answer in agent_examples.FROZEN_VERDICTS for c in answer} == {"7"}
    assert (run / "role-verifier.log").is_file()  # its own engine


def test_an_agents_sdk_agent_calls_its_tool_and_trains(tmp_path):
    """The tool-calling recipe (the tiny model's tool-calling variant, an OpenAI Agents SDK agent with an
    ``add`` tool, the gateway parsing qwen25 calls), warmed up on calls alone: its episodes call the tool
    (parsed by the gateway, answered by the SDK, a second turn extending the first), the rows report the
    share, and the trainer reproduces the engine on whole episodes."""
    run = tmp_path / "run"
    assert main(["recipe=tiny_moe_tool_calling", "mode=sync", "steps=1", "warmup.steps=60",
                 "warmup.tool_fraction=1.0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
                 f"model.hf_path={tmp_path / 'base'}", "model.make_tiny_if_missing=true",
                 f"warmup.save_hf_path={tmp_path / 'sft'}",
                 f"logging.run_dir={run}", "eval.prompts=8"]) == 0
    [row] = [row for row in read_metrics(run) if "reward/mean" in row]
    assert row["agent/tool_call_frac"] >= 0.5, row  # the warm-up's format, parsed by SGLang's qwen25 parser
    # the recipe evaluates after its last step: the agent answers held-out sums through the gateway
    [evaluated] = [row for row in read_metrics(run) if "eval/reward" in row]
    assert (evaluated["step"], evaluated["eval/weight_version"], evaluated["eval/prompts"]) == (1, 1.0, 8.0)
    assert evaluated["eval/errors"] < 8 * 5 and 0 <= evaluated["eval/pass@1"] <= evaluated["eval/pass@4"] <= 1
    # an episode whose first answer was a parsed call took a second turn (the SDK sent the result back), unless
    # the agent raised on the call (an episode ended in error keeps the turns it had); no other took two
    called, errors = row["agent/tool_call_frac"], row.get("episode/end_error_frac", 0.0)
    assert 1.0 + called - errors - 1e-9 <= row["episode/turns_mean"] <= 1.0 + called + 1e-9, row
    assert row["mismatch/logprob_abs_diff"] < 1e-4 and row["routing/agreement"] == 1.0, row
    assert row["mismatch/tokens_outside_mask"] == 0, row
