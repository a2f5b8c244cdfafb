"""The demo's async driver killed and resumed, and stopped during start-up (tests/resume_runs.py)."""
import signal

import pytest
from resume_runs import check_kill_and_resume, check_stop_during_start_up

pytestmark = pytest.mark.usefixtures("ray_local")  # the drivers join the test process's Ray (conftest)


def test_killed_and_terminated_runs_resume_without_training_a_prompt_twice(tmp_path, warmed_up):
    check_kill_and_resume("tiny_moe_cpu", tmp_path, warmed_up, signal.SIGTERM)


def test_a_stop_request_during_start_up_ends_the_run_at_once(tmp_path, warmed_up):
    check_stop_during_start_up("tiny_moe_cpu", tmp_path, warmed_up)
