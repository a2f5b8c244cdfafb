"""Sharded resharding (``sync.transport=sharded``) from a TP2xEP2 trainer (Ray actors) into a real TP2+EP2
SGLang engine (CPU), on one machine: after the sync the engine's greedy tokens, routed experts and
log-probs equal an HF model built from the trainer's gathered export (and, bit for bit, the engine's after
a ``distributed`` sync of the same weights), and each engine rank received at most 0.55 of the model's
bytes (the senders' counters), against all of it through ``distributed`` in the same run. The engine and
the checkpoint are tests/test_weight_sync.py's module fixtures.
"""
import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from hf_oracle import hf_from_state, hf_greedy
from test_weight_sync import LAYOUTS, NEW_TOKENS, checkpoint, prompt, settings, sharded_engine, trained_group  # noqa: F401

from megarl.engines.client import SGLangClient
from megarl.engines.types import PauseMode, SamplingParams
from megarl.sync import WeightSync

pytestmark = pytest.mark.usefixtures("ray_local")

LOGPROB_TOLERANCE = 2e-6
MOST_PER_ENGINE_RANK = 0.55  # of the model's bytes


def hf_routes(model, ids: list[int]) -> np.ndarray:
    """HF's top-k experts per fed token and layer, each row sorted: (tokens, layers, k)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return np.sort(np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits], 1), -1)


async def sync_and_generate(engine, group, transport: str, version: int, tmp_path, tokens: list[int]):
    """One sync through ``transport`` into ``engine``; (report, greedy sample with routed experts)."""
    async with SGLangClient(engine.url, engine.model) as client:
        sync = WeightSync(dataclasses.replace(settings(tmp_path, transport, engine_tp=2), bucket_mb=0.25), group,
                          [client])
        await sync.setup()
        try:
            report = await sync.update(version, PauseMode.ABORT)
        finally:
            await sync.close()
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        sample = await client.generate(tokens, params, return_routed_experts=True, return_sampling_mask=False)
        return report, sample


def test_tp2_ep2_trainer_into_tp2_ep2_engine_sends_each_rank_its_slices(checkpoint, sharded_engine, prompt,  # noqa: F811
                                                                        tmp_path):
    group = trained_group(LAYOUTS["tp2_ep2"], checkpoint)
    try:
        reference = asyncio.run(group.export_hf_state())
        hf = hf_from_state(checkpoint, reference, tmp_path)
        hf_tokens, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        whole, broadcast = asyncio.run(sync_and_generate(sharded_engine, group, "distributed", 30, tmp_path, prompt))
        report, sample = asyncio.run(sync_and_generate(sharded_engine, group, "sharded", 31, tmp_path, prompt))
    finally:
        group.shutdown()
    assert sample.response_ids == hf_tokens
    diff = max(abs(a - b) for a, b in zip(sample.rollout_logprobs.tolist(), hf_logprobs))
    assert diff < LOGPROB_TOLERANCE, f"engine vs HF log-probs differ by {diff}"
    assert sample.model_version.tolist() == [31] * NEW_TOKENS
    assert sample.response_ids == broadcast.response_ids  # the same weights as through distributed: bit for bit
    np.testing.assert_array_equal(sample.rollout_logprobs, broadcast.rollout_logprobs)
    np.testing.assert_array_equal(sample.routed_experts, broadcast.routed_experts)
    fed = prompt + sample.response_ids[:-1]
    np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), hf_routes(hf, fed))
    model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    assert whole.bytes_per_engine_rank == model_bytes
    assert report.transport == "sharded" and report.bytes_per_engine_rank <= MOST_PER_ENGINE_RANK * model_bytes
    print(f"\n[measured] bytes per engine rank, sharded / distributed: "
          f"{report.bytes_per_engine_rank / whole.bytes_per_engine_rank:.3f}; max |engine - HF| log-prob {diff:.1e}")
