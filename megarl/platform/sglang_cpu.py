"""What SGLang 0.5.23 needs to serve on a machine without a GPU; inactive when CUDA is available.

``apply()`` must run before anything imports sglang, in every SGLang process (the server spawns
its scheduler and detokenizer with the "spawn" start method; ``megarl.engines.sglang_main``
calls it at import time, which the spawned children repeat). Each work-around is named after the
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
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import types

from megarl.platform.workarounds import Workaround, apply_enabled

OFF_ENV = "MEGARL_SGLANG_WORKAROUNDS_OFF"


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


WORKAROUNDS = (
    Workaround("cpu_engine", "ModuleNotFoundError: No module named 'vllm'", _use_cpu_engine),
    Workaround("sgl_kernel", "ModuleNotFoundError: No module named 'sgl_kernel'", _add_sgl_kernel_stand_in),
    Workaround("routed_experts_host_buffer", "RuntimeError: Found no NVIDIA driver on your system",
               _allocate_routed_experts_host_buffer_unpinned),
)
