"""Each SGLang CPU work-around is needed: turned off alone, its scenario fails with the error it names.

Every scenario runs in a fresh interpreter (the work-arounds change sys.modules and the
environment, and SGLang reads both at import time): a few lines of SGLang for the import-time
work-arounds, a 2-rank engine (TP2, or TP2 + EP2) for the parallel ones, which fail while the
engine starts.
"""
import os
import subprocess
import sys

import pytest

from megarl.engines.server import EngineSettings, EngineStartError, SGLangEngine
from megarl.platform import sglang_cpu

pytestmark = pytest.mark.skipif(not sglang_cpu.needed(), reason="the work-arounds are inactive on GPU machines")

# work-around -> the smallest thing SGLang does on CPU that fails without it
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
# work-around -> the engine parallelism (tp, ep) whose start-up fails without it
ENGINE_SCENARIOS = {
    "omp_threads_bind": (2, 1),  # two ranks, one NUMA node here
    "tp_group_pynccl": (2, 1),
    "ep_non_local_experts": (2, 2),
}
PREVENTS = {w.name: w.prevents for w in sglang_cpu.WORKAROUNDS}
# These work-arounds patch sglang modules that themselves import sgl_kernel.
ALSO_OFF = {"sgl_kernel": ["routed_experts_host_buffer", "tp_group_pynccl", "ep_non_local_experts"]}
# Each failure ends the start-up: 1-4 min on this loaded 2-core machine (4 processes importing SGLang).
# The limit only matters if the engine neither fails nor becomes healthy; a healthy start fails at once.
ENGINE_START_TIMEOUT_S = 600.0


def run_with_workarounds(code: str, off: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env[sglang_cpu.OFF_ENV] = ",".join(off)
    prelude = "from megarl.platform import sglang_cpu\nsglang_cpu.apply()\n"
    return subprocess.run([sys.executable, "-c", prelude + code + "print('SCENARIO_OK')\n"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_workaround_has_a_scenario():
    assert not set(SCENARIOS) & set(ENGINE_SCENARIOS)
    assert set(SCENARIOS) | set(ENGINE_SCENARIOS) == set(PREVENTS)


def test_all_scenarios_run_with_every_workaround():
    stand_in_check = (
        "import sgl_kernel\n"
        "try:\n"
        "    sgl_kernel.some_cuda_op(1)\n"
        "except NotImplementedError as e:\n"
        "    assert 'sgl_kernel.some_cuda_op' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('the stand-in ran an op it does not have')\n"
    )
    result = run_with_workarounds("".join(SCENARIOS.values()) + stand_in_check, off=[])
    assert result.returncode == 0 and "SCENARIO_OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("workaround", sorted(SCENARIOS))
def test_scenario_fails_without_workaround(workaround):
    result = run_with_workarounds(SCENARIOS[workaround], off=[workaround] + ALSO_OFF.get(workaround, []))
    assert result.returncode != 0, f"{workaround} off, yet its scenario passed"
    assert PREVENTS[workaround] in result.stderr, result.stderr[-3000:]


def test_unknown_workaround_name_is_rejected(monkeypatch):
    monkeypatch.setenv(sglang_cpu.OFF_ENV, "sgl_kernel,no_such_workaround")
    with pytest.raises(ValueError, match="no_such_workaround"):
        sglang_cpu.apply()


@pytest.mark.parametrize("workaround", sorted(ENGINE_SCENARIOS))
def test_parallel_engine_fails_without_workaround(workaround, tiny_checkpoint, tmp_path, monkeypatch):
    """The engine (its log) shows the named error; the engine tests (tests/test_engine_parallel.py)
    show the same engines serving with every work-around on."""
    tp, ep = ENGINE_SCENARIOS[workaround]
    monkeypatch.delenv(sglang_cpu.THREADS_BIND_ENV, raising=False)
    if workaround == "omp_threads_bind" and sglang_cpu.numa_node_count() >= tp:
        # SGLang gives each rank a NUMA node itself when there are enough: the work-around must leave the
        # binding to it (turning it off cannot fail an engine here)
        monkeypatch.setenv(sglang_cpu.RANKS_PER_NODE_ENV, str(tp))
        sglang_cpu._bind_each_rank_its_cores()
        assert sglang_cpu.THREADS_BIND_ENV not in os.environ
        return
    monkeypatch.setenv(sglang_cpu.OFF_ENV, workaround)
    engine = SGLangEngine(EngineSettings(
        model_path=tiny_checkpoint, dtype="float32", max_total_tokens=1024, tp=tp, ep=ep,
        startup_timeout_s=ENGINE_START_TIMEOUT_S, log_path=str(tmp_path / "server.log"),
    ))
    with pytest.raises(EngineStartError, match="exited with code"):
        engine.start()
    log = engine.log_path.read_text(errors="replace")
    assert PREVENTS[workaround] in log, engine.log_tail(80)
