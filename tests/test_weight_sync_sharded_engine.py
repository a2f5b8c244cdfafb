"""Sharded resharding (``sync.transport=sharded``) from a TP2xEP2 trainer (Ray actors) into a real TP2+EP2
SGLang engine (CPU), on one machine: after the sync the engine's greedy tokens, routed experts and
log-probs equal an HF model built from the trainer's gathered export (and, bit for bit, the engine's after
a ``distributed`` sync of the same weights), and each engine rank received at most 0.55 of the model's
bytes (the senders' counters), against all of it through ``distributed`` in the same run. The same trained
group first goes through tests/test_weight_sync.py's checks of every layout (``distributed`` into every
engine rank, equal to HF, the disk recovery's checkpoint equal to the export bit for bit). The checkpoint
is tests/test_weight_sync.py's module fixture; the engine is the session's TP2+EP2 one.

Delta over sharded (``sync.delta``): after each delta-sharded sync (float32 trainer and engine, the
fixture's dtype) the engine's parameters (SGLang's own per-parameter hashes, ``/weights_checker``) equal
those a whole sync of the same weights gives (``distributed`` after each step, a whole ``sharded`` sync
after the last), over a step that changes most elements (each rank's buckets then travel whole) and steps
that change a few per cent (in float32: an update at ``TINY_LR`` moves only the elements it is larger
than half a unit in the last place of).
"""
import asyncio
import dataclasses

import httpx
import numpy as np
import pytest
import torch
from hf_oracle import hf_from_state, hf_greedy
from single_request import generate_one
from test_weight_sync import NEW_TOKENS, checkpoint, prompt, rl_steps, serve, settings, sync_and_compare, trained_group  # noqa: F401

from megarl.config import default_config
from megarl.config.components import optimizer_settings
from megarl.engines.client import SGLangClient
from megarl.engines.types import PauseMode, SamplingParams
from megarl.parallel import Layout
from megarl.sync import WeightSync

pytestmark = pytest.mark.usefixtures("ray_local")

TP2_EP2 = Layout(world_size=4, tp=2, ep=2, sequence_parallel=True)
# float32 rounding against HF's single-rank forward with the x25 head: 1.7e-6 to 2.0e-6 seen on the shared
# engine (its radix cache decides how much of the prompt a forward recomputes); a wrong or misplaced slice
# moves log-probs by orders of magnitude more, and they equal a `distributed` sync's bit for bit (below).
LOGPROB_TOLERANCE = 5e-6
TINY_LR = 1e-10  # the LR after the first step (float32: a few per cent of the elements change)
MOST_PER_ENGINE_RANK = 0.55  # of the model's bytes
# the delta syncs' buckets: 0.75 MiB of the model's 1.9 MB, three buckets in which the fallback step changes most
# elements (so each travels whole: smaller buckets may hold only weights it barely changes)
DELTA_BUCKET_MB = 0.75


@pytest.fixture(scope="module")
def sharded_engine(tp2_ep2_engine, checkpoint):  # noqa: F811
    """The session's engine of two ranks, TP2 with the experts split EP2 (megarl/platform/sglang_cpu.py);
    the module's syncs change its weights, and the checkpoint goes back in, as version 0, after it."""
    yield tp2_ep2_engine
    asyncio.run(serve(tp2_ep2_engine, checkpoint))


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
        sample = await generate_one(client, tokens, params, return_routed_experts=True, return_sampling_mask=False)
        return report, sample


def test_tp2_ep2_trainer_into_tp2_ep2_engine_sends_each_rank_its_slices(checkpoint, sharded_engine, prompt,  # noqa: F811
                                                                        tmp_path):
    group = trained_group(TP2_EP2, checkpoint)
    try:
        sync_and_compare(group, sharded_engine, checkpoint, prompt, tmp_path, version=13)
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


