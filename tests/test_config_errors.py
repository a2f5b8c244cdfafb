"""Inputs that used to fail a minute into a run (after the warm-up, with Ray up) now fail at load:
``python -m megarl.train`` exits 2 within seconds with one line naming the key, before any Ray
session, engine or trainer starts."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
LOAD_LIMIT_S = 10.0


def train(*overrides: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run the driver on the tiny recipe. Paths it would write point into ``tmp_path``, so a check
    that failed to fire cannot touch the checkout; the timeout bounds such a run."""
    sandbox = [f"model.hf_path={tmp_path / 'base'}", f"warmup.save_hf_path={tmp_path / 'sft'}",
               f"logging.run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", *sandbox, *overrides],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    return result, time.monotonic() - t0


@pytest.fixture
def prompts_jsonl(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    return path


CASES = {
    "misspelt_policy_loss": (["algorithm.policy_loss=ppoo"], "algorithm.policy_loss",
                             ["'ppoo' is not one of ppo, gspo, cispo"]),
    "misspelt_kl_type": (["algorithm.kl_type=low_var"], "algorithm.kl_type",
                         ["'low_var' is not one of k1, k2, k3, low_var_kl, k1_is, k2_is, k3_is"]),
    "missing_dataset": (["task.name=jsonl", "task.path=/nope.jsonl", "warmup.steps=0", "reward.type=math"], "task.path",
                        ["/nope.jsonl does not exist"]),
    "dataset_without_prompt_field": (["task.name=jsonl", "task.path={dataset}", "task.prompt_key=question",
                                      "warmup.steps=0", "reward.type=exact_match"],
                                     "task.prompt_key", ["'question' is not a field of", "rows have prompt, answer"]),
    "reward_function_does_not_import": (["reward.type=function", "reward.path=nope.mod.fn"], "reward.path",
                                        ["'nope.mod.fn' does not import", "No module named 'nope'"]),
    "unknown_environment": (["task.env=calculatr"], "task.env", ["'calculatr' is not one of calculator"]),
    "agent_does_not_import": (["task.agent=nope_agents:solve"], "task.agent",
                              ["cannot import 'nope_agents'", "No module named 'nope_agents'"]),
    "unknown_tool_call_parser": (["rollout.tool_call_parser=qwen3"], "rollout.tool_call_parser",
                                 ["SGLang has no tool-call parser 'qwen3'", "qwen25"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_at_load_in_seconds(case, prompts_jsonl, tmp_path):
    overrides, key, expected = CASES[case]
    result, elapsed = train(*(o.format(dataset=prompts_jsonl) for o in overrides), tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"megarl: config error: {key}: "), err
    for text in expected:
        assert text in err, err
    assert elapsed < LOAD_LIMIT_S, f"{elapsed:.1f} s"
    output = result.stdout + result.stderr
    assert not re.search(r"\bray\b", output, re.IGNORECASE), output  # no Ray session was started
    assert not (tmp_path / "run").exists() and not (tmp_path / "base").exists()  # nothing was started
