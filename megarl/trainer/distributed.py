"""One trainer rank's process groups: torch.distributed plus megatron-core's model-parallel state."""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """A trainer layout; world_size = tp * pp * cp * dp, experts split over ep * etp ranks."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    first_stage_layers: int | None = None  # uneven PP: decoder layers on the first / last stage
    last_stage_layers: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False

    @classmethod
    def from_config(cls, parallel) -> "Layout":
        return cls(world_size=parallel.world_size, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp,
                   first_stage_layers=parallel.first_stage_layers, last_stage_layers=parallel.last_stage_layers,
                   cp=parallel.cp, ep=parallel.ep, etp=parallel.etp, sequence_parallel=parallel.sequence_parallel)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_rank(rank: int, layout: Layout, master_addr: str, master_port: int, backend: str = "auto",
              seed: int = 1234) -> None:
    """Join the process group and build megatron's TP/PP/CP/EP/DP groups for ``layout``."""
    from megarl.platform import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group(
        backend=backend_for(backend), init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank, world_size=layout.world_size,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)
    log.debug("rank %d joined %s", rank, layout)


def shutdown_rank() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
