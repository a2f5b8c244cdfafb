"""tests/fresh_python.py: a run forked from the preloaded server answers what ``subprocess.run`` does for
the same command, environment and directory, and imports nothing of megarl before the run does."""
import os
import subprocess
import sys

import fresh_python
import pytest

SCRIPT = "import os, sys\nprint(sys.argv, os.getcwd(), os.environ.get('FRESH_VALUE'), sys.path[0] == {where!r})\n"
COMMANDS = {
    "code_and_arguments": ["-c", SCRIPT.format(where="") + "raise ValueError('boom')", "a", "b"],
    "exit_with_a_message": ["-c", "import sys\nsys.exit('bye')"],
    "exit_code": ["-c", "import sys\nprint('out', flush=True)\nprint('err', file=sys.stderr)\nsys.exit(3)"],
    "module": ["-m", "json.tool", "--help"],
    "exit_handlers_run": ["-c", "import atexit\natexit.register(print, 'at exit')\nprint('main')"],
}


def both(argv, tmp_path, **env):
    command = [sys.executable, *argv]
    environment = dict(os.environ, **env)
    expected = subprocess.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    return expected, fresh_python.run(command, env=environment, cwd=tmp_path, timeout=60)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_run_answers_as_a_new_interpreter_does(name, tmp_path):
    expected, got = both(COMMANDS[name], tmp_path, FRESH_VALUE="x")
    assert (got.returncode, got.stdout) == (expected.returncode, expected.stdout)
    assert got.stderr.splitlines()[-1:] == expected.stderr.splitlines()[-1:]


@pytest.mark.processes
def test_a_script_sees_its_directory_first_on_the_path(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(where=str(tmp_path)))
    expected, got = both([str(script), "arg"], tmp_path, FRESH_VALUE="y")
    assert (got.returncode, got.stdout, got.stderr) == (expected.returncode, expected.stdout, expected.stderr) == (
        0, f"[{str(script)!r}, 'arg'] {tmp_path} y True\n", "")


@pytest.mark.processes
def test_only_the_preloaded_libraries_are_imported_before_the_run():
    code = ("import sys\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megarl', 'megatron', 'sglang'}))")
    assert fresh_python.run([sys.executable, "-c", code], timeout=60).stdout == "['torch']\n"


@pytest.mark.processes
def test_a_run_past_its_timeout_is_killed_with_what_it_wrote():
    with pytest.raises(subprocess.TimeoutExpired) as killed:
        fresh_python.run([sys.executable, "-c", "import time\nprint('started', flush=True)\ntime.sleep(60)"],
                         timeout=3)
    assert killed.value.output == "started\n"


@pytest.mark.unit
def test_another_interpreter_is_refused():
    with pytest.raises(ValueError, match="not a run of this interpreter"):
        fresh_python.run(["/bin/echo", "hi"])
