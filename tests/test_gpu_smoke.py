"""tools/gpu_smoke.sh: sized for the GPU machine a session may be lent (one GPU, 10 minutes, at most
64 MiB carried), ordered by risk; and what it does on a machine without one."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["bash", str(ROOT / "tools" / "gpu_smoke.sh")]
ENV_PYTHON = {"PYTHON": sys.executable}


@pytest.mark.network
def test_the_plan_fits_the_lent_machine(tmp_path):
    """--plan fetches what a torch-only machine lacks (wheels from PyPI, the tiny checkpoint) and reports it."""
    import os

    out = subprocess.run([*SMOKE, "--plan", "--carry", str(tmp_path / "carry")], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, **ENV_PYTHON))
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "carry").rglob("*") if p.is_file())
    assert plan["carry_bytes"] == on_disk and 0 < on_disk <= 64 * 2**20
    assert plan["planned_seconds"] == sum(s["planned_seconds"] for s in plan["steps"]) <= 600
    names = [s["name"] for s in plan["steps"]]
    assert names[:3] == ["env", "sft", "rl_replay"]  # device placement and NCCL in SFT and RL first
    wheels = {p.removeprefix("wheels/").split("-")[0].replace("_", "-").lower() for p in plan["carried"]
              if p.startswith("wheels/")}
    assert wheels == {p.split("==")[0].replace("_", "-").lower() for p in plan["packages"]}
    assert "tiny_moe/config.json" in plan["carried"]


@pytest.mark.processes
def test_without_a_gpu_every_step_is_skipped_saying_why(tmp_path):
    import os

    out = subprocess.run([*SMOKE, "--carry", str(tmp_path), "--out", str(tmp_path / "report.json")],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, **ENV_PYTHON))
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report == json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and {s["status"] for s in report["steps"]} == {"skipped"}
    assert {s["reason"] for s in report["steps"]} == {"no CUDA device"}
