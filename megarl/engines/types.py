"""The types engine code and its callers share: what is served (:class:`ServedModel`), how to
sample (:class:`SamplingParams`), a batch's result (:class:`BatchResult`), pause modes, LoRA adapter
labels and the engine errors. Nothing here talks to an engine; :mod:`megarl.engines.client` does.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megarl.models.hf_config import read_hf_config
from megarl.sample import RolloutSample


class EngineError(RuntimeError):
    """The engine rejected a request or could not be reached; the message says which and why."""


class EngineUnreachable(EngineError):
    """The engine could not be reached or dropped the connection (e.g. its process died)."""


class PauseMode(str, enum.Enum):
    """How ``/pause_generation`` treats running requests."""

    ABORT = "abort"  # return them now, finish_reason aborted, with the tokens generated so far
    RETRACT = "retract"  # put them back in the waiting queue (KV cache dropped, recomputed later)
    IN_PLACE = "in_place"  # freeze them with their KV cache until continue_generation


@dataclass(frozen=True)
class ServedModel:
    """What the client needs to know about the engine's checkpoint to validate and decode.

    num_layers: rows per token in the routing ([T-1, num_layers, topk]; SGLang reports every
    decoder layer). context_length: the most prompt + response tokens per sample.
    """

    vocab_size: int
    num_layers: int
    topk: int
    num_experts: int
    context_length: int

    @classmethod
    def from_hf_config(cls, model_path: str | Path) -> ServedModel:
        """Read ``config.json`` of an HF MoE checkpoint (:func:`megarl.models.hf_config.read_hf_config`)."""
        hf = read_hf_config(model_path)
        missing = hf.missing("vocab_size", "num_layers", "moe_topk", "num_experts", "context_length")
        if missing:
            raise ValueError(f"{hf.path} is not an MoE config: missing {', '.join(missing)}")
        return cls(vocab_size=hf.vocab_size, num_layers=hf.num_layers, topk=hf.moe_topk, num_experts=hf.num_experts,
                   context_length=hf.context_length)

    @property
    def routing_dtype(self) -> np.dtype:
        """int16 while expert ids fit, else int32 (docs/architecture.md, "The sample")."""
        return np.dtype(np.int16) if self.num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. top_k <= 0 means no top-k; a sampling mask needs a finite top_k. ``grammar``:
    SGLang sampling-param entries that constrain generation (``json_schema``, ``ebnf``, ``structural_tag``:
    name, value), sent as they are; the sampling mask and log-probs are then those of the constrained logits.
    ``priority``: the request's place in the engine's queue (SGLang's priority scheduling, which megarl's
    engines run with: a higher value is scheduled before the queued requests of a lower one, the running
    ones are never preempted for it; 0 is the engines' default)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: tuple[tuple[str, object], ...] = ()
    priority: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def to_json(self) -> dict:
        """SGLang's ``sampling_params`` (the priority goes beside them, in the request)."""
        out = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "top_k": self.top_k, "ignore_eos": self.ignore_eos}
        if self.stop:
            out["stop"] = list(self.stop)
        out.update(self.grammar)
        return out


@dataclass(frozen=True)
class GenerationOptions:
    """What a rollout asks of the engines besides the prompt, shared by the single-turn groups, the
    environment episodes and the agent gateway: ``params``, the sampling; ``routing``, each token's routed
    experts back (Keep Routing); ``sampling_mask``, each token's top-k / top-p mask back."""

    params: SamplingParams
    routing: bool = True
    sampling_mask: bool = True


@dataclass(frozen=True)
class BatchResult:
    """The samples of one ``generate_batch`` call, in prompt order, and how many prompts of it had
    to be resubmitted because their engine died."""

    samples: list[RolloutSample]
    resubmitted: int


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter loaded into the engine: the ``name`` requests give as ``lora_path``, and the
    weight ``version`` its tokens carry."""

    name: str
    version: int
