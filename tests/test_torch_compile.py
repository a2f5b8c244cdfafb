"""The CPU speed-ups around ``torch.compile``: ``torch_compile_imports_inductor``
(megarl/platform/torch_compile.py), a function given to ``torch.compile`` is compiled at its first call,
with its options, to the same result, and SGLang's import then leaves TorchInductor out (megatron's side:
tests/test_platform_cpu.py, the same training step, bit for bit, without TorchInductor); and
``tp_embedding_compiles_at_first_request``, a TP engine's vocabulary mask run as written."""
import os
import sys

import fresh_python
import pytest

from megarl.platform import sglang_cpu

pytestmark = pytest.mark.processes

FIRST_CALL = """
import sys
import torch
from megarl.platform.torch_compile import compile_at_first_call
compile_at_first_call()
from torch._dynamo.utils import counters

def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))

def double(x):
    return 2 * x + 1

compiled = torch.compile(gelu, backend="eager", fullgraph=True)
decorated = torch.compile(backend="eager")(double)
module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
assert counters["stats"]["unique_graphs"] == 0, "compiled before the first call"
assert "torch._inductor.compile_fx" not in sys.modules
x = torch.randn(5)
assert torch.equal(compiled(x), gelu(x)) and counters["stats"]["unique_graphs"] == 1
assert torch.equal(decorated(x), double(x)) and counters["stats"]["unique_graphs"] == 2
assert compiled.__name__ == "gelu" and type(module).__name__ == "OptimizedModule"
print("OK")
"""


def test_a_function_is_compiled_at_its_first_call_to_the_same_result():
    result = fresh_python.run([sys.executable, "-c", FIRST_CALL], timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]


def test_sglang_imports_without_inductor_only_with_the_speed_up():
    code = ("from megarl.platform import sglang_cpu\nsglang_cpu.apply()\n"
            "import sys, sglang.srt.mem_cache.memory_pool, sglang.srt.models.qwen3_moe\n"
            "print('torch._inductor.compile_fx' in sys.modules)\n")
    imported = {}
    for off in ("", "torch_compile_imports_inductor"):
        env = {**os.environ, sglang_cpu.OFF_ENV: off}
        result = fresh_python.run([sys.executable, "-c", code], env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        imported[off] = result.stdout.split()[-1]
    assert imported == {"": "False", "torch_compile_imports_inductor": "True"}


# SGLang's masked lookup of a TP rank's vocabulary shard, called on ids on both sides of the shard and
# in the added-vocabulary range; the reference is the rule written out id by id
VOCAB_MASK = """
import inspect, json, sys
import torch
from megarl.platform import sglang_cpu
sglang_cpu.apply()
from sglang.srt.layers import vocab_parallel_embedding as vpe
mask = vpe.get_masked_input_and_mask
if sys.argv[1] == "compiled":
    print(json.dumps({"compiled": inspect.unwrap(mask) is not mask}))
    raise SystemExit
org, added, padding = (10, 20), (40, 44), 3
ids = list(range(0, 50))
masked, outside = mask(torch.tensor(ids), *org, padding, *added)
expected = [i - org[0] if org[0] <= i < org[1] else i - added[0] + org[1] - org[0] + padding
            if added[0] <= i < added[1] else 0 for i in ids]
print(json.dumps({"compiled": inspect.unwrap(mask) is not mask, "equal": masked.tolist() == expected,
                  "outside": outside.tolist() == [not (org[0] <= i < org[1] or added[0] <= i < added[1]) for i in ids],
                  "inductor": "torch._inductor.compile_fx" in sys.modules}))
"""


def test_a_tp_engines_vocabulary_mask_runs_as_written_only_with_the_speed_up():
    """``tp_embedding_compiles_at_first_request``: SGLang's vocabulary-shard mask is its own function, not
    a compiled one, and its first call gives the ids and mask the rule gives without TorchInductor; with
    the work-around off it is the ``torch.compile`` wrapper (which would build with TorchInductor)."""
    import json

    runs = {}
    for off, arg in (("", "call"), ("tp_embedding_compiles_at_first_request", "compiled")):
        env = {**os.environ, sglang_cpu.OFF_ENV: off}
        result = fresh_python.run([sys.executable, "-c", VOCAB_MASK, arg], env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[off] = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs[""] == {"compiled": False, "equal": True, "outside": True, "inductor": False}, runs
    assert runs["tp_embedding_compiles_at_first_request"] == {"compiled": True}, runs
