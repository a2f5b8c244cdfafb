"""How an SGLang engine is launched on a platform: its dtype, attention backend, GPUs and memory saver.

Every decision is a function of a :class:`megarl.platform.description.Platform`, so the CUDA ones are
evaluated (and tested) on machines without a GPU:

- dtype: a CUDA engine serves ``bfloat16`` or ``float16`` only. On Hopper SGLang attends with FA3, whose
  kernels take fp16, bf16 and fp8_e4m3 only (sgl-kernel's flash_ops), and SGLang's Triton fused MoE
  computes an fp32 model in fp16 (``compute_type`` in
  ``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py``): an fp32 engine either fails to start
  or samples from another distribution than the fp32 trainer scores.
- attention backend: passed explicitly, the one SGLang itself picks for the GPU and the attention kind
  (``get_default_attn_backend`` in ``sglang/srt/arg_groups/model_override_base.py``, for megarl's case:
  no speculative decoding, no attention sinks), so the command line says what runs.
- GPUs of a colocated engine: engine ``e`` takes the trainer's devices from device 0, ``engine_tp`` each
  (:mod:`megarl.planner.placement`): at launch it is pinned to the node of the trainer ranks holding them and
  sees those GPUs alone, in rank order (its ``CUDA_VISIBLE_DEVICES``, :mod:`megarl.engines.pinning`), so its
  ``--base-gpu-id`` is 0 (Ray gives it no GPU of its own: the trainer ranks hold them).
- memory: a colocated CUDA engine is started with ``--enable-memory-saver`` (torch_memory_saver) so it
  can hand its weights and KV cache to the trainer around each step.
"""
from __future__ import annotations

from megarl.platform.description import Platform

CUDA_DTYPES = ("bfloat16", "float16")  # what SGLang's GPU attention and fused-MoE kernels compute in
MEMORY_SAVER = "torch_memory_saver"  # the module SGLang's --enable-memory-saver needs


def dtype_refusal(platform: Platform, dtype: str) -> str | None:
    """Why an engine on ``platform`` cannot serve ``dtype`` (a ``model.dtype`` name), None when it can."""
    if not platform.is_cuda or dtype in CUDA_DTYPES:
        return None
    return (f"SGLang's GPU kernels do not compute in {dtype}: its default attention on Hopper (FA3) takes fp16, "
            f"bf16 and fp8 only, and its Triton fused MoE computes a float32 model in float16, so the engine's "
            f"log-probs would not be the trainer's; train and serve in bfloat16 (model.dtype=bfloat16)")


def attention_backend(platform: Platform, mla: bool) -> str:
    """SGLang's own choice of attention backend on ``platform`` for an MHA (``mla`` False) or MLA model:
    FA3 on Hopper (sm90); on sm100 trtllm_mha for MHA, flashinfer for MLA; elsewhere flashinfer for MHA
    when installed, else triton. The CPU's is torch_native."""
    if not platform.is_cuda:
        return "torch_native"
    major = platform.capability[0]
    if major == 9:
        return "fa3"
    if major == 10:
        return "flashinfer" if mla else "trtllm_mha"
    if mla or not platform.has("flashinfer"):
        return "triton"
    return "flashinfer"


def memory_saver_refusal(platform: Platform) -> str | None:
    """Why colocated engines on ``platform`` cannot release their memory to the trainer, None when they can
    (or when there is none to release: on the CPU the engines and the trainer share host memory)."""
    if not platform.is_cuda or platform.has(MEMORY_SAVER):
        return None
    return (f"colocated engines release their weights and KV cache to the trainer with SGLang's "
            f"--enable-memory-saver, which needs {MEMORY_SAVER} ({platform.why_missing(MEMORY_SAVER)}); without "
            f"it the trainer runs out of memory: install torch-memory-saver or use placement=disaggregated")


def ipc_transport_refusal(platform: Platform, placement: str) -> str | None:
    """Why the ``tensor`` weight sync (CUDA IPC handles of the trainer's buffers) cannot reach engines
    placed ``placement`` on ``platform``, None when it can: on CUDA only a process that sees the
    sender's GPU opens its handle, and Ray gives each disaggregated engine its own GPUs
    (CUDA_VISIBLE_DEVICES) where SGLang fails with "Invalid device_uuid". On the CPU the buffers are
    in POSIX shared memory, which every process of the machine maps."""
    if not platform.is_cuda or placement == "colocated":
        return None
    return ("the tensor transport hands CUDA IPC handles of the trainer's GPU buffers to the engines, which only "
            "processes on the same GPUs can open, and disaggregated engines run on GPUs of their own; use "
            "sync.transport=distributed (NCCL) or placement=colocated")
