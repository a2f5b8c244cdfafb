"""What a machine offers the trainer and the engines: the CPU, or CUDA with its compute capability,
its GPU count and which GPU libraries import there.

Every GPU decision (the trainer's layers and fusions, packed attention, the engines' dtype and
attention backend, memory release in colocated placement) is a function of a :class:`Platform`,
never of ``torch.cuda.is_available()`` read on the spot, so that the tests evaluate the CUDA
description (:meth:`Platform.cuda`) on a machine without a GPU and assert each decision against the
library source it comes from.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field

import torch

# Imported to decide (an installed transformer-engine raises RuntimeError without cuDNN; apex's fused
# weight-gradient kernel is what megatron's own linear layers need for gradient-accumulation fusion).
IMPORT_CHECKED = ("transformer_engine.pytorch", "fused_weight_gradient_mlp_cuda")
# Looked up only (their import initialises CUDA in the process that imports them; SGLang's own
# processes do that): SGLang's kernels and its memory saver.
FOUND_CHECKED = ("torch_memory_saver", "sgl_kernel", "flashinfer", "deep_gemm")
GPU_MODULES = IMPORT_CHECKED + FOUND_CHECKED


@dataclass(frozen=True)
class Platform:
    """``device``: "cpu" or "cuda". ``capability``: the CUDA compute capability of device 0 ((9, 0) on
    H100/H200), None on CPU. ``importable``: the names of :data:`GPU_MODULES` that import (or, for
    :data:`FOUND_CHECKED`, are installed). ``missing``: why each other one does not, for messages."""

    device: str
    capability: tuple[int, int] | None = None
    gpu_count: int = 0
    importable: frozenset[str] = frozenset()
    missing: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if (self.device == "cuda") != (self.capability is not None):
            raise ValueError("a CUDA platform has a compute capability and a CPU one none")

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def has(self, module: str) -> bool:
        return module in self.importable

    def why_missing(self, module: str) -> str:
        return self.missing.get(module, "not installed")

    @classmethod
    def cpu(cls) -> Platform:
        return cls("cpu")

    @classmethod
    def cuda(cls, capability: tuple[int, int] = (9, 0), gpu_count: int = 8,
             importable: tuple[str, ...] = GPU_MODULES) -> Platform:
        """A CUDA machine as described (default: an 8-GPU Hopper node with the GPU extras)."""
        unknown = set(importable) - set(GPU_MODULES)
        if unknown:
            raise ValueError(f"unknown GPU modules {sorted(unknown)}; known: {GPU_MODULES}")
        return cls("cuda", tuple(capability), gpu_count, frozenset(importable),
                   {m: "not installed" for m in GPU_MODULES if m not in importable})


def _check(module: str, do_import: bool) -> str | None:
    """None when ``module`` imports (or is found), else the reason."""
    try:
        if do_import:
            importlib.import_module(module)
            return None
        return None if importlib.util.find_spec(module) is not None else "not installed"
    except Exception as exc:  # an installed TE without cuDNN raises RuntimeError, not ImportError
        return f"{type(exc).__name__}: {exc}"


@functools.cache
def detect() -> Platform:
    """This process's platform (computed once). Without a usable CUDA device it is the CPU, whatever
    is installed."""
    if not torch.cuda.is_available():
        return Platform.cpu()
    missing = {m: why for m in GPU_MODULES if (why := _check(m, m in IMPORT_CHECKED)) is not None}
    return Platform("cuda", tuple(torch.cuda.get_device_capability(0)), torch.cuda.device_count(),
                    frozenset(m for m in GPU_MODULES if m not in missing), missing)
