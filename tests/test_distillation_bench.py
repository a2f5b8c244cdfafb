"""tools/bench/distillation.py checks every run's config before it trains anything."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/bench/distillation.py", "--json", str(tmp_path / "out.json"),
                           "--work-dir", str(tmp_path / "work"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.processes
def test_a_recipe_without_a_distillation_weight_fails_before_the_warm_up(tmp_path):
    # tiny_moe_calculator has opd_coef 0: its opd run (the recipe plus a teacher) is not a valid config
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text("{}")  # the bench checks no more than that it is one
    done = _bench(tmp_path, "--recipe", "tiny_moe_calculator", "--eval-every", "0",
                  "--teacher", str(tmp_path / "teacher"))
    assert done.returncode != 0
    assert "the opd run's config: algorithm.opd_coef" in done.stderr
    assert not (tmp_path / "work").exists()  # nothing was trained
    assert not (tmp_path / "out.json").exists()


@pytest.mark.processes
def test_the_first_bad_run_is_named_after_the_good_ones_loaded(tmp_path):
    # the default recipe's warm-up, opd and grpo runs load; the combined run's negative weight does not
    done = _bench(tmp_path, "--variants", "opd,grpo,grpo_opd", "--combined-coef", "-1", "--seeds", "0,1")
    assert done.returncode != 0
    assert "the grpo_opd (seed 0) run's config: algorithm.opd_coef: must be >= 0, got -1.0" in done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.processes
def test_the_answer_probability_is_refused_for_a_multi_turn_task(tmp_path):
    done = _bench(tmp_path, "--recipe", "tiny_moe_calculator", "--teacher", str(tmp_path))
    assert done.returncode != 0
    assert "--eval-every" in done.stderr and "env calculator" in done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.processes
def test_a_teacher_is_made_only_for_the_recipe_whose_teacher_is_the_demo(tmp_path):
    done = _bench(tmp_path, "--recipe", "tiny_moe_opd_two_digit_cpu")
    assert done.returncode != 0
    assert "--teacher: a teacher is made here for tiny_moe_opd_cpu only" in done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.processes
def test_a_teacher_that_is_not_a_checkpoint_is_refused_at_once(tmp_path):
    done = _bench(tmp_path, "--teacher", str(tmp_path / "missing"))
    assert done.returncode != 0
    assert f"--teacher: {tmp_path / 'missing'} is not an HF checkpoint directory" in done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.processes
def test_an_override_for_one_variant_reaches_that_variants_runs_only(tmp_path):
    done = _bench(tmp_path, "--variants", "grpo,opd", "--variant-set", "opd:algorithm.opd_coef=-1", "--seeds", "0")
    assert done.returncode != 0  # grpo's run, checked first, is untouched; opd's gets the bad weight
    assert "the opd (seed 0) run's config: algorithm.opd_coef: must be >= 0, got -1.0" in done.stderr
    done = _bench(tmp_path, "--variants", "grpo,opd", "--set", "algorithm.opd_baseline=none",
                  "--variant-set", "opd:algorithm.opd_baseline=median")
    assert done.returncode != 0  # the variant's override comes after --set's
    assert "the opd run's config: algorithm.opd_baseline" in done.stderr and "median" in done.stderr
    done = _bench(tmp_path, "--variant-set", "grpo_opd:algorithm.opd_coef=1")
    assert done.returncode != 0
    assert "--variant-set: 'grpo_opd:algorithm.opd_coef=1' must be VARIANT:KEY=VALUE with VARIANT one of opd,grpo" \
        in done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.unit
def test_a_teacher_made_here_is_the_demo_from_its_own_warm_up(tmp_path):
    # The recipe's student is a shorter warm-up than the demo's; the teacher made here must be the demo's
    # RL run (its recipe, its 60-step warm-up in a directory of its own), not RL from the student's warm-up.
    sys.path.append(str(REPO / "tools" / "bench"))  # last: bench/agents.py is no SDK
    import distillation

    from megarl.config import load_config

    teacher = load_config(distillation.teacher_overrides(300, tmp_path))
    demo, student = load_config(["recipe=tiny_moe_cpu"]), load_config(["recipe=tiny_moe_opd_cpu"])
    assert teacher.warmup.steps == demo.warmup.steps > student.warmup.steps
    assert teacher.warmup.save_hf_path == str(tmp_path / "teacher_warm")
    assert (teacher.algorithm.advantage, teacher.teacher.hf_path) == (demo.algorithm.advantage, None)
    assert teacher.steps == 300
    assert teacher.model.hf_path == str(tmp_path / "base")  # the base the student's warm-up starts from
