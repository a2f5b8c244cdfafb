"""GPU memory and utilisation per device from NVML (nvidia-ml-py), as run metrics.

Keys, for every device NVML sees on this node (NVML's index, which ignores CUDA_VISIBLE_DEVICES):
``gpu/<i>/memory_used_gb`` and ``gpu/<i>/memory_total_gb`` in GiB (2**30 bytes, what nvidia-smi
and the planner call GB), ``gpu/<i>/utilization_pct`` (percent of the last sample period in which
a kernel ran). Without a GPU, or when NVML cannot start, :meth:`GpuStats.sample` returns ``{}``
(logged once, at INFO); a query a device does not support leaves its key out.
"""
from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger(__name__)

GIB = 2**30


class GpuStats:
    """Samples every NVML device; ``nvml`` is the ``pynvml`` module (or a stand-in with its API)."""

    def __init__(self, nvml: ModuleType | None = None):
        if nvml is None:
            import pynvml as nvml
        self._nvml = nvml
        self._handles: list = []
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.info("no GPU metrics: NVML did not start (%s)", exc)
            self._started = False
            return
        self._started = True
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        if not self._handles:
            log.info("no GPU metrics: NVML sees no device")

    def sample(self) -> dict[str, float]:
        """``{"gpu/<i>/memory_used_gb": ..., "gpu/<i>/memory_total_gb": ..., "gpu/<i>/utilization_pct": ...}``."""
        nvml, out = self._nvml, {}
        for i, handle in enumerate(self._handles):
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                out[f"gpu/{i}/memory_used_gb"] = memory.used / GIB
                out[f"gpu/{i}/memory_total_gb"] = memory.total / GIB
            except nvml.NVMLError as exc:
                log.debug("GPU %d: no memory info (%s)", i, exc)
            try:
                out[f"gpu/{i}/utilization_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError as exc:
                log.debug("GPU %d: no utilisation (%s)", i, exc)
        return out

    def close(self) -> None:
        """Shut NVML down (once; sample() returns {} afterwards)."""
        if self._started:
            self._nvml.nvmlShutdown()
            self._started = False
        self._handles = []
