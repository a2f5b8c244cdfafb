"""Each part of megarl's SGLang CPU layer prevents the failure it is named after.

Every scenario runs in a fresh interpreter (the layer changes sys.modules and the environment,
and SGLang reads both at import time): once with the whole layer, once with one part disabled,
where the original error must come back.
"""
import os
import subprocess
import sys

import pytest

from megarl.platform import sglang_cpu

pytestmark = pytest.mark.skipif(not sglang_cpu.needed(), reason="the layer is inactive on GPU machines")

# One minimal SGLang scenario per part: what SGLang does on CPU that fails without that part.
SCENARIOS = {
    "cpu_engine": (
        "import torch\n"
        "from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding\n"
        "RotaryEmbedding(16, 16, 64, 10000, True, torch.float32)\n"
    ),
    "sgl_kernel": "import sglang.srt.mem_cache.memory_pool\n",
    "routed_experts_host_buffer": (
        "from sglang.srt.state_capturer.base import BaseHostCache\n"
        "cache = BaseHostCache(num_tokens=16, num_layers=2, topk_size=2, name='routed_experts', device='cpu')\n"
        "assert tuple(cache.buffer.shape) == (16, 2, 2)\n"
    ),
}
ORIGINAL_ERRORS = {
    "cpu_engine": "ModuleNotFoundError: No module named 'vllm'",
    "sgl_kernel": "ModuleNotFoundError: No module named 'sgl_kernel'",
    "routed_experts_host_buffer": "RuntimeError: Found no NVIDIA driver on your system",
}
# The routed-experts part patches an sglang module that itself imports sgl_kernel.
ALSO_DISABLED = {"sgl_kernel": ["routed_experts_host_buffer"]}


def run_with_layer(code: str, disabled: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env[sglang_cpu.DISABLE_ENV] = ",".join(disabled)
    prelude = "from megarl.platform import sglang_cpu\nsglang_cpu.install()\n"
    return subprocess.run([sys.executable, "-c", prelude + code + "print('SCENARIO_OK')\n"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_all_scenarios_run_with_the_whole_layer():
    stand_in_check = (
        "import sgl_kernel\n"
        "try:\n"
        "    sgl_kernel.some_cuda_op(1)\n"
        "except NotImplementedError as e:\n"
        "    assert 'sgl_kernel.some_cuda_op' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('the stand-in ran an op it does not have')\n"
    )
    result = run_with_layer("".join(SCENARIOS.values()) + stand_in_check, disabled=[])
    assert result.returncode == 0 and "SCENARIO_OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("part", sglang_cpu.PARTS)
def test_scenario_fails_with_the_original_error_without_its_part(part):
    result = run_with_layer(SCENARIOS[part], disabled=[part] + ALSO_DISABLED.get(part, []))
    assert result.returncode != 0, f"{part}: scenario passed without its part"
    assert ORIGINAL_ERRORS[part] in result.stderr, result.stderr[-3000:]


def test_unknown_part_name_is_rejected(monkeypatch):
    monkeypatch.setenv(sglang_cpu.DISABLE_ENV, "sgl_kernel,no_such_part")
    with pytest.raises(ValueError, match="no_such_part"):
        sglang_cpu.install()
