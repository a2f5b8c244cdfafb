"""The LoRA recipe's async driver killed, resumed and stopped by Ctrl-C (tests/resume_runs.py):
adapters alone in its checkpoints and in its syncs."""
import signal

import pytest
from resume_runs import check_kill_and_resume

pytestmark = pytest.mark.usefixtures("ray_local")  # the drivers join the test process's Ray (conftest)


def test_killed_and_interrupted_lora_runs_resume_without_training_a_prompt_twice(tmp_path, warmed_up):
    check_kill_and_resume("tiny_moe_lora_cpu", tmp_path, warmed_up, signal.SIGINT)
