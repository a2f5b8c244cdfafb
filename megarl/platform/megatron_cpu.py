"""Work-arounds that let megatron-core 0.19 and megatron-bridge 0.6 run on CPU with gloo.

Each work-around is named after the failure it prevents and is applied only when CUDA is not
available, except those for an optional package megatron-bridge imports unconditionally
(:data:`FOR_MISSING_PACKAGE`: transformer-engine, modelopt), which a GPU without that package needs as
well; on a GPU with the GPU extras :func:`apply` does nothing. ``MEGARL_CPU_WORKAROUNDS_OFF=name,name``
turns single ones off, which the tests use to show that each one is needed.

Call :func:`apply` before megatron is used (it imports the megatron modules it patches), and wrap
optimizer construction and steps in :func:`cuda_tensor_type_scope`.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch

from megarl.platform.torch_compile import compile_at_first_call
from megarl.platform.workarounds import Workaround, apply_enabled, turned_off

OFF_ENV = "MEGARL_CPU_WORKAROUNDS_OFF"


def _cuda_rng_tracker_needs_cuda() -> None:
    """megatron's CudaRNGStatesTracker stores and forks torch.cuda RNG states; keep them on the CPU
    generator (the dropout/init RNG forks then work and stay reproducible)."""
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


class _NoStream:
    """Stands for a CUDA stream or event: on CPU every operation is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoStream() if name == "record_event" else None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _cuda_streams_and_current_device() -> None:
    """The MoE token dispatchers create torch.cuda.Stream/Event objects, and routers, RoPE and the
    schedules place buffers on ``torch.cuda.current_device()``."""
    stream = _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.default_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.is_current_stream_capturing = lambda: False


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "eye",
              "linspace", "as_tensor", "empty_strided", "zeros_like", "ones_like", "empty_like",
              "full_like", "randperm", "tril_indices", "triu_indices")


def _to_cpu_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuTorch(types.ModuleType):
    """``torch`` as megatron modules see it: tensor factories put ``device="cuda"`` on the CPU."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            factory = getattr(torch, name)

            def on_cpu(*args, _factory=factory, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                return _factory(*args, **kwargs)

            self.__dict__[name] = on_cpu

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _give_cpu_torch(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = _CPU_TORCH


class _CpuTorchImporter(importlib.abc.MetaPathFinder):
    """Gives every megatron module imported from now on the CPU ``torch`` (see _CpuTorch)."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("megatron."):
            return None
        later_finders = sys.meta_path[sys.meta_path.index(self) + 1:]
        spec = next((s for f in later_finders if hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module, _exec=exec_module):
            _exec(module)
            _give_cpu_torch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def _hardcoded_cuda_devices() -> None:
    """About 150 megatron sites create tensors with ``device="cuda"`` or call ``.cuda()`` (the
    default causal mask, loss scalars in the schedules, grad-norm buffers, p2p shapes)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            _give_cpu_torch(module)
    if not any(isinstance(f, _CpuTorchImporter) for f in sys.meta_path):
        sys.meta_path.insert(0, _CpuTorchImporter())
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _torch_norm_rejects_sequence_parallel() -> None:
    """The local (non-TE) layer spec uses WrappedTorchNorm, which asserts ``not sequence_parallel``,
    while MoE with TP > 1 requires sequence parallel. Build the torch norm anyway and tag its
    parameters ``sequence_parallel`` so their gradients are all-reduced over TP, as TE's are."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def build(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
              normalization="LayerNorm"):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = build


