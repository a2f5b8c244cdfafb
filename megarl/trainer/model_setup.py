"""Build a trainable Megatron model for this rank: bridge model + DDP + optimizer + LR schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.models.bridge import MegatronModel, build_megatron_model
from megarl.models.lora import LoraConfig
from megarl.parallel import Layout
from megarl.trainer.optimizer import OptimizerSettings, build_optimizer


@dataclass(frozen=True)
class ModelSettings:
    """How a trainer rank builds its model (besides the layout and the optimizer)
    (:func:`megarl.config.components.model_settings`)."""

    transformer_impl: str  # auto | local | transformer_engine
    dispatcher: str  # alltoall | allgather
    routing_replay: bool  # Keep Routing: the model replays the engine's experts
    recompute: str  # none | selective | full
    recompute_num_layers: int | None
    moe_aux_loss_coeff: float
    reference: bool  # keep the starting weights as the KL reference (algorithm.kl_coef != 0)
    lora: LoraConfig | None = None  # train LoRA adapters on a frozen base (cfg.lora)
    moe_expert_bias_update_rate: float | None = None  # None: the checkpoint family's


@dataclass
class TrainableModel:
    model: MegatronModel
    optimizer: Any
    scheduler: Any
    lora: LoraConfig | None = None  # set when only adapters train (checkpoints then hold them alone)

    @property
    def chunks(self) -> list:
        return self.model.chunks


def build_trainable(hf_path: str, layout: Layout, settings: OptimizerSettings, *, transformer_impl: str = "auto",
                    dispatcher: str = "alltoall", routing_replay: bool = False,
                    moe_aux_loss_coeff: float = 0.0, recompute: str = "none",
                    recompute_num_layers: int | None = None, lora: LoraConfig | None = None,
                    value_head: bool = False, moe_expert_bias_update_rate: float | None = None) -> TrainableModel:
    """The model (``value_head``: the critic's, :func:`megarl.models.bridge.build_megatron_model`), its
    DDP and its optimizer and LR schedule on this rank."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    model = build_megatron_model(hf_path, layout, dtype=settings.dtype, transformer_impl=transformer_impl,
                                 dispatcher=dispatcher, ddp_config=ddp, routing_replay=routing_replay,
                                 moe_aux_loss_coeff=moe_aux_loss_coeff, recompute=recompute,
                                 recompute_num_layers=recompute_num_layers, lora=lora, value_head=value_head,
                                 moe_expert_bias_update_rate=moe_expert_bias_update_rate)
    # The schedules call this after the last backward: DP/EP gradient all-reduce, the TP all-reduce
    # of sequence-parallel norm weights, and the division by the global token count.
    get_model_config(model.chunks[0]).finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = build_optimizer(model.chunks, settings)
    return TrainableModel(model, optimizer, scheduler, lora)
