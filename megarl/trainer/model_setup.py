"""Build a trainable Megatron model for this rank: bridge model + DDP + optimizer + LR schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.models.bridge import MegatronModel, ModelSettings, build_megatron_model
from megarl.models.lora import LoraConfig
from megarl.parallel import Layout
from megarl.trainer.optimizer import OptimizerSettings, build_optimizer


@dataclass
class TrainableModel:
    model: MegatronModel
    optimizer: Any
    scheduler: Any
    lora: LoraConfig | None = None  # set when only adapters train (checkpoints then hold them alone)

    @property
    def chunks(self) -> list:
        return self.model.chunks


def build_trainable(hf_path: str, layout: Layout, settings: OptimizerSettings, model: ModelSettings,
                    value_head: bool = False) -> TrainableModel:
    """The model as ``model`` says (``value_head``: the critic's, :func:`megarl.models.bridge.build_megatron_model`;
    ``model.reference`` is the caller's to keep), its DDP and its optimizer and LR schedule on this rank."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    built = build_megatron_model(hf_path, layout, model, dtype=settings.dtype, ddp_config=ddp, value_head=value_head)
    # The schedules call this after the last backward: DP/EP gradient all-reduce, the TP all-reduce
    # of sequence-parallel norm weights, and the division by the global token count.
    get_model_config(built.chunks[0]).finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = build_optimizer(built.chunks, settings)
    return TrainableModel(built, optimizer, scheduler, model.lora)
