"""Each SGLang CPU work-around is needed: turned off alone, its scenario fails with the error it names.

Every scenario is a few lines of SGLang in a fresh interpreter (the work-arounds change sys.modules
and the environment, and SGLang reads both at import time; :mod:`fresh_python`, which has imported
torch and transformers but no SGLang): what its CPU path does at import, the
CPU MoE forward of each rank of an EP2 engine, or, in TP processes at once, what each scheduler of a
TP engine does first (``bootstrap.init_parallel_runtime``: bind its threads, build its process groups),
where the TP engines fail while they start.
"""
import os
import subprocess
import sys
from pathlib import Path

import fresh_python
import pytest

from megarl.parallel import free_port
from megarl.platform import sglang_cpu

pytestmark = pytest.mark.skipif(not sglang_cpu.needed(), reason="the work-arounds are inactive on GPU machines")

TP = 2  # the ranks of the parallel scenarios: more than the one NUMA node of this machine
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
    # What --enable-lora does to each column-parallel layer it wraps (its host-side offsets are pinned)
    "lora_pinned_host_memory": (
        "import torch\n"
        "from sglang.srt.lora.layers import ColumnParallelLinearWithLoRA\n"
        "base = torch.nn.Linear(8, 8)\n"
        "base.output_partition_sizes = [8]\n"
        "assert ColumnParallelLinearWithLoRA(base, None).output_offset_cpu.tolist() == [0, 8]\n"
    ),
    # The CPU MoE forward of each EP2 rank, given the local expert ids its StandardDispatcher makes
    # (-1 for the other rank's experts): the ranks' outputs sum to the EP1 output.
    "ep_non_local_experts": (
        "import torch\n"
        "from types import SimpleNamespace\n"
        "from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig\n"
        "from sglang.srt.layers.moe.token_dispatcher.standard import (StandardDispatchOutput,\n"
        "                                                             _map_topk_ids_to_local_experts)\n"
        "from sglang.srt.layers.moe.topk import StandardTopKOutput\n"
        "from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod\n"
        "torch.manual_seed(0)\n"
        "w13, w2, x = torch.randn(4, 32, 8), torch.randn(4, 8, 16), torch.randn(5, 8)\n"
        "ids, weights = torch.tensor([[0, 1], [2, 3], [0, 2], [3, 1], [1, 2]]), torch.rand(5, 2)\n"
        "method = UnquantizedFusedMoEMethod()\n"
        "method.moe_runner_config = MoeRunnerConfig(num_experts=4, top_k=2)\n"
        "def moe(w13, w2, ids):\n"
        "    layer = SimpleNamespace(num_experts=4, w13_weight=w13, w2_weight=w2)\n"
        "    dispatched = StandardDispatchOutput(x, None, StandardTopKOutput(weights, ids, None))\n"
        "    return method.apply(layer, dispatched).hidden_states\n"
        "ep_outputs = []\n"
        "for rank in range(2):\n"
        "    mapping = torch.full((4,), -1, dtype=torch.int32)\n"
        "    mapping[2 * rank:2 * rank + 2] = torch.arange(2, dtype=torch.int32)\n"
        "    local = slice(2 * rank, 2 * rank + 2)\n"
        "    ep_outputs.append(moe(w13[local], w2[local], _map_topk_ids_to_local_experts(ids, mapping)))\n"
        "torch.testing.assert_close(sum(ep_outputs), moe(w13, w2, ids))\n"
    ),
}
# A TP scheduler's parallel start-up on CPU, as run_scheduler_process and Scheduler.__init__ do it for the
# rank in $SCENARIO_RANK; then the TP group all-reduces.
TP_SCHEDULER_START = (
    "import os\n"
    "import torch\n"
    "from sglang.srt.distributed import bootstrap\n"
    "from sglang.srt.distributed.parallel_state import get_tp_group\n"
    "from sglang.srt.runtime_context import SpawnRanks, publish\n"
    "from sglang.srt.server_args import ServerArgs\n"
    "rank = int(os.environ['SCENARIO_RANK'])\n"
    f"args = ServerArgs(model_path=os.environ['SCENARIO_MODEL'], device='cpu', tp_size={TP})\n"
    "publish(args, role='scheduler', ranks=SpawnRanks(world_rank=rank, gpu_id=rank))\n"
    "bootstrap.init_parallel_runtime(server_args=args, device='cpu', dist_port=int(os.environ['SCENARIO_PORT']))\n"
    f"assert get_tp_group().all_reduce(torch.ones(1)).item() == {TP}\n"
)
# work-around -> the scenario its TP ranks run
RANK_SCENARIOS = {"omp_threads_bind": TP_SCHEDULER_START, "tp_group_pynccl": TP_SCHEDULER_START}
# work-arounds for time, not for an error: the test file that shows each one's effect and its outputs
FOR_TIME = {"per_request_attention": "tests/test_sglang_cpu_attention.py",
            "sampling_mask_full_sort": "tests/test_sglang_cpu_sampling.py",
            "spawn_reimports_sglang": "tests/test_sglang_cpu_fork.py",
            "torch_compile_imports_inductor": "tests/test_torch_compile.py",
            "tp_embedding_compiles_at_first_request": "tests/test_torch_compile.py"}