def _gloo_all_to_all_needs_int_splits() -> None:
    """The alltoall dispatcher keeps split sizes as tensors unless they are on CUDA; gloo's
    ``all_to_all_single`` then raises ``TypeError: incompatible function arguments``."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            return tensor.cpu().numpy() if as_numpy else tensor.cpu()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _gloo_uneven_all_gather() -> None:
    """TP x EP with the alltoall dispatcher all-gathers uneven token counts; gloo has no
    all-gather-v (``ProcessGroupGloo::allgather: invalid tensor size``). Emulate it and the matching
    reduce-scatter-v with one all-reduce of a zero-padded buffer."""
    import megatron.core.tensor_parallel.mappings as mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_v(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        start = sum(output_split_sizes[: group.rank()])
        full = input_.new_zeros([sum(output_split_sizes)] + list(input_.shape[1:]))
        full[start: start + output_split_sizes[group.rank()]] = input_
        torch.distributed.all_reduce(full, group=group)
        return full

    def reduce_scatter_v(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        start = sum(input_split_sizes[: group.rank()])
        full = input_.contiguous().clone()
        torch.distributed.all_reduce(full, group=group)
        return full[start: start + input_split_sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather_v
    mappings._reduce_scatter_along_first_dim = reduce_scatter_v


def _torch_adam_step_breaks_optimizer_load() -> None:
    """Without transformer-engine or apex the DistributedOptimizer runs torch's Adam, whose
    per-parameter state holds a ``step`` tensor. Loading a ``fully_reshardable`` optimizer
    checkpoint restores the step from the param groups and skips it among the parameter tensors,
    then looks it up there (``KeyError: 'step'``): pass it as a non-tensor, which the copy skips.
    The restored step is also one tensor shared by every parameter, which Adam then increments
    once per parameter (wrong bias correction after a resume): give each parameter its own."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    load_state_dict = DistributedOptimizer.load_state_dict

    def set_states_without_step(self, model_param, tensors):
        return set_states(self, model_param, {"step": None, **tensors})

    def load_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_step
    DistributedOptimizer.load_state_dict = load_with_own_steps


class _SourcePatcher(importlib.abc.MetaPathFinder):
    """Rewrites one import line in a module's source at import time."""

    def __init__(self, module: str, old: str, new: str):
        self.module, self.old, self.new = module, old, new

    def find_spec(self, name, path=None, target=None):
        if name != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        old, new = self.old, self.new

        class Loader(importlib.machinery.SourceFileLoader):
            def get_code(self, fullname):
                text = self.get_data(self.path).decode()
                if old not in text:
                    raise ImportError(f"megarl CPU work-around for {fullname} no longer matches its source")
                return compile(text.replace(old, new), self.path, "exec", dont_inherit=True)

        spec.loader = Loader(name, spec.origin)
        return spec


def _install_source_patch(module: str, old: str, new: str) -> None:
    if module in sys.modules:
        raise RuntimeError(f"{module} was imported before megarl.platform.megatron_cpu.apply()")
    if not any(isinstance(f, _SourcePatcher) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, _SourcePatcher(module, old, new))


class _AbsentClassMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentClassMeta(name, (cls,), {})


class _AbsentTEClass(metaclass=_AbsentClassMeta):
    """Any class of the absent transformer-engine: subclassable, never instantiable."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} needs transformer-engine, which is not installed")


class _AbsentTransformerEngine(types.ModuleType):
    """``transformer_engine.pytorch`` where TE is not installed: every attribute is an
    :class:`_AbsentTEClass` subclass, so class statements that derive from TE types still run."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentClassMeta(name, (_AbsentTEClass,), {})


TE_ABSENT = _AbsentTransformerEngine("transformer_engine.pytorch")


def _bridge_imports_transformer_engine() -> None:
    """megatron-bridge's LoRA layers import transformer_engine unconditionally and subclass its
    types at import time; importing ``megatron.bridge`` reaches them (``ModuleNotFoundError: No
    module named 'transformer_engine'``). Without TE, they get :data:`TE_ABSENT`."""
    _install_source_patch(
        "megatron.bridge.peft.lora_layers",
        "import transformer_engine.pytorch as te\n",
        "try:\n    import transformer_engine.pytorch as te\nexcept ImportError:\n"
        "    from megarl.platform.megatron_cpu import TE_ABSENT as te\n",
    )


