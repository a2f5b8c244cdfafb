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

    transformer_impl: str = "auto"  # auto | local | transformer_engine
    dispatcher: str = "alltoall"  # alltoall | allgather
    routing_replay: bool = False  # Keep Routing: the model replays the engine's experts
    recompute: str = "none"  # none | selective | full
    recompute_num_layers: int | None = None
    moe_aux_loss_coeff: float = 0.0
    reference: bool = False  # keep the starting weights as the KL reference (algorithm.kl_coef != 0)
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


def build_trainable(hf_path: str, layout: Layout, settings: OptimizerSettings, model: ModelSettings = ModelSettings(),
                    value_head: bool = False) -> TrainableModel:
    """The model as ``model`` says (``value_head``: the critic's, :func:`megarl.models.bridge.build_megatron_model`;
    ``model.reference`` is the caller's to keep), its DDP and its optimizer and LR schedule on this rank."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    built = build_megatron_model(hf_path, layout, dtype=settings.dtype, transformer_impl=model.transformer_impl,
                                 dispatcher=model.dispatcher, ddp_config=ddp, routing_replay=model.routing_replay,
                                 moe_aux_loss_coeff=model.moe_aux_loss_coeff, recompute=model.recompute,
                                 recompute_num_layers=model.recompute_num_layers, lora=model.lora,
                                 value_head=value_head, moe_expert_bias_update_rate=model.moe_expert_bias_update_rate)
    # The schedules call this after the last backward: DP/EP gradient all-reduce, the TP all-reduce
    # of sequence-parallel norm weights, and the division by the global token count.
    get_model_config(built.chunks[0]).finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = build_optimizer(built.chunks, settings)
    return TrainableModel(built, optimizer, scheduler, model.lora)
