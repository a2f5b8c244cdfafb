"""The per-token metadata of a step (routes, sampling masks, log-probs, versions): its bytes at each stage of
its route from the engines to a trainer rank (docs/architecture.md, "The metadata's route") and the CPU
seconds each stage costs, on the path megarl takes (``new``: the engines' binary answers) and on SGLang's
JSON answers (``old``), from the rates ``tools/bench/metadata.py`` measured.

Bytes a step are upper bounds: every sample of the step (``rollout.prompts_per_step`` x
``rollout.samples_per_prompt``) at its longest (``rollout.max_prompt_tokens`` + ``rollout.max_new_tokens``),
routes for every position but the last (``rollout.keep_routing``: ``model.arch.num_layers`` x ``moe_topk``
ids, as SGLang reports every decoder layer), a sampling mask of ``rollout.top_k`` ids on every response
token (``rollout.keep_sampling_mask``). A stage's seconds are its bytes times the CPU seconds a byte the
bench measured for it (:data:`RATES`, its command inside); ``decode``, ``buffer``, ``batch`` and
``transfer`` run in the driver, ``rank_input`` on each trainer rank (its share of the step).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megarl.planner.arch import Arch

RATES = Path(__file__).with_name("metadata_rates.json")  # written by tools/bench/metadata.py --rates
STAGES = ("response", "decode", "buffer", "batch", "transfer", "rank_input")
DRIVER = ("decode", "buffer", "batch", "transfer")

_PER_POSITION = 8 + 8 + 4 + 4 + 4 + 8  # tokens, targets int64; loss mask, log-probs, staleness; mask offsets int64
_PER_RESPONSE_TOKEN = 4 + 4 + 4 + 1  # log-prob, version, mask offset, loss mask (a sample's arrays)


@dataclass(frozen=True)
class MetadataPath:
    """One path's bytes and CPU seconds a step at each stage, and the driver's seconds."""

    bytes: dict[str, int]
    seconds: dict[str, float]

    @property
    def driver_seconds(self) -> float:
        return sum(self.seconds[s] for s in DRIVER)


@dataclass(frozen=True)
class MetadataPlan:
    """The step's metadata on megarl's path (``new``) and on SGLang's JSON answers (``old``)."""

    samples: int
    tokens: int  # prompt + response tokens of the step, at most
    new: MetadataPath
    old: MetadataPath
    rates_command: str

    @property
    def driver_ratio(self) -> float:
        """new / old driver seconds a step."""
        return self.new.driver_seconds / self.old.driver_seconds if self.old.driver_seconds else 1.0


def expert_id_bytes(num_experts: int) -> int:
    """Bytes of one expert id in the engines' binary answers (uint8 up to 256 experts, then int16, int32)."""
    return 1 if num_experts <= 256 else 2 if num_experts <= 32768 else 4


@dataclass(frozen=True)
class Width:
    """What sets the metadata's bytes a token: routed layers, experts a token and in all, the vocabulary."""

    num_layers: int
    topk: int
    num_experts: int
    vocab_size: int

    @classmethod
    def of(cls, arch: Arch) -> Width:
        return cls(arch.num_layers, arch.moe_topk, arch.num_experts, arch.vocab_size)


def bytes_per_sample(path: str, width: Width, prompt: int, response: int, top_k: int, routes: bool) -> dict[str, int]:
    """Bytes at each stage (:data:`STAGES`) of one sample of ``prompt`` + ``response`` tokens on ``path`` (old,
    new), a sampling mask of ``top_k`` ids a response token (0: none)."""
    ids = (prompt + response - 1) * width.num_layers * width.topk if routes else 0
    digits = len(str(width.vocab_size - 1)) + 1  # a JSON id and its comma
    if path == "old":  # base64 int32 routes; JSON mask rows and log-probs; int16 routes after the client
        response_bytes = ids * 16 // 3 + response * (top_k * digits + 60)
        sample = ids * 2 + response * (top_k * 4 + _PER_RESPONSE_TOKEN)
        batch = ids * 2 + response * top_k * 8 + (prompt + response) * _PER_POSITION
    else:
        size = expert_id_bytes(width.num_experts)
        response_bytes = ids * size + response * (top_k * 4 + 1 + 4 + 4 + digits)
        sample = ids * size + response * (top_k * 4 + _PER_RESPONSE_TOKEN)
        batch = ids * size + response * top_k * 4 + (prompt + response) * _PER_POSITION
    return {"response": response_bytes, "decode": sample, "buffer": sample, "batch": batch, "transfer": batch,
            "rank_input": batch}


def read_rates(path: Path = RATES) -> dict:
    """The measured rates: ``{"command": ..., "old"|"new": {stage: CPU seconds a byte}}``."""
    rates = json.loads(path.read_text())
    for name in ("old", "new"):
        missing = [s for s in STAGES[1:] if s not in rates.get(name, {})]
        if missing:
            raise ValueError(f"{path}: no {name} rate for {', '.join(missing)}; rerun {rates.get('command')}")
    return rates


def metadata_plan(arch: Arch, rollout, dp: int = 1, rates: dict | None = None) -> MetadataPlan:
    """The step's metadata for ``rollout`` (the recipe's ``rollout`` section) on a trainer of ``dp`` data-parallel
    ranks (each rank's ``rank_input`` is its share)."""
    rates = read_rates() if rates is None else rates
    samples = rollout.prompts_per_step * rollout.samples_per_prompt
    top_k = rollout.top_k if rollout.keep_sampling_mask and rollout.top_k > 0 else 0
    paths = {}
    for name in ("new", "old"):
        one = bytes_per_sample(name, Width.of(arch), rollout.max_prompt_tokens, rollout.max_new_tokens, top_k,
                               rollout.keep_routing)
        step = {stage: int(n) * samples for stage, n in one.items()}
        step["rank_input"] = int(np.ceil(step["rank_input"] / dp))
        seconds = {stage: step[stage] * rates[name][stage] for stage in STAGES[1:]}
        paths[name] = MetadataPath(step, seconds)
    return MetadataPlan(samples, samples * (rollout.max_prompt_tokens + rollout.max_new_tokens), paths["new"],
                        paths["old"], rates["command"])