def _lora_takes_mocked_te_for_present() -> None:
    """megatron-core's TE extension imports without TE and defines its classes over ``MagicMock``s
    (its own ``HAVE_TE`` is then False); megatron-bridge's PEFT utilities ask only whether those
    names imported, conclude that TE is present and test modules against the mocks (``TypeError:
    isinstance() arg 2 must be a type, a tuple of types, or a union`` as a LoRA is applied). They
    take megatron-core's answer instead."""
    _install_source_patch(
        "megatron.bridge.peft.utils",
        "HAVE_TE = all(\n",
        "HAVE_TE = __import__('megatron.core.extensions.transformer_engine', fromlist=['HAVE_TE']).HAVE_TE and all(\n",
    )


def _bridge_save_imports_modelopt() -> None:
    """``AutoBridge.save_hf_pretrained`` imports nvidia-modelopt unconditionally to ask whether the
    model is quantized (``ModuleNotFoundError: No module named 'modelopt'``); without modelopt it is not."""
    _install_source_patch(
        "megatron.bridge.models.conversion.auto_bridge",
        "        from modelopt.torch.quantization.utils import is_quantized\n",
        "        try:\n            from modelopt.torch.quantization.utils import is_quantized\n"
        "        except ImportError:\n            is_quantized = lambda _model: False\n",
    )


