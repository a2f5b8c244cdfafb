"""Layouts and where ranks meet, imported by models/, trainer/, sync/ and the planner alike: a trainer
layout (``layout``), pipeline stages' layers (``stages``), rendezvous addresses and ports (``network``),
where a process sits (``places``) and the NCCL settings every process shares (``nccl``)."""
from megarl.parallel.layout import Layout
from megarl.parallel.network import free_port, node_address, pin_gloo_interface, rendezvous_host, role_resources
from megarl.parallel.stages import PipelineSplitError, stage_layer_counts, stage_layers

__all__ = ["Layout", "PipelineSplitError", "free_port", "node_address", "pin_gloo_interface", "rendezvous_host",
           "role_resources", "stage_layer_counts", "stage_layers"]
