"""One trainer rank's process groups: torch.distributed plus megatron-core's model-parallel state."""
from __future__ import annotations

import logging

import torch

from megarl.parallel import Layout, pin_gloo_interface
from megarl.parallel.nccl import pin_nccl_environment

log = logging.getLogger(__name__)


def backend_for(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_rank(rank: int, layout: Layout, master_addr: str, master_port: int, backend: str = "auto",
              seed: int = 1234) -> None:
    """Join the process group (rank 0's TCP store listens at ``master_addr:master_port``, which
    every rank must reach: rank 0's node address on several nodes) and build megatron's
    TP/PP/CP/EP/DP groups for ``layout``. The NCCL settings every process of the run shares are set first
    (:mod:`megarl.parallel.nccl`: NCCL reads them when its first communicator forms)."""
    from megarl.gc_pause import gc_paused
    from megarl.platform import megatron_cpu

    with gc_paused():
        megatron_cpu.apply()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pin_nccl_environment()
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    pin_gloo_interface()  # several nodes: gloo on the interface the other nodes reach
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
    """Undo :func:`init_rank` and what megatron's models left process-wide (the routers' replay
    instances, the MoE loss tracker, the rotary embeddings' cached calls, which hold the modules and
    so their process groups), so that the process can join another layout."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    get_moe_layer_wise_logging_tracker().clear()
    RotaryEmbedding.forward.cache_clear()
    YarnRotaryEmbedding.forward.cache_clear()
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