def _thd_rope_loops_over_sequences() -> None:
    """Without TE's fused kernel, megatron applies RoPE to a packed (THD) batch one sequence at a
    time, a Python loop that took half of a packed RL step of the tiny model. Without context
    parallelism the same rotation is one gather of each token's frequencies: positions restart at
    0 in every sequence, as megatron's loop does (``tests/test_packing.py`` checks equality)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd

    def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                  cp_group=None, multi_latent_attention=None):
        if cp_group is None or cp_group.size() != 1 or multi_latent_attention is not None \
                or freqs.size(0) == int(cu_seqlens[-1]):
            return original(t, cu_seqlens, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, cp_group,
                            multi_latent_attention)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        positions = torch.arange(t.size(0), device=t.device) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = apply_thd


WORKAROUNDS = (
    Workaround("bridge_imports_transformer_engine", "No module named 'transformer_engine'",
               _bridge_imports_transformer_engine),
    Workaround("lora_takes_mocked_te_for_present", "isinstance() arg 2 must be a type, a tuple of types, or a union",
               _lora_takes_mocked_te_for_present),
    Workaround("bridge_save_imports_modelopt", "No module named 'modelopt'", _bridge_save_imports_modelopt),
    Workaround("cuda_rng_tracker_needs_cuda", "Found no NVIDIA driver on your system", _cuda_rng_tracker_needs_cuda),
    Workaround("cuda_streams_and_current_device", "CUDA driver version is insufficient",
               _cuda_streams_and_current_device),
    Workaround("hardcoded_cuda_devices", "Found no NVIDIA driver on your system", _hardcoded_cuda_devices),
    Workaround("torch_norm_rejects_sequence_parallel", "sequence parallel not supported by torch LayerNorm",
               _torch_norm_rejects_sequence_parallel),
    Workaround("gloo_all_to_all_needs_int_splits", "all_to_all_single(): incompatible function arguments",
               _gloo_all_to_all_needs_int_splits),
    Workaround("gloo_uneven_all_gather", "ProcessGroupGloo::allgather: invalid tensor size", _gloo_uneven_all_gather),
    Workaround("torch_adam_step_breaks_optimizer_load", "KeyError: 'step'", _torch_adam_step_breaks_optimizer_load),
)

_applied: list[str] = []
# Work-arounds for a package megatron-bridge imports unconditionally: on a GPU too when it is missing.
FOR_MISSING_PACKAGE = {"bridge_imports_transformer_engine": "transformer_engine",
                       "lora_takes_mocked_te_for_present": "transformer_engine",
                       "bridge_save_imports_modelopt": "modelopt"}
OPTIMIZER_TYPE_SCOPE = "optimizer_requires_cuda_tensor_type"  # the name of cuda_tensor_type_scope


def _torch_compile_imports_inductor() -> None:
    """megatron decorates with ``torch.compile`` at import (megatron-core's ``jit_fuser`` kernels, its MoE
    inference router, megatron-bridge's diffusion attention), which imports TorchInductor
    (:mod:`megarl.platform.torch_compile`). On CPU none of them needs compiling: the ``jit_fuser`` kernels
    either do not run or trace to nothing (dynamo compiles no op of the MoE router's ``_apply_expert_bias``),
    so ``jit_fuser`` becomes megatron's own ``noop_decorator`` (its choice where torch.compile is missing; the
    kernels run eagerly), and other functions are compiled at their first call
    (:mod:`megarl.platform.torch_compile`). When megatron-core was imported before :func:`apply`, only the
    modules imported after it decorate with the no-op."""
    compile_at_first_call()
    if "megatron.core.jit" in sys.modules:
        sys.modules["megatron.core.jit"].disable_jit_fuser()
    else:
        _install_source_patch("megatron.core.jit", "\nenable_jit_fuser()\n", "\ndisable_jit_fuser()\n")


_TIMERS_WANDB_IMPORT = "try:\n    import wandb\nexcept ImportError:\n    wandb = None\n"


def _megatron_timers_import_wandb() -> None:
    """megatron-core's timers import wandb wherever it is installed (for a wandb writer, which megarl never
    gives them), CPU time in every process that imports megatron-core; megarl's own wandb
    tracker (:mod:`megarl.metrics.trackers`) imports it where it logs. The timers take ``wandb = None``, as
    where wandb is not installed; the process can still import wandb. When megatron-core was imported before
    :func:`apply`, nothing changes."""
    if "megatron.core.timers" not in sys.modules:
        _install_source_patch("megatron.core.timers", _TIMERS_WANDB_IMPORT, "wandb = None\n")


# Not failures but slow paths of megatron's pure-torch fallbacks on CPU, or imports they never use; tested for
# equal results. Applied first: they must come before anything imports megatron-core.
SPEEDUPS = (
    Workaround("torch_compile_imports_inductor", "TorchInductor imported by every process that imports megatron",
               _torch_compile_imports_inductor),
    Workaround("megatron_timers_import_wandb", "wandb imported by every process that imports megatron",
               _megatron_timers_import_wandb),
    Workaround("thd_rope_loops_over_sequences", "a Python loop over the sequences of a packed batch",
               _thd_rope_loops_over_sequences),
)


def apply() -> list[str]:
    """Apply every enabled work-around once (with CUDA, only those of :data:`FOR_MISSING_PACKAGE` whose
    package is missing); returns their names."""
    if not _applied:
        needed = SPEEDUPS + WORKAROUNDS if not torch.cuda.is_available() else tuple(
            w for w in WORKAROUNDS if w.name in FOR_MISSING_PACKAGE and importlib.util.find_spec(
                FOR_MISSING_PACKAGE[w.name]) is None)
        _applied.extend(apply_enabled(needed, OFF_ENV, also_known=[OPTIMIZER_TYPE_SCOPE]))
    return list(_applied)


_tensor_type = torch.Tensor.type


def _type_as_if_cuda(self, *args, **kwargs):
    if args or kwargs or self.device.type != "cpu":
        return _tensor_type(self, *args, **kwargs)
    return _tensor_type(self).replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def cuda_tensor_type_scope():
    """Megatron's optimizers accept only parameters whose ``.type()`` is ``torch.cuda.*Tensor``
    (``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...``). Inside this
    scope a CPU tensor reports its CUDA type name; outside it (and on GPU) nothing changes."""
    known = [OPTIMIZER_TYPE_SCOPE] + [w.name for w in WORKAROUNDS + SPEEDUPS]
    if torch.cuda.is_available() or OPTIMIZER_TYPE_SCOPE in turned_off(OFF_ENV, known):
        yield
        return
    torch.Tensor.type = _type_as_if_cuda
    try:
        yield
    finally:
        torch.Tensor.type = _tensor_type
