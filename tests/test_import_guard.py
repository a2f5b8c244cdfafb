"""megarl/engine_process/import_guard.py: a package kept out of a process cannot be imported there, with the
reason in the error; an SGLang server's set-up keeps megatron out, which SGLang's debug dumper takes
for "not installed", although this environment has it."""
import importlib
import importlib.util
import json
import sys

import fresh_python
import pytest

from megarl.engine_process.import_guard import keep_out


@pytest.mark.unit
def test_a_kept_out_package_and_its_submodules_fail_to_import_and_others_do_not(tmp_path, monkeypatch):
    for package in ("guarded_a", "guarded_b"):
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "sub" / "__init__.py").write_text("")
    (tmp_path / "guarded_a_neighbour.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("guarded_b")  # imported before: it stays, its submodules do not come
    finder = keep_out(["guarded_a", "guarded_b"], "the test says so")
    try:
        for name, refused in (("guarded_a", "guarded_a"), ("guarded_a.sub", "guarded_a"),
                              ("guarded_b.sub", "guarded_b.sub")):
            with pytest.raises(ModuleNotFoundError, match=f"^{refused} is kept out of this process: the test says so"):
                importlib.import_module(name)
        assert importlib.import_module("guarded_b").__name__ == "guarded_b"
        importlib.import_module("guarded_a_neighbour")  # a name that only starts alike
    finally:
        sys.meta_path.remove(finder)
    assert importlib.import_module("guarded_a.sub").__name__ == "guarded_a.sub"  # undone
    for name in [m for m in sys.modules if m.startswith("guarded_")]:
        del sys.modules[name]


# A server's set-up (what importing megarl.engine_process.sglang_main does before SGLang's main runs), then the
# module of SGLang's that imports megatron wherever it can
SERVER_SET_UP = """
import json, sys
import megarl.engine_process.sglang_main
from sglang.srt.debug_utils import dumper
print(json.dumps({"dumper_has_megatron": dumper._MegatronPlugin._available,
                  "imported": sorted(m for m in sys.modules if m.partition(".")[0] == "megatron")}))
"""


@pytest.mark.processes
def test_an_sglang_servers_set_up_keeps_megatron_out(tiny_checkpoint):
    assert importlib.util.find_spec("megatron.core") is not None  # installed here: only the guard keeps it out
    done = fresh_python.run([sys.executable, "-c", SERVER_SET_UP, "--model-path", tiny_checkpoint], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"dumper_has_megatron": False, "imported": []}