async def rank_hashes(client: SGLangClient) -> list[dict[str, str]]:
    """SGLang's hash of every parameter each engine rank holds (``/weights_checker``, action ``checksum``)."""
    async with httpx.AsyncClient(base_url=client.base_url, timeout=120) as http:
        response = await http.post("/weights_checker", json={"action": "checksum"})
    response.raise_for_status()
    return [rank["checksums"] for rank in response.json()["ranks"]]


def scheduled_group(hf_path: str):
    """A TP2xEP2 TrainerGroup whose first RL step runs at lr 1e-2 and every later one at ``TINY_LR``."""
    from megarl.trainer.actor import TrainerGroup
    from megarl.trainer.model_setup import ModelSettings

    group = TrainerGroup(TP2_EP2)
    model = ModelSettings("local", "alltoall", routing_replay=False, recompute="none", recompute_num_layers=None,
                          moe_aux_loss_coeff=0.0, reference=False)
    optimizer = dataclasses.replace(optimizer_settings(default_config(), lr=1e-2), min_lr=TINY_LR,
                                    lr_decay_style="linear", lr_decay_steps=1, lr_warmup_steps=0)
    asyncio.run(group.build(hf_path, optimizer, model))
    return group


async def delta_then_whole(engine, group, hf_path: str, tmp_path, steps: int) -> tuple[list, tuple]:
    """A delta-sharded sync of the initial weights and after each of ``steps`` RL steps, each followed by a
    whole ``distributed`` sync; then a whole ``sharded`` one. Returns per sync (report, hashes after the delta
    sync, after the whole one), and (report, hashes) of the last whole sharded sync."""
    def sync_settings(transport, delta):
        return dataclasses.replace(settings(tmp_path, transport, engine_tp=2, delta=delta), bucket_mb=DELTA_BUCKET_MB)

    async with SGLangClient(engine.url, engine.model) as client:
        delta = WeightSync(sync_settings("sharded", True), group, [client])
        whole = WeightSync(sync_settings("distributed", False), group, [client])
        results = []
        for version in range(40, 41 + steps):
            if version > 40:
                await asyncio.to_thread(rl_steps, group, TP2_EP2, hf_path, 1, version)
            report = await delta.update(version, PauseMode.ABORT)
            after_delta = await rank_hashes(client)
            await whole.update(version, PauseMode.ABORT)
            results.append((report, after_delta, await rank_hashes(client)))
        await delta.close()
        await whole.close()
        sharded = WeightSync(sync_settings("sharded", False), group, [client])
        last = await sharded.update(40 + steps, PauseMode.ABORT)
        await sharded.close()
        return results, (last, await rank_hashes(client))


def test_delta_sharded_syncs_leave_the_engine_as_whole_syncs_do(checkpoint, sharded_engine, tmp_path):  # noqa: F811
    group = scheduled_group(checkpoint)
    try:
        results, (whole, after_whole) = asyncio.run(delta_then_whole(sharded_engine, group, checkpoint, tmp_path, 3))
    finally:
        group.shutdown()
    previous = None
    for version, (report, after_delta, after_reference) in enumerate(results, start=40):
        assert report.transport == "sharded"
        assert after_delta == after_reference, f"version {version}: delta-synced parameters differ from a whole sync's"
        assert after_delta != previous, f"version {version}: the weights did not change (a vacuous comparison)"
        previous = after_delta
        print(f"[measured] version {version}: delta={report.delta} {report.bytes / 1e3:.1f} kB of "
              f"{report.dense_bytes / 1e3:.1f} kB, {report.changed_elements / report.elements:.4f} of the elements")
    assert after_whole == results[-1][1]  # the last delta sync's parameters, through a whole sharded sync
    first, most, *tiny = [report for report, _, _ in results]
    assert not first.delta and first.bytes == whole.bytes  # no baseline yet: whole
    assert most.delta and most.changed_elements > 0.5 * most.elements and most.bytes == whole.bytes  # fallback
    for report in tiny:
        assert report.delta and 0 < report.changed_elements < 0.1 * report.elements
        assert report.bytes < 0.25 * whole.bytes and report.bytes_per_engine_rank < 0.25 * whole.bytes_per_engine_rank
