"""LoRA adapters' sizes: what the trainer trains and what an adapter sync moves (units: parameters, bytes).

megatron-bridge's ``LoRA`` (:mod:`megarl.models.lora`) puts one adapter on every Megatron linear a
target names (its leaf name, or an fnmatch pattern over the full module name): ``A [rank, in]`` and
``B [out, rank]``, in the model's dtype, ``rank * (in + out)`` parameters. The linears of a decoder
layer, with their HF tensors:

- attention: ``linear_qkv`` (the fused q/k/v: in = hidden, out = q + k + v) and ``linear_proj``
  (o_proj); with latent attention (MLA) ``linear_q_proj`` or ``linear_q_down_proj`` +
  ``linear_q_up_proj``, ``linear_kv_down_proj`` (kv_a_proj_with_mqa), ``linear_kv_up_proj``
  (kv_b_proj) and ``linear_proj``;
- MLP: ``linear_fc1`` (gate and up fused: out = 2 x ffn) and ``linear_fc2`` (down) of a dense
  layer; in a MoE layer of every routed expert (one adapter per expert: megarl's local experts
  get one each) and of the shared experts (one fused MLP of ``num_shared_experts x
  moe_ffn_hidden_size``); ``router`` (gate; in = hidden, out = experts).

The trainer shards every adapter as megatron-bridge's ``ParallelLinearAdapter`` does: a routed
expert's over EP x expert-TP, every other one over TP, both matrices (``B`` by its outputs; ``A`` by
the rank under a column-parallel base, by its inputs under a row-parallel one; the router's and the
replicated MLA down-projections' adapters are split too).

An adapter sync moves the adapters in HF PEFT form (``...q_proj.lora_A.weight``, what
:func:`megarl.models.bridge.export_adapter_state` returns and the engines load): a fused linear's
``B`` is split into its HF tensors and its ``A`` repeated for each (3 copies for q/k/v, 2 for
gate/up), so ``rank * (n_hf * in + out)`` parameters. The MTP modules get no adapters.

The engines' side (SGLang's LoRA memory pool) is :func:`megarl.planner.engine_memory.engine_adapter_params`.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from omegaconf import DictConfig

from megarl.config.errors import ConfigError
from megarl.models.lora import LoraConfig, unmatched_targets
from megarl.planner.arch import Arch
from megarl.planner.params import ShardedCount, count_params
from megarl.planner.units import dtype_bytes


@dataclass(frozen=True)
class AdaptedLinear:
    """One Megatron linear that gets an adapter."""

    name: str  # Megatron module name, e.g. decoder.layers.0.self_attention.linear_qkv
    in_features: int
    out_features: int
    hf_outs: tuple[int, ...]  # the HF tensors its B splits into on export (its A is repeated for each)
    expert: bool  # a routed expert's linear: split over EP x expert-TP in the trainer; otherwise over TP

    @property
    def target(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    def trainer_params(self, rank: int) -> int:
        return rank * (self.in_features + self.out_features)

    def synced_params(self, rank: int) -> int:
        return rank * (len(self.hf_outs) * self.in_features + self.out_features)


def layer_linears(arch: Arch, layer: int) -> list[AdaptedLinear]:
    """Every linear of decoder layer ``layer`` that a target could name, with its Megatron name."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    attn, mlp = f"decoder.layers.{layer}.self_attention", f"decoder.layers.{layer}.mlp"
    out: list[AdaptedLinear] = []

    def add(name: str, fan_in: int, hf_outs: tuple[int, ...], expert: bool = False) -> None:
        out.append(AdaptedLinear(name, fan_in, sum(hf_outs), hf_outs, expert))

    if arch.mla:
        qk_head = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        if arch.q_lora_rank:
            add(f"{attn}.linear_q_down_proj", h, (arch.q_lora_rank,))
            add(f"{attn}.linear_q_up_proj", arch.q_lora_rank, (heads * qk_head,))
        else:
            add(f"{attn}.linear_q_proj", h, (heads * qk_head,))
        add(f"{attn}.linear_kv_down_proj", h, (arch.kv_lora_rank + arch.qk_rope_head_dim,))
        add(f"{attn}.linear_kv_up_proj", arch.kv_lora_rank, (heads * (arch.qk_nope_head_dim + arch.v_head_dim),))
        add(f"{attn}.linear_proj", heads * arch.v_head_dim, (h,))
    else:
        q, kv = heads * arch.head_dim, arch.num_query_groups * arch.head_dim
        add(f"{attn}.linear_qkv", h, (q, kv, kv))
        add(f"{attn}.linear_proj", q, (h,))
    if not arch.is_moe_layer(layer):
        f = arch.ffn_hidden_size
        add(f"{mlp}.linear_fc1", h, (f, f))
        add(f"{mlp}.linear_fc2", f, (h,))
        return out
    add(f"{mlp}.router", h, (arch.num_experts,))
    f = arch.moe_ffn_hidden_size
    for e in range(arch.num_experts):
        add(f"{mlp}.experts.local_experts.{e}.linear_fc1", h, (f, f), expert=True)
        add(f"{mlp}.experts.local_experts.{e}.linear_fc2", f, (h,), expert=True)
    if arch.num_shared_experts:
        s = arch.num_shared_experts * f
        add(f"{mlp}.shared_experts.linear_fc1", h, (s, s))
        add(f"{mlp}.shared_experts.linear_fc2", s, (h,))
    return out