PREVENTS = {w.name: w.prevents for w in sglang_cpu.WORKAROUNDS}
# These work-arounds patch sglang modules that themselves import sgl_kernel.
ALSO_OFF = {"sgl_kernel": ["routed_experts_host_buffer", "tp_group_pynccl", "ep_non_local_experts",
                          "tp_embedding_compiles_at_first_request"]}
SCENARIO_TIMEOUT_S = 300


def scenario(code: str, off: list[str], **env) -> tuple[list[str], dict[str, str]]:
    """The command running ``code`` after the work-arounds not in ``off``, and its environment."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("SGLANG_USE_CPU_ENGINE", sglang_cpu.THREADS_BIND_ENV)}
    environment.update(env, **{sglang_cpu.OFF_ENV: ",".join(off)})
    prelude = "from megarl.platform import sglang_cpu\nsglang_cpu.apply()\n"
    return [sys.executable, "-c", prelude + code + "print('SCENARIO_OK')\n"], environment


def run_with_workarounds(code: str, off: list[str]) -> subprocess.CompletedProcess:
    command, env = scenario(code, off)
    return fresh_python.run(command, env=env, timeout=SCENARIO_TIMEOUT_S)


def run_ranks(code: str, off: list[str], model_path: str) -> list[subprocess.CompletedProcess]:
    """``code`` in TP processes at once (a TP engine's ranks on this node, as SGLangEngine states them);
    each one's stdout and stderr together, in ``stderr``."""
    port = free_port()  # rank 0's TCP store (SGLang's dist port), on the loopback interface
    runs = []
    for rank in range(TP):
        command, env = scenario(code, off, SCENARIO_RANK=str(rank), SCENARIO_PORT=str(port),
                                SCENARIO_MODEL=model_path, **{sglang_cpu.RANKS_PER_NODE_ENV: str(TP)})
        runs.append(fresh_python.Run(command, env=env))
    results = []
    for run in runs:
        try:
            result = run.wait(timeout=SCENARIO_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:  # what it wrote, and why it ended
            result = subprocess.CompletedProcess(e.cmd, -9, e.output,
                                                 f"{e.stderr}\nkilled after {SCENARIO_TIMEOUT_S} s")
        results.append(subprocess.CompletedProcess(result.args, result.returncode, "", result.stdout + result.stderr))
    return results


@pytest.mark.unit
def test_every_workaround_has_a_scenario():
    assert not set(SCENARIOS) & set(RANK_SCENARIOS)
    assert not (set(SCENARIOS) | set(RANK_SCENARIOS)) & set(FOR_TIME)
    assert set(SCENARIOS) | set(RANK_SCENARIOS) | set(FOR_TIME) == set(PREVENTS)
    assert all((Path(__file__).parents[1] / path).is_file() for path in FOR_TIME.values())


@pytest.mark.processes
def test_all_scenarios_run_with_every_workaround(tiny_checkpoint):
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
    for code in set(RANK_SCENARIOS.values()):
        for rank, result in enumerate(run_ranks(code, [], tiny_checkpoint)):
            assert result.returncode == 0 and "SCENARIO_OK" in result.stderr, f"rank {rank}: {result.stderr[-3000:]}"


@pytest.mark.processes
@pytest.mark.parametrize("workaround", sorted(SCENARIOS))
def test_scenario_fails_without_workaround(workaround):
    result = run_with_workarounds(SCENARIOS[workaround], off=[workaround] + ALSO_OFF.get(workaround, []))
    assert result.returncode != 0, f"{workaround} off, yet its scenario passed"
    assert PREVENTS[workaround] in result.stderr, result.stderr[-3000:]


@pytest.mark.unit
def test_unknown_workaround_name_is_rejected(monkeypatch):
    monkeypatch.setenv(sglang_cpu.OFF_ENV, "sgl_kernel,no_such_workaround")
    with pytest.raises(ValueError, match="no_such_workaround"):
        sglang_cpu.apply()


@pytest.mark.processes
@pytest.mark.parametrize("workaround", sorted(RANK_SCENARIOS))
def test_rank_scenario_fails_without_workaround(workaround, tiny_checkpoint, monkeypatch):
    """Every rank fails, one with the named error; tests/test_engine_parallel.py shows the TP2 and
    TP2 + EP2 engines serving with every work-around on."""
    if workaround == "omp_threads_bind" and sglang_cpu.numa_node_count() >= TP:
        # SGLang gives each rank a NUMA node itself when there are enough: the work-around must leave the
        # binding to it (turning it off cannot fail a rank here)
        monkeypatch.delenv(sglang_cpu.THREADS_BIND_ENV, raising=False)
        monkeypatch.setenv(sglang_cpu.RANKS_PER_NODE_ENV, str(TP))
        sglang_cpu._bind_each_rank_its_cores()
        assert sglang_cpu.THREADS_BIND_ENV not in os.environ
        return
    results = run_ranks(RANK_SCENARIOS[workaround], [workaround], tiny_checkpoint)
    assert all(r.returncode != 0 for r in results), f"{workaround} off, yet a rank passed"
    logs = "".join(r.stderr for r in results)
    assert PREVENTS[workaround] in logs, logs[-3000:]
