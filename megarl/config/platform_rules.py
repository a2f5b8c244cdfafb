"""What this machine cannot run, refused before a run starts anything: the layers ``model.transformer_impl``
builds, context parallelism, the engines' dtype, the colocated engines' memory release and the CUDA IPC
weight sync on a :class:`~megarl.platform.description.Platform`, and the settings SGLang's or megatron-core's
CPU paths cannot honour. The planner does not run these (it plans for other machines)."""
from __future__ import annotations

import os
from collections.abc import Mapping

from omegaconf import DictConfig

from megarl.config.errors import ConfigError, fail, one_line
from megarl.config.inputs import check_inputs
from megarl.config.schema import Placement, TransformerImpl
from megarl.engines.launch_plan import dtype_refusal, ipc_transport_refusal, memory_saver_refusal
from megarl.models.layers import choose_layers
from megarl.platform.description import Platform, detect


def chosen_layers(cfg: DictConfig, platform: Platform) -> str:
    """The layers ``model.transformer_impl`` builds on ``platform`` (:func:`megarl.models.layers.choose_layers`),
    its refusal as a config error."""
    try:
        return choose_layers(TransformerImpl(cfg.model.transformer_impl).value, platform)
    except ValueError as exc:
        raise ConfigError(one_line(str(exc))) from None


def check_context_parallel(cfg: DictConfig, platform: Platform) -> None:
    """``parallel.cp > 1`` needs transformer-engine's context-parallel attention: refused on a CPU
    ``platform`` and, on CUDA, with megatron's local layers (``model.transformer_impl=local``, or
    ``auto`` where transformer-engine does not import: the layer choice's own error,
    :func:`chosen_layers`); neither has a context-parallel path."""
    if cfg.parallel.cp <= 1:
        return
    if not platform.is_cuda:
        fail("parallel.cp", "context parallelism needs transformer-engine's attention (CUDA); "
             "megatron's local attention on CPU has no context-parallel path")
    if chosen_layers(cfg, platform) == "local":
        fail("parallel.cp", "context parallelism needs transformer-engine's attention; model.transformer_impl=local "
             "builds megatron's local attention, which has no context-parallel path: set model.transformer_impl="
             "transformer_engine (or auto)")


def refuse_on_platform(cfg: DictConfig, platform: Platform) -> None:
    """An RL run's engines on ``platform`` (:mod:`megarl.engines.launch_plan`): a dtype their kernels
    compute in, the colocated engines' memory release, CUDA IPC weight sync only between processes on
    the same GPUs."""
    why = dtype_refusal(platform, cfg.model.dtype)
    if why is not None:
        fail("model.dtype", f"{cfg.model.dtype} on {platform.device}: {why}")
    placement = Placement(cfg.placement).value
    if placement == "colocated" and (why := memory_saver_refusal(platform)) is not None:
        fail("placement", why)
    if cfg.sync.transport == "tensor" and (why := ipc_transport_refusal(platform, placement)) is not None:
        fail("sync.transport", f"tensor with placement={placement}: {why}")


def refuse_beyond_allocation(cfg: DictConfig, platform: Platform, environ: Mapping[str, str] | None = None) -> None:
    """The job's allocation as ``slurm/megarl.sbatch`` exports it (``environ``, default this process's):
    on CUDA, nodes of ``MEGARL_GPUS_PER_NODE`` GPUs must be ``cluster.gpus_per_node`` (every placement
    counts devices by it), and the layout must fit ``MEGARL_NUM_NODES`` nodes."""
    environ = os.environ if environ is None else environ
    gpus, nodes = _env_count(environ, "MEGARL_GPUS_PER_NODE"), _env_count(environ, "MEGARL_NUM_NODES")
    if platform.is_cuda and gpus and gpus != cfg.cluster.gpus_per_node:
        fail("cluster.gpus_per_node", f"is {cfg.cluster.gpus_per_node}, but this job's nodes have {gpus} GPUs each "
             f"(MEGARL_GPUS_PER_NODE): set cluster.gpus_per_node={gpus}")
    needed = cfg.topology.nodes
    if nodes and needed > nodes:
        fail("cluster.num_nodes", f"the layout needs {needed} nodes of {cfg.cluster.gpus_per_node} GPUs, this job has "
             f"{nodes} (MEGARL_NUM_NODES): submit it with slurm/submit.sh, which asks the planner")


def _env_count(environ: Mapping[str, str], name: str) -> int | None:
    """The count an environment variable of the job gives: ``N``, or SLURM's ``type:N`` (``--gpus-per-node=h100:8``);
    None when unset or empty; ConfigError naming the variable for anything else."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    count = value.rsplit(":", 1)[-1]
    if not count.isdigit():
        fail(name, f"{value!r} is not a count (N, or SLURM's type:N); slurm/megarl.sbatch sets it from the job")
    return int(count)


def refuse_what_is_not_built(cfg: DictConfig, platform: Platform | None = None) -> None:
    """``megarl.train``'s checks before it starts anything: the run's inputs (:func:`check_inputs`),
    what ``platform`` (default: this machine's) cannot run (:func:`refuse_on_platform`), then settings
    a run would otherwise ignore silently, refused until the code honours them (the planner still
    accepts them: big-model recipes plan with them)."""
    check_inputs(cfg)
    platform = detect() if platform is None else platform
    refuse_beyond_allocation(cfg, platform)
    chosen_layers(cfg, platform)
    if cfg.mode != "warmup":
        refuse_on_platform(cfg, platform)
    r = cfg.rollout
    if cfg.trainer.optimizer_cpu_offload and not platform.is_cuda:
        fail("trainer.optimizer_cpu_offload", "moves the Adam state from GPU to host memory with megatron-core's "
             "HybridDeviceOptimizer, which runs on CUDA streams; without a GPU the state is in host memory already: "
             "set it false")
    check_context_parallel(cfg, platform)
    if cfg.mode == "warmup":
        return
    if not platform.is_cuda:
        if r.engine_dp_attention:
            fail("rollout.engine_dp_attention", "SGLang's CPU attention backend cannot run DP attention "
                 "('TorchNativeAttnBackend' has no get_cpu_graph_seq_len_fill_value); it runs on GPU engines")
        lora = cfg.enabled_lora
        if lora is not None and lora.sync == "adapter" and lora.targets_experts:
            fail("lora.target_modules", "SGLang's CPU path cannot serve LoRA on the MoE layers' "
                 "linear_fc1/linear_fc2: "
                 "its LoRA MoE runs on the Triton fused-MoE kernels, whose config lookup fails without a GPU "
                 "(AttributeError: 'NoneType' object has no attribute 'replace', in fused_moe_triton_config.py); "
                 "target attention only (linear_qkv, linear_proj) or set lora.sync=merged")
        if r.engine_tp > 1 and cfg.sync.transport == "tensor":
            fail("sync.transport", "the tensor transport into an engine of several ranks fails on CPU (engine rank 1 "
                 "cannot open the bucket's shared-memory file); use sync.transport=distributed or rollout.engine_tp=1")