def _targeted(target: str, name: str) -> bool:
    """megatron-bridge's match: the leaf name equal, or the pattern matching the full name."""
    return name.rsplit(".", 1)[-1] == target or fnmatch.fnmatchcase(name, target)


def adapted_linears(arch: Arch, lora: LoraConfig, layers: list[int] | range | None = None) -> list[AdaptedLinear]:
    """The linears of ``layers`` (default: every decoder layer) that ``lora``'s targets name. Layer
    patterns (``*.layers.3.*``) are matched against the global layer index; Megatron names a
    layer by its index within its pipeline stage, which is the same with ``pp=1``."""
    layers = range(arch.num_layers) if layers is None else layers
    return [m for i in layers for m in layer_linears(arch, i)
            if any(_targeted(t, m.name) for t in lora.target_modules)]


def adapter_count(arch: Arch, lora: LoraConfig, layers: list[int] | range | None = None) -> ShardedCount:
    """The trainer's adapter parameters in ``layers``, split by how the trainer shards them."""
    linears = adapted_linears(arch, lora, layers)
    return ShardedCount(tp_split=sum(m.trainer_params(lora.rank) for m in linears if not m.expert),
                        experts=sum(m.trainer_params(lora.rank) for m in linears if m.expert))


@dataclass(frozen=True)
class LoraPlan:
    """The adapters of a LoRA recipe (``lora.enabled``). ``model_bytes``: the main model in
    ``model.dtype`` (what a full sync moves)."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    sync: str  # adapter | merged
    adapted_linears: int  # Megatron linears with an adapter (every routed expert's counted)
    trainer_params: int  # trainable parameters (each once, however the trainer shards them)
    synced_params: int  # in HF PEFT form (A repeated for each HF tensor of a fused linear)
    synced_tensors: int
    synced_bytes: int  # synced_params in model.dtype
    largest_tensor_bytes: int
    model_params: int
    model_bytes: int
    trainer_params_by_target: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Bytes of an adapter sync over a full model sync."""
        return self.synced_bytes / self.model_bytes

    @property
    def trainable_fraction(self) -> float:
        return self.trainer_params / self.model_params


def lora_plan(arch: Arch, cfg: DictConfig) -> LoraPlan | None:
    """The adapters' sizes for ``cfg`` (None when ``lora.enabled`` is false)."""
    lora = cfg.enabled_lora
    if lora is None:
        return None
    size = dtype_bytes(cfg.model.dtype)
    names = [m.name for i in range(arch.num_layers) for m in layer_linears(arch, i)]
    missing = unmatched_targets(lora.target_modules, names)
    if missing:  # what megarl.models.lora.apply_lora refuses when the trainer builds the model
        raise ConfigError(f"lora.target_modules: {missing} match no linear of this {arch.family} model")
    linears = adapted_linears(arch, lora)
    by_target: dict[str, int] = {}
    for m in linears:
        by_target[m.target] = by_target.get(m.target, 0) + m.trainer_params(lora.rank)
    synced = sum(m.synced_params(lora.rank) for m in linears)
    largest = max((lora.rank * max(m.in_features, *m.hf_outs) for m in linears), default=0)
    total = count_params(arch).total
    return LoraPlan(
        rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules, sync=lora.sync,
        adapted_linears=len(linears), trainer_params=sum(by_target.values()), synced_params=synced,
        synced_tensors=sum(2 * len(m.hf_outs) for m in linears), synced_bytes=synced * size,
        largest_tensor_bytes=largest * size, model_params=total, model_bytes=total * size,
        trainer_params_by_target=by_target,
    )
