"""Inputs that used to fail a minute into a run (after the warm-up, with Ray up) now fail at load:
``python -m megarl.train`` exits 2 within seconds with one line naming the key, before any Ray
session, engine or trainer starts. The bad inputs go through the driver in-process (its ``main``, one load
per case, as tests/test_config_keys.py does); the reruns of a finished run through the command itself."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.train import main

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
LOAD_LIMIT_S = 10.0


def arguments(overrides: tuple[str, ...], tmp_path: Path) -> list[str]:
    """The tiny recipe with ``overrides``. Paths a run would write point into ``tmp_path`` unless overridden, so
    a check that failed to fire cannot touch the checkout."""
    sandbox = [f"model.hf_path={tmp_path / 'base'}", f"warmup.save_hf_path={tmp_path / 'sft'}",
               f"logging.run_dir={tmp_path / 'run'}"]
    given = {o.split("=", 1)[0] for o in overrides}
    return ["recipe=tiny_moe_cpu", *(s for s in sandbox if s.split("=", 1)[0] not in given), *overrides]


def train(*overrides: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m megarl.train`` on :func:`arguments`; the timeout bounds a run whose check failed to fire."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "megarl.train", *arguments(overrides, tmp_path)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    return result, time.monotonic() - t0


def load(*overrides: str, tmp_path: Path, capsys) -> tuple[subprocess.CompletedProcess, float]:
    """The driver's ``main`` in this process on :func:`arguments`: its return code and what it printed."""
    capsys.readouterr()
    t0 = time.monotonic()
    code = main(arguments(overrides, tmp_path))
    elapsed, printed = time.monotonic() - t0, capsys.readouterr()
    return subprocess.CompletedProcess("megarl.train", code, printed.out, printed.err), elapsed


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
def test_bad_input_fails_at_load_in_seconds(case, prompts_jsonl, tmp_path, capsys):
    overrides, key, expected = CASES[case]
    result, elapsed = load(*(o.format(dataset=prompts_jsonl) for o in overrides), tmp_path=tmp_path, capsys=capsys)
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


@pytest.fixture
def bad_inputs(tmp_path) -> dict:
    """A checkpoint whose config.json is not JSON, a dataset with a malformed third line, a file in the way."""
    checkpoint = tmp_path / "broken"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "qwen3_moe",\n  "hidden_size": 64,,\n}\n')
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", answer: "4"}\n')
    (tmp_path / "a_file").write_text("")
    return {"checkpoint": checkpoint, "rows": rows, "tmp": tmp_path}


BAD_FILES = {
    "mistyped_model_path": (["model.hf_path={tmp}/no/such/model"], "model.hf_path",
                            ["no/such/model is not an HF checkpoint directory (no config.json)"]),
    "config_json_not_json": (["model.hf_path={checkpoint}"], "model.hf_path",
                             ["broken/config.json is not valid JSON (line 2 column 21: Expecting property name"]),
    "malformed_dataset_line": (["task.name=jsonl", "task.path={rows}", "warmup.steps=0", "reward.type=exact_match"],
                               "task.path", ["rows.jsonl line 3 is not valid JSON (Expecting property name",
                                             "at column 20): '{\"prompt\": \"2+2=\", answer: \"4\"}'"]),
    "run_dir_cannot_be_made": (["logging.run_dir={tmp}/a_file/run", "model.make_tiny_if_missing=true"],
                               "logging.run_dir", ["cannot create", "a_file/run (Not a directory)"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_or_path_fails_at_start_naming_it(case, bad_inputs, tmp_path, capsys):
    """Exit 2 in seconds, one line naming the key and the file (and a dataset's line), no traceback; nothing is
    made at a mistyped model path (the recipe builds its tiny model at its own path only)."""
    overrides, key, expected = BAD_FILES[case]
    result, elapsed = load(*(o.format(**bad_inputs) for o in overrides), tmp_path=tmp_path, capsys=capsys)
    assert result.returncode == 2, result.stderr[-2000:]
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"megarl: config error: {key}: "), err
    for text in expected:
        assert text in err, err
    assert elapsed < LOAD_LIMIT_S, f"{elapsed:.1f} s"
    assert not (tmp_path / "no").exists() and not (tmp_path / "base").exists() and not (tmp_path / "run").exists()


def test_a_rerun_of_a_finished_run_or_in_another_mode_says_so_in_one_line(tmp_path):
    """After the demo's async run (its run directory as it leaves it: latest = 300, config.yaml's mode): the
    same command exits 0 saying nothing is left, ``mode=sync`` exits 2 saying the directory holds an async run;
    neither starts anything nor moves the run."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("300\n")
    (tmp_path / "run" / "config.yaml").write_text("mode: async\n")
    make = "model.make_tiny_if_missing=true"
    done, elapsed = train(make, tmp_path=tmp_path)
    assert done.returncode == 0 and elapsed < LOAD_LIMIT_S, (done.stderr[-2000:], elapsed)
    assert done.stderr.strip() == (
        f"megarl: {tmp_path / 'run'} already reached step 300 of steps=300: nothing left to train; steps=N above 300 "
        f"continues it, `python -m megarl.train recipe=tiny_moe_cpu model.hf_path={tmp_path / 'base'} "
        f"warmup.save_hf_path={tmp_path / 'sft'} logging.run_dir={tmp_path / 'run'} {make} trainer.resume=false` "
        f"starts over (the old run set aside under {tmp_path / 'run'}/previous/)")
    other, elapsed = train(make, "mode=sync", tmp_path=tmp_path)
    assert other.returncode == 2 and elapsed < LOAD_LIMIT_S, (other.stderr[-2000:], elapsed)
    err = other.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        f"megarl: config error: mode: {tmp_path / 'run'} holds a mode=async run at step 300, which mode=sync does not "
        "continue; `python -m megarl.train recipe=tiny_moe_cpu "), err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "config.yaml"]
    assert not (tmp_path / "base").exists()
