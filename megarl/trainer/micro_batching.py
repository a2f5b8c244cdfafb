"""How a step cuts its batch into micro-batches and runs the model on them: one value the driver builds
once a run (:func:`megarl.config.components.micro_batching`) and every trainer entry point takes
(``rl_step``, ``policy_logprobs``, ``sequence_kl``, ``critic_values``, ``critic_step``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatching:
    """The same on every rank and every step of a run."""

    max_tokens: int  # token budget of one micro-batch (packed: about this many real tokens)
    sequence_parallel: bool = False  # megatron's sequence parallelism (rows padded to a multiple of TP)
    pack: bool = True  # packed (THD) micro-batches, DP ranks balanced by tokens; False: right-padded rows
    pad_id: int = 0  # the token id padding positions hold
    vocab_size: int = 0  # the policy's output vocabulary (its log-probs); the critic does not read it
    keep_routing: bool = False  # replay the engine's routed experts (the model built with routing replay)
    temperature: float = 1.0  # the sampling temperature the policy's log-probs are taken at
