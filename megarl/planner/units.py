"""Byte sizes of dtypes and the planner's memory unit.

Memory is reported in GiB (2**30 bytes, what ``nvidia-smi`` and ``trainer.gpu_memory_gb`` mean
by "GB"); link bandwidth in Gbit/s (10**9 bits per second).
"""
from __future__ import annotations

from megarl.config.errors import ConfigError

GIB = 2**30

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``model.dtype``; ConfigError naming the key for an unknown dtype."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"model.dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}") from None


def gib(nbytes: float) -> float:
    """Bytes -> GiB."""
    return nbytes / GIB
