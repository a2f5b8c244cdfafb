"""What SGLang 0.5.23 needs to serve on a machine without a GPU; inactive when CUDA is available.

``apply()`` must run before anything imports sglang, in every SGLang process
(``megarl.engine_process.sglang_main`` calls it at import time; on CPU the scheduler and detokenizer are
forked from that process and inherit it, see ``spawn_reimports_sglang``). Each work-around is named after the
failure it prevents; ``MEGARL_SGLANG_WORKAROUNDS_OFF=name,name`` turns single ones off, which the
tests use to show that each one is needed:

- ``cpu_engine``: ``ModuleNotFoundError: No module named 'vllm'`` (from SGLang's rotary embedding,
  among others). SGLang takes its CPU code paths only with ``SGLANG_USE_CPU_ENGINE=1``; without it
  ``--device cpu`` still reaches kernels of other platforms.
- ``sgl_kernel``: ``ModuleNotFoundError: No module named 'sgl_kernel'``. SGLang's CPU path imports
  the CPU build of sgl-kernel at import time (``copy_all_layer_kv_cache_cpu``), which is not on
  PyPI (the CUDA wheel needs ``libcuda.so.1``). None of its ops runs on megarl's CPU path (MoE
  routing takes SGLang's torch-native top-k when sgl-kernel's AMX ops are absent), so a stand-in
  module is enough: every op it is asked for raises ``NotImplementedError`` naming the op.
- ``routed_experts_host_buffer``: ``RuntimeError: Found no NVIDIA driver on your system``. The
  ``--enable-return-routed-experts`` host buffer is pinned with ``cudaHostRegister``; on CPU it is
  allocated as plain memory (it never leaves the host there).
- ``omp_threads_bind``: ``AssertionError: SGLANG_CPU_OMP_THREADS_BIND is not set, in this case, the
  total number of ranks ...``. SGLang binds each rank of a CPU engine to a NUMA node of its own and
  refuses more ranks than NUMA nodes unless ``SGLANG_CPU_OMP_THREADS_BIND`` names each rank's cores.
  SGLang counts the ranks of the whole engine, over every node it spans (``--nnodes``), and indexes
  the bind list by a rank's index on its node. The engine's owner states the engine's ranks in
  ``MEGARL_SGLANG_RANKS`` and those it starts on this node in ``MEGARL_SGLANG_RANKS_PER_NODE``
  (``SGLangEngine`` does); with more ranks than NUMA nodes the process's physical cores are split
  evenly among this node's ranks (:func:`omp_threads_bind`), and an explicit
  ``SGLANG_CPU_OMP_THREADS_BIND`` is left as it is.
- ``tp_group_pynccl``: ``ValueError: Expected a cuda device, but got: cpu`` (from ``pynccl.py``).
  SGLang gives its TP (and attention-TP) groups a PyNccl communicator whenever the platform does not
  say otherwise, and the CPU platform does not; on CPU every group is created without one (gloo only).
- ``ep_non_local_experts``: ``RuntimeError: index -1 is out of bounds for dimension 1``. With
  ``--ep-size`` > 1 SGLang's dispatcher maps the experts of other EP ranks to -1, which the CPU
  native MoE forward (``moe_forward_native``) uses as an index. On CPU it runs SGLang's forward on
  the local (token, expert) pairs only and sums them per token, so each rank's MoE output is its
  local experts' share, which the all-reduce after the MoE block sums over the ranks.
- ``lora_pinned_host_memory``: ``RuntimeError: Found no NVIDIA driver on your system`` (from
  ``sglang/srt/lora/layers.py`` as ``--enable-lora`` builds its layers). SGLang's LoRA code pins its
  host-side index and weight tensors (``pin_memory=True``, ``Tensor.pin_memory()``) unconditionally;
  pinning needs a CUDA driver. Without one, pinned host memory is plain host memory: torch's
  factories that SGLang calls with ``pin_memory`` ignore it and ``Tensor.pin_memory`` returns the tensor.
- ``per_request_attention``: not an error but the rollout's time: SGLang's torch-native attention
  backend (the CPU path's) calls SDPA once per request and layer in a Python loop; the demo's 512
  short requests spend most of a rollout there. :mod:`megarl.platform.sglang_cpu_attention` does the
  batch in one call per layer (the same outputs: ``tests/test_sglang_cpu_attention.py``).
- ``sampling_mask_full_sort``: not an error but the rollout's time: with sampling masks requested,
  SGLang's pytorch sampler sorts the whole vocabulary on every decode step instead of the top-k
  columns it keeps otherwise. :mod:`megarl.platform.sglang_cpu_sampling` samples from the top-k
  columns in both cases (the same support, weights and distribution: ``tests/test_sglang_cpu_sampling.py``).
- ``torch_compile_imports_inductor``: not an error but every engine's start: SGLang decorates kernels with
  ``torch.compile`` at import, which imports TorchInductor; its CPU path runs none of them. They are compiled
  at their first call instead (:mod:`megarl.platform.torch_compile`; ``tests/test_torch_compile.py``).
- ``tp_embedding_compiles_at_first_request``: not an error but the first request of an engine with TP > 1:
  SGLang's vocabulary-parallel embedding masks the ids outside a rank's shard with a ``torch.compile``'d
  function (``get_masked_input_and_mask``), whose first call on CPU runs TorchInductor (its import, C++
  generation and build: seconds, on every rank). On CPU the function runs as written (a few integer
  element-wise ops: the same outputs, ``tests/test_torch_compile.py``).
- ``spawn_reimports_sglang``: not an error but every engine's start: SGLang starts its scheduler(s)
  and detokenizer with the "spawn" start method (CUDA cannot be forked), so each child re-imports
  SGLang and torch, about 15 CPU-seconds per engine on top of the server process's own import. With
  no CUDA to protect, the children are forked from the server process, which has imported all of it
  and applied these work-arounds (the same outputs, a fraction of the children's start-up CPU:
  ``tests/test_sglang_cpu_fork.py``).
"""
from __future__ import annotations

