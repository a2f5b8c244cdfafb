"""megarl.engine_process.ipc: how SGLang's processes pickle tensors to each other.

Each check runs in a fresh interpreter: install() changes pickling for the whole process, and the
megatron-core half needs a process where ``megatron.core`` is not imported yet.
"""
from __future__ import annotations

import sys
import textwrap

import fresh_python
import pytest

pytestmark = pytest.mark.processes


def run_python(code: str) -> str:
    done = fresh_python.run([sys.executable, "-c", textwrap.dedent(code)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.parametrize("installed", [False, True])
def test_tensors_pickled_after_megatron_core_is_imported_name_torchs_loader_only_when_installed(installed):
    out = run_python(f"""
        import pickle, torch
        from megarl.engine_process import ipc
        if {installed}:
            ipc.install()
        import megatron.core
        t = torch.arange(6.0).requires_grad_()  # keeps torch's own reduction either way
        data = pickle.dumps(t, protocol=5)
        back = pickle.loads(data)
        print(torch.storage._load_from_bytes.__module__, b"megatron" in data, torch.equal(back, t))
    """)
    # Without install() this is the failure it prevents: megatron's weights-only loader in every pickle.
    assert out == ("torch.storage False True" if installed else "megatron.core.safe_globals True True")


def test_host_tensors_round_trip_as_bytes_and_others_keep_torchs_reduction():
    out = run_python("""
        import pickle, warnings, torch
        from megarl.engine_process import ipc
        ipc.install()
        ipc.install()  # idempotent
        warnings.simplefilter("error")
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        cases = [torch.randint(0, 8, (5, 2, 2), dtype=torch.int32), base[:, 1::2], base.t(), torch.tensor(2.5),
                 torch.empty(0, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([True, False]),
                 torch.tensor([1 + 2j]).conj(), torch.arange(4, dtype=torch.int64)[2:]]
        for t in cases:
            data = pickle.dumps({"routed_experts": [t]}, protocol=pickle.HIGHEST_PROTOCOL)
            back = pickle.loads(data)["routed_experts"][0]
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t.resolve_conj()), t
            assert pickle.loads(pickle.dumps(t, protocol=2)).equal(t.resolve_conj())  # older protocols too
            back += back  # writable, no warning
            assert ipc.reduce_tensor(t)[0] is ipc.tensor_from_bytes
        grad = torch.ones(3, requires_grad=True)
        assert ipc.reduce_tensor(grad)[0] is not ipc.tensor_from_bytes
        assert pickle.loads(pickle.dumps(grad)).requires_grad
        print("ok")
    """)
    assert out == "ok"


def test_install_after_megatron_core_is_imported_is_refused():
    out = run_python("""
        import megatron.core
        from megarl.engine_process import ipc
        try:
            ipc.install()
        except RuntimeError as e:
            print(e)
    """)
    assert out == "megatron.core is imported already: install() must run before it"
