"""The demo's async driver killed and resumed (tests/resume_runs.py)."""
from resume_runs import check_kill_and_resume


def test_killed_and_terminated_runs_resume_without_training_a_prompt_twice(tmp_path, warmed_up):
    check_kill_and_resume("tiny_moe_cpu", tmp_path, warmed_up)