import glob
import importlib.machinery
import inspect
import multiprocessing
import os
import sys
import types
from pathlib import Path

from megarl.platform.torch_compile import compile_at_first_call
from megarl.platform.workarounds import Workaround, apply_enabled

OFF_ENV = "MEGARL_SGLANG_WORKAROUNDS_OFF"
RANKS_PER_NODE_ENV = "MEGARL_SGLANG_RANKS_PER_NODE"  # the engine ranks its owner starts on this node
RANKS_ENV = "MEGARL_SGLANG_RANKS"  # the engine's ranks over all its nodes
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's: each rank's cores, "|"-separated


def needed() -> bool:
    """True when no CUDA device is usable, i.e. SGLang must run on its CPU path."""
    import torch

    return not torch.cuda.is_available()


def apply() -> list[str]:
    """Apply every work-around not named in OFF_ENV when no GPU is present; returns their names."""
    if not needed():
        return []
    return apply_enabled(WORKAROUNDS, OFF_ENV)


def _use_cpu_engine() -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


class _SglKernelStandIn(types.ModuleType):
    """``sgl_kernel`` for the CPU path: attributes SGLang imports but this machine never calls."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def not_implemented(*args, **kwargs):
            raise NotImplementedError(
                f"sgl_kernel.{name} is not provided by megarl's CPU stand-in (megarl/platform/sglang_cpu.py)"
            )

        not_implemented.__name__ = name
        return not_implemented


def _add_sgl_kernel_stand_in() -> None:
    if "sgl_kernel" in sys.modules:
        return
    module = _SglKernelStandIn("sgl_kernel", "megarl's stand-in for sgl-kernel's CPU build (no ops)")
    module.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", loader=None)
    module.__version__ = "0.0.0+megarl.cpu"
    sys.modules["sgl_kernel"] = module


def _alloc_plain_host_buffer(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """SGLang's host-buffer allocator signature, without pinning (no CUDA driver to register with)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _allocate_routed_experts_host_buffer_unpinned() -> None:
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain_host_buffer


def physical_cpus() -> list[int]:
    """The CPUs this process may run on, one per physical core (the first allowed SMT sibling),
    as SGLang picks them for its per-NUMA-node binding."""
    seen, cpus = set(), []
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            core = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            core = str(cpu)
        if core not in seen:
            seen.add(core)
            cpus.append(cpu)
    return cpus


def numa_node_count() -> int:
    """NUMA nodes with CPUs (1 where sysfs does not say)."""
    nodes = [n for n in glob.glob("/sys/devices/system/node/node[0-9]*")
             if Path(n, "cpulist").is_file() and Path(n, "cpulist").read_text().strip()]
    return max(len(nodes), 1)


