"""The demo's async driver killed and resumed (tests/resume_runs.py)."""
import signal

import pytest
from resume_runs import check_kill_and_resume

pytestmark = pytest.mark.usefixtures("ray_local")  # the drivers join the test process's Ray (conftest)


def test_killed_and_terminated_runs_resume_without_training_a_prompt_twice(tmp_path, warmed_up):
    check_kill_and_resume("tiny_moe_cpu", tmp_path, warmed_up, signal.SIGTERM)
