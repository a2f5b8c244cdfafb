"""How SGLang's processes pickle tensors to each other (every platform, GPU too).

SGLang's scheduler sends each finished request's routed experts (an int32 tensor per request) and
other host tensors to its detokenizer with ``pickle`` over ZMQ. Two costs come with that, and
:func:`install` (run by ``megarl.engine_process.sglang_main`` in every SGLang process, before SGLang is
imported) removes both:

- torch pickles a tensor through ``torch.save`` into an in-memory file and unpickles it with
  ``torch.load``, a fixed cost per tensor paid for each of a step's requests on each side (figures:
  docs/cpu_platform.md). A host tensor is pickled here as its bytes, dtype and shape instead (values,
  dtype and shape equal; a view arrives as a tensor of its own). CUDA tensors, tensors that require
  grad and other layouts keep torch's own reduction.
- megatron-core replaces ``torch.storage._load_from_bytes`` when ``megatron.core`` is imported
  (``megatron/core/__init__.py``: its weights-only ``safe_load_from_bytes``, for checkpoints). SGLang's
  scheduler imports ``megatron.core`` whenever it is installed (``sglang.srt.debug_utils.dumper``,
  imported by the model runner), so a tensor that still takes torch's reduction names megatron's
  function and is unpickled by torch's pure-Python weights-only unpickler: two thirds of the
  detokenizer's time in the demo's rollout (py-spy). In megarl's environment both libraries are
  always installed. torch's own ``_load_from_bytes`` is put back as soon as ``megatron.core`` has
  been imported, without importing it where SGLang would not; trainer processes keep megatron's.

SGLang's processes exchange these tensors only with each other over local sockets, which the
weights-only check was not written for.
"""
from __future__ import annotations

import copyreg
import importlib.abc
import importlib.util
import pickle
import sys

import torch

PATCHING_MODULE = "megatron.core"


class _RestoreTorchStorageUnpickler(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` with the other finders and wraps its loader so that torch's
    ``_load_from_bytes`` is put back right after the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != PATCHING_MODULE:
            return None
        sys.meta_path.remove(self)  # one import only; also keeps find_spec below from coming back here
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_restore(module):
            import torch.storage

            torch_own = torch.storage._load_from_bytes
            try:
                exec_module(module)
            finally:
                torch.storage._load_from_bytes = torch_own

        spec.loader.exec_module = exec_and_restore
        return spec


def tensor_from_bytes(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The host tensor :func:`reduce_tensor` pickled: ``data`` (its bytes, row-major) as ``dtype``
    of ``shape``; shares ``data``'s memory."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def reduce_tensor(t: torch.Tensor):
    """Pickle a plain host tensor as (bytes, dtype, shape); any other tensor as torch does."""
    if t.device.type != "cpu" or t.requires_grad or t.layout != torch.strided or t.is_quantized:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return tensor_from_bytes, (bytearray(flat.numpy()), t.dtype, tuple(t.shape))


def install() -> None:
    """In this process, pickle host tensors as bytes (:func:`reduce_tensor`) and keep torch's
    ``torch.storage._load_from_bytes`` when ``megatron.core`` is imported later (idempotent).
    RuntimeError when ``megatron.core`` has been imported already."""
    if PATCHING_MODULE in sys.modules:
        raise RuntimeError(f"{PATCHING_MODULE} is imported already: install() must run before it")
    copyreg.pickle(torch.Tensor, reduce_tensor)
    if not any(isinstance(f, _RestoreTorchStorageUnpickler) for f in sys.meta_path):
        sys.meta_path.insert(0, _RestoreTorchStorageUnpickler())
