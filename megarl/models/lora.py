"""LoRA adapters on the Megatron model through megatron-bridge's PEFT (``megatron.bridge.peft.lora.LoRA``).

The base weights are frozen (``requires_grad=False``: the DDP grad buffers and the optimizer hold
the adapters only); each targeted linear gets ``W x + (alpha / rank) * B(A(x))`` with ``A``
xavier-initialised and ``B`` zero, so a fresh adapter leaves the model's outputs unchanged.
Adapters export in HF PEFT names (``...q_proj.lora_A.weight``; the bridge splits ``linear_qkv``'s
``B`` into q/k/v and repeats its ``A``), which is what SGLang's ``--enable-lora`` serves.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields
from typing import Iterable

from megarl.fields import check_bounds, setting

# Megatron GPT linear names a LoRA can target -> the HF module names of the same weights (what
# SGLang's --lora-target-modules and a PEFT adapter_config.json name). The router is targetable but
# left out of the defaults (its LoRA changes routing; SGLang serves no adapter on the gate).
MEGATRON_TO_HF = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q_proj": ("q_proj",),
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
    "router": ("gate",),
}
EXPERT_TARGETS = ("linear_fc1", "linear_fc2")  # in an MoE layer these are the routed (and shared) experts'
SYNC_MODES = ("adapter", "merged")
# Adapters an engine batches at once (SGLang's --max-loras-per-batch; its LoRA buffers hold this many
# slots): the base (no adapter), the adapter being replaced (requests in flight) and the new one.
ENGINE_ADAPTER_SLOTS = 3


@dataclass(frozen=True)
class LoraConfig:
    """LoRA: train low-rank adapters on a frozen base (megatron-bridge PEFT) and sync only them."""

    enabled: bool = False  # false: full fine-tuning (every weight trains and syncs)
    rank: int = setting(16, ge=1)  # adapter rank, > 0
    alpha: int = setting(32, ge=1)  # output scale alpha / rank
    dropout: float = setting(0.0, ge=0, lt=1)  # on the adapter input, in training
    # Megatron linear names (or fnmatch patterns over full module names); the router is left out by default
    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # adapter (engines load each version as an adapter) | merged (full weights, sync.transport)
    sync: str = setting("adapter", choices=SYNC_MODES)

    @classmethod
    def when_enabled(cls, lora) -> LoraConfig | None:
        """The config's ``lora`` section (this class, a DictConfig of it or a plain mapping, as a trainer
        checkpoint's ``config.yaml`` holds it) as this class with ``target_modules`` a tuple; None when
        it is not enabled. A key out of its range, or targets that name no Megatron linear
        (:data:`MEGATRON_TO_HF`) -> ValueError naming the key."""
        if not lora.enabled:
            return None
        keys = {f.name: lora[f.name] if not isinstance(lora, cls) else getattr(lora, f.name) for f in fields(cls)}
        typed = cls(**dict(keys, target_modules=tuple(keys["target_modules"])))
        check_bounds(typed, "lora.")
        typed.check_targets()
        return typed

    def check_targets(self) -> None:
        """``target_modules`` name Megatron linears (:data:`MEGATRON_TO_HF`, or patterns ending in one)."""
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name at least one of " + ", ".join(MEGATRON_TO_HF))
        unknown = [t for t in self.target_modules if _leaf(t) not in MEGATRON_TO_HF]
        if unknown:
            raise ValueError(f"lora.target_modules: {unknown} are not Megatron linear names; known: "
                             + ", ".join(MEGATRON_TO_HF))

    def describe(self) -> str:
        """What a trainer checkpoint records of its adapters (and conversion checks settings against)."""
        return f"rank {self.rank}, alpha {self.alpha}, {list(self.target_modules)}"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def hf_target_modules(self) -> list[str]:
        """The HF module names of the targets (SGLang's ``--lora-target-modules``), sorted."""
        return sorted({hf for t in self.target_modules for hf in MEGATRON_TO_HF[_leaf(t)]})

    @property
    def targets_experts(self) -> bool:
        return any(_leaf(t) in EXPERT_TARGETS for t in self.target_modules)

    def peft(self):
        """megatron-bridge's ``LoRA`` for these settings: one adapter per expert (also for grouped
        experts on GPU, where the bridge's default shares one among a layer's experts)."""
        from megatron.bridge.peft.lora import LoRA

        return LoRA(target_modules=list(self.target_modules), dim=self.rank, alpha=self.alpha, dropout=self.dropout,
                    share_expert_adapters=False)


def _leaf(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def unmatched_targets(targets: Iterable[str], module_names: Iterable[str]) -> list[str]:
    """The targets that name no module of ``module_names`` (full dotted names), as megatron-bridge's
    matcher matches them: the leaf name equal, or the pattern matching the full name."""
    names = list(module_names)
    return [t for t in targets
            if not any(n.rsplit(".", 1)[-1] == t or fnmatch.fnmatch(n, t) for n in names)]


def apply_lora(chunks: list, settings: LoraConfig) -> list:
    """Freeze ``chunks`` (bare Megatron modules, before DDP) and add adapters to the targets.
    Raises ValueError naming targets that match no module of the model."""
    missing = unmatched_targets(settings.target_modules, (n for c in chunks for n, _ in c.named_modules()))
    if missing:
        raise ValueError(f"lora.target_modules: {missing} match no module of this model")
    return settings.peft()(chunks, training=True)


def is_adapter_key(key: str) -> bool:
    """Whether a parameter / state-dict key belongs to an adapter (megatron-bridge names them ``*.adapter.*``)."""
    return ".adapter." in key or key.startswith("adapter.")
