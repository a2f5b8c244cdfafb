"""The critic's scalar head: the policy's architecture with a one-output linear layer in place of the
vocabulary projection.

:func:`attach_value_head` replaces ``output_layer`` of the chunk that holds the last pipeline stage by
a :class:`ValueHead` (megatron-bridge's pre-wrap hook: after the bridge loaded the HF weights, before the
DDP wrap, so DDP and the optimizer see the head). The head is replicated on every TP rank (one output
cannot be split): under sequence parallelism it gathers the sequence first, with a backward that takes
this rank's slice of the gradient (every TP rank computes the same loss), so its weight's gradient needs
no TP reduction. The embedding is untied from the output (there is no vocabulary output any more), so
megatron's embedding-group gradient reduction leaves the head alone.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

HEAD_SEED = 20250  # the head's initial weights are drawn from this seed: the same on every rank


class ValueHead(MegatronModule):
    """hidden [s, b, h] (this TP rank's sequence slice under sequence parallelism) -> values [s, b, 1],
    whole sequence on every TP rank, in the model's dtype. Weight [1, h] drawn from N(0,
    ``config.init_method_std``), bias [1] zero. Called as megatron's output layer: returns (values, None)."""

    def __init__(self, config):
        super().__init__(config)
        generator = torch.Generator().manual_seed(HEAD_SEED)
        weight = torch.randn(1, config.hidden_size, generator=generator) * config.init_method_std
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        self.sequence_parallel = False  # GPTModel reads this of its output layer; the gather happens here

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def attach_value_head(chunks: list) -> list:
    """Give the bare model ``chunks`` (one per virtual stage) a :class:`ValueHead` where they hold the
    output layer and untie their embeddings; returns them. Raises ValueError for a model with
    multi-token-prediction modules (they share the output layer)."""
    for chunk in chunks:
        if getattr(chunk.config, "mtp_num_layers", None):
            raise ValueError("a critic cannot be built from a model with multi-token-prediction layers "
                             "(they predict through the output layer the value head replaces)")
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            # the device of any parameter: a tied output layer on the embedding's stage holds no weight
            device = next(chunk.parameters()).device
            chunk.output_layer = ValueHead(chunk.config).to(device)
    return chunks