def _cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the cpulist format SGLang's examples use)."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def omp_threads_bind(num_ranks: int, cpus: list[int]) -> str:
    """An ``SGLANG_CPU_OMP_THREADS_BIND`` value giving each of ``num_ranks`` ranks its share of
    ``cpus``: consecutive, even blocks (the first ranks get one core less when they do not divide);
    with more ranks than cores, neighbouring ranks share a core (``"0|0|1|1"`` for 4 on 2)."""
    if num_ranks < 1 or not cpus:
        raise ValueError(f"need >= 1 rank and >= 1 cpu, got {num_ranks} ranks and cpus {cpus}")
    n = len(cpus)
    blocks = []
    for rank in range(num_ranks):
        start = rank * n // num_ranks
        end = max((rank + 1) * n // num_ranks, start + 1)
        blocks.append(_cpu_list(cpus[start:end]))
    return "|".join(blocks)


def _bind_each_rank_its_cores() -> None:
    if os.environ.get(THREADS_BIND_ENV):  # the user's, or set by the server before it spawned this process
        return
    here = int(os.environ.get(RANKS_PER_NODE_ENV) or 1)
    if int(os.environ.get(RANKS_ENV) or here) > numa_node_count():
        os.environ[THREADS_BIND_ENV] = omp_threads_bind(here, physical_cpus())


def _create_groups_without_pynccl() -> None:
    from sglang.srt.distributed import parallel_state

    create = parallel_state.init_model_parallel_group
    if getattr(create, "_megarl_cpu", False):
        return

    def init_model_parallel_group(*args, **kwargs):
        kwargs["use_pynccl"] = False  # keyword-only in effect: every SGLang caller passes it by name or not at all
        return create(*args, **kwargs)

    init_model_parallel_group._megarl_cpu = True
    parallel_state.init_model_parallel_group = init_model_parallel_group


def _skip_non_local_experts() -> None:
    from sglang.srt.layers.moe import fused_moe_native

    forward = fused_moe_native.moe_forward_native
    if getattr(forward, "_megarl_cpu", False):
        return

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        topk_weights, topk_ids, _ = topk_output
        local = topk_ids >= 0  # SGLang's dispatcher maps the experts of other EP ranks to -1
        if bool(local.all()):
            return forward(layer, x, topk_output, moe_runner_config)
        # SGLang's own forward over the local (token, expert) pairs, one pair a row, summed per token.
        tokens, slots = local.nonzero(as_tuple=True)
        out = x.new_zeros((x.shape[0], layer.w2_weight.shape[-2]))
        if tokens.numel():
            pairs = topk_output._replace(topk_weights=topk_weights[tokens, slots].unsqueeze(1),
                                         topk_ids=topk_ids[tokens, slots].unsqueeze(1))
            out.index_add_(0, tokens, forward(layer, x[tokens], pairs, moe_runner_config))
        return out

    moe_forward_native._megarl_cpu = True
    fused_moe_native.moe_forward_native = moe_forward_native


_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def _pin_host_memory_as_plain_memory() -> None:
    import functools

    import torch

    def unpinned(factory):
        @functools.wraps(factory)
        def create(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)
        return create

    for name in _PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, device=None: self


def _batch_attention() -> None:
    from megarl.platform import sglang_cpu_attention

    sglang_cpu_attention.install()


def _sample_masks_from_top_k() -> None:
    from megarl.platform import sglang_cpu_sampling

    sglang_cpu_sampling.install()


def _mask_vocab_shards_eagerly() -> None:
    from sglang.srt.layers import vocab_parallel_embedding

    vocab_parallel_embedding.get_masked_input_and_mask = inspect.unwrap(
        vocab_parallel_embedding.get_masked_input_and_mask)


def _fork_engine_children() -> None:
    from sglang.srt.entrypoints import engine

    configure = engine._set_envs_and_config
    if getattr(configure, "_megarl_cpu", False):
        return

    def set_envs_and_config(server_args):
        configure(server_args)  # ends with mp.set_start_method("spawn", force=True)
        multiprocessing.set_start_method("fork", force=True)

    set_envs_and_config._megarl_cpu = True
    engine._set_envs_and_config = set_envs_and_config


WORKAROUNDS = (  # torch_compile_imports_inductor first: the others import SGLang modules
    Workaround("torch_compile_imports_inductor", "TorchInductor imported by every engine process at start",
               compile_at_first_call),
    Workaround("cpu_engine", "ModuleNotFoundError: No module named 'vllm'", _use_cpu_engine),
    Workaround("sgl_kernel", "ModuleNotFoundError: No module named 'sgl_kernel'", _add_sgl_kernel_stand_in),
    Workaround("routed_experts_host_buffer", "RuntimeError: Found no NVIDIA driver on your system",
               _allocate_routed_experts_host_buffer_unpinned),
    Workaround("omp_threads_bind", "SGLANG_CPU_OMP_THREADS_BIND is not set, in this case", _bind_each_rank_its_cores),
    Workaround("tp_group_pynccl", "ValueError: Expected a cuda device, but got: cpu", _create_groups_without_pynccl),
    Workaround("ep_non_local_experts", "RuntimeError: index -1 is out of bounds for dimension 1",
               _skip_non_local_experts),
    Workaround("lora_pinned_host_memory", "RuntimeError: Found no NVIDIA driver on your system",
               _pin_host_memory_as_plain_memory),
    Workaround("per_request_attention", "one SDPA call per request and layer (SGLang's torch-native loop)",
               _batch_attention),
    Workaround("sampling_mask_full_sort", "a full-vocabulary sort per decode step with sampling masks on",
               _sample_masks_from_top_k),
    Workaround("tp_embedding_compiles_at_first_request",
               "a TP > 1 engine's first request waits for TorchInductor to build the vocabulary mask",
               _mask_vocab_shards_eagerly),
    Workaround("spawn_reimports_sglang", "each spawned engine child re-imports SGLang (~15 CPU-seconds a start)",
               _fork_engine_children),
)
