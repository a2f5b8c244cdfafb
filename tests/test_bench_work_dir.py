"""tools/bench/work_dir.py: a bench's temporary work directory goes when its process exits; a named one stays."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
sys.path.append("tools/bench")  # last: bench/agents.py is no SDK
from work_dir import work_directory
work = work_directory(sys.argv[1] or None, "megarl-bench-")
(work / "warm").mkdir(parents=True)
print(work)
raise SystemExit(int(sys.argv[2]))
"""


def _run(tmp_path, given: str, code: int) -> tuple[int, Path]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, given, str(code)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path / "system")}, timeout=60)
    return done.returncode, Path(done.stdout.strip())


def test_a_temporary_work_dir_is_removed_at_exit_even_after_a_failure(tmp_path):
    (tmp_path / "system").mkdir()
    for code in (0, 1):
        rc, work = _run(tmp_path, "", code)
        assert rc == code and work.parent == tmp_path / "system"
        assert not work.exists()
    assert list((tmp_path / "system").iterdir()) == []


def test_a_named_work_dir_is_kept(tmp_path):
    (tmp_path / "system").mkdir()
    rc, work = _run(tmp_path, str(tmp_path / "mine"), 1)
    assert rc == 1 and work == tmp_path / "mine" and (work / "warm").is_dir()
