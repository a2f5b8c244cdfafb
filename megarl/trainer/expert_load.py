"""The expert load of a training step's tokens, counted on the trainer ranks: per MoE layer, the tokens
each expert received from the engine's routes (replayed, or compared with when routing is not replayed)
and from the trainer's own router on the same tokens (its top-k beside the replay, or its choice).

:class:`LoadCounter` accumulates this rank's valid tokens during the step's forwards
(:mod:`megarl.trainer.routing_replay` calls :meth:`LoadCounter.add`); :meth:`LoadCounter.reduced` sums
every rank's counts (each rank counts the tokens it routes: its DP share, its CP part, its sequence slice
under SP, the layers of its PP stage; without SP the TP ranks route the same tokens, counted once).
The metrics derived from the counts: :mod:`megarl.metrics.expert_load`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ExpertLoad:
    """Tokens per expert, float64 [L, E] (row ``n - 1``: model layer ``n``): ``engine`` (the engine's
    routes) and ``trainer`` (the trainer's router on the same tokens); ``layers``: the MoE layers counted."""

    engine: np.ndarray
    trainer: np.ndarray
    layers: list[int]

    def __add__(self, other: ExpertLoad) -> ExpertLoad:
        """The counts of two updates' tokens together."""
        return ExpertLoad(self.engine + other.engine, self.trainer + other.trainer,
                          sorted(set(self.layers) | set(other.layers)))


class LoadCounter:
    """This rank's counts during a step: ``counts`` float64 [2, L, E] (engine, trainer) on ``device``."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        self.num_experts = num_experts
        self.counts = torch.zeros(2, num_layers, num_experts, dtype=torch.float64, device=device)

    @classmethod
    def for_model(cls, chunks: list) -> LoadCounter:
        """A counter for the layers and experts of the model ``chunks`` (this rank's), on their device."""
        from megatron.core.utils import get_model_config

        from megarl.trainer.device import model_device

        config = get_model_config(chunks[0])
        return cls(config.num_layers, config.num_moe_experts, model_device(chunks))

    def add(self, layer_number: int, engine: torch.Tensor, trainer: torch.Tensor) -> None:
        """One forward's valid tokens of MoE layer ``layer_number``: the engine's and the trainer's expert ids,
        int [n, k] each."""
        with torch.no_grad():
            for side, ids in enumerate((engine, trainer)):
                self.counts[side, layer_number - 1] += torch.bincount(
                    ids.reshape(-1).long(), minlength=self.num_experts).to(self.counts)

    def reduced(self, sequence_parallel: bool) -> ExpertLoad:
        """Every rank's counts summed (a collective of all ranks), on every rank."""
        from megatron.core import parallel_state

        from megarl.trainer.device import collective_device

        total = self.counts.to(collective_device())
        torch.distributed.all_reduce(total)
        if not sequence_parallel:  # each TP rank routed the same tokens
            total /= parallel_state.get_tensor_model_parallel_world_size()
        engine, trainer = total.cpu().numpy()
        layers = [n + 1 for n in range(engine.shape[0]) if engine[n].sum() > 0]
        return ExpertLoad(engine=engine, trainer=trainer, layers=layers)

