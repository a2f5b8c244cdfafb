"""Per-token truth across a weight update in the middle of a request, for each way of handling the
requests in flight: every token carries the routes, sampling mask and log-prob it was sampled with.

On the shared CPU engine, 12 requests run with weights A; part-way through, the engine pauses
(``retract``, ``in_place`` or ``abort``), loads B = A + noise on the routers (routes differ on most
(token, layer) entries: checked) and continues. Against an HF forward: the tokens sampled before the
update have A's routes (exactly) and log-probs (within 1e-5); those after it B's, or, after an
``in_place`` pause (B's weights over A's KV cache, which no single version reproduces), are marked in
``mixed_versions`` and left out of the trainer's loss.
"""
import asyncio
import shutil
import time
from pathlib import Path

import hf_oracle
import numpy as np
import pytest
import torch
from in_flight import engine_loads

from megarl.engines.client import mixed_version_tokens
from megarl.engines.types import PauseMode, SamplingParams
from megarl.rollout.group import RolloutManager
from megarl.rollout.splice import splice_continuation
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.rewards import arithmetic_reward
from megarl.trainer.rl_batch import build_rl_batch

LOGPROB_TOLERANCE = 1e-5
NEW_TOKENS = 40
ATTEMPTS = 5
PAUSES = {"retract": PauseMode.RETRACT, "in_place": PauseMode.IN_PLACE, "abort_resubmit": PauseMode.ABORT}


@pytest.fixture(scope="module")
def noisy_checkpoint(tiny_checkpoint, tmp_path_factory):
    """B: the tiny checkpoint with Gaussian noise of three times each router's spread on its weights."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path_factory.mktemp("tiny_moe_noisy")
    for f in (p for p in Path(tiny_checkpoint).iterdir() if p.is_file()):
        shutil.copy(f, dst / f.name)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = w + 3 * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoint, noisy_checkpoint):
    return hf_oracle.load_hf(tiny_checkpoint), hf_oracle.load_hf(noisy_checkpoint)


def hf_forward(model, ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """HF's top-k routes [T-1, L, k] (sorted per row) and log-probs [T-1, V] of one sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    routes = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits], axis=1)
    return np.sort(routes, -1), torch.log_softmax(out.logits[0].float(), -1)


def logprob_error(sample: RolloutSample, logprobs: torch.Tensor, tokens: range) -> float:
    """Largest |engine - HF| over response ``tokens``, HF's renormalised over each token's sampling mask."""
    p, worst = len(sample.prompt_ids), 0.0
    for i in tokens:
        kept = torch.from_numpy(sample.sampling_mask.row(i).astype(np.int64))
        row = logprobs[p - 1 + i]
        expected = (row[sample.response_ids[i]] - torch.logsumexp(row[kept], 0)).item()
        worst = max(worst, abs(expected - float(sample.rollout_logprobs[i])))
    return worst


async def _update_mid_generation(client, engine_url, manager, prompt, noisy_checkpoint, mode: str, delay: float):
    """One group generated with a pause + load of B (version 1) ``delay`` seconds after it runs."""
    task = asyncio.create_task(manager.generate_group(prompt, "g"))
    async for running, _ in engine_loads(engine_url):
        if running or task.done():
            break
    await asyncio.sleep(delay)
    await client.pause_generation(PAUSES[mode])
    try:
        await client.update_weights_from_disk(noisy_checkpoint, version=1, flush_cache=mode != "in_place")
    finally:
        await client.continue_generation()
    return (await asyncio.wait_for(task, timeout=120)).samples


@pytest.mark.parametrize("mode", list(PAUSES))
def test_tokens_keep_the_routes_and_logprobs_they_were_sampled_with(mode, engine, client, tokenizer, tiny_checkpoint,
                                                                    noisy_checkpoint, hf_models, loop):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, top_k=10, ignore_eos=True)
    manager = RolloutManager(client, tokenizer, arithmetic_reward, params, samples_per_prompt=12,
                             partial_rollout="abort_resubmit" if mode == "abort_resubmit" else "continue")
    prompt = Prompt("2+5=", "7")

    async def body():
        t0 = time.monotonic()
        await manager.generate_group(prompt, "warm")
        delay = (time.monotonic() - t0) * 0.3
        try:
            for _ in range(ATTEMPTS):  # again, earlier or later, when the machine's load moved the pause off
                samples = await _update_mid_generation(client, engine.url, manager, prompt, noisy_checkpoint, mode,
                                                       delay)
                versions = [set(s.model_version.tolist()) for s in samples]
                if {0, 1} in versions:
                    return samples
                delay = delay / 2 if {0} in versions else delay * 1.5  # every request ended before it, or none began
                await client.update_weights_from_disk(tiny_checkpoint, version=0)
            raise AssertionError(f"no request spanned the weight update in {ATTEMPTS} attempts")
        finally:
            await client.update_weights_from_disk(tiny_checkpoint, version=0)

    samples = loop.run_until_complete(body())
    hf_a, hf_b = hf_models
    spanning, differing, worst = 0, [], 0.0
    for s in samples:
        v, p, r = s.model_version, len(s.prompt_ids), len(s.response_ids)
        assert s.finish_reason is FinishReason.LENGTH and r == NEW_TOKENS and (np.diff(v) >= 0).all()
        before = int((v == 0).sum())  # tokens sampled under A; rows [0, p + before - 1) were fed under A
        ids = s.prompt_ids + s.response_ids
        routes = np.sort(s.routed_experts, -1)
        routes_a, logprobs_a = hf_forward(hf_a, ids)
        routes_b, logprobs_b = hf_forward(hf_b, ids)
        fed_a = p + before - 1 if before else 0
        np.testing.assert_array_equal(routes[:fed_a], routes_a[:fed_a], err_msg=f"{mode}: A tokens' routes")
        worst = max(worst, logprob_error(s, logprobs_a, range(before)))
        mixed = np.zeros(r, bool) if s.mixed_versions is None else s.mixed_versions
        if 0 < before < r:
            spanning += 1
            differing.append((routes_a[:fed_a] != routes_b[:fed_a]).any(-1).mean())
        if mode == "in_place" and 0 < before < r:  # B's weights over A's cache: marked, none of A's tokens
            assert not mixed[:before].any() and mixed[before:].all(), f"mixed flags {mixed.astype(int)}"
            continue
        if before:
            assert not mixed.any()
        np.testing.assert_array_equal(routes[fed_a:], routes_b[fed_a:], err_msg=f"{mode}: B tokens' routes")
        worst = max(worst, logprob_error(s, logprobs_b, range(before, r)))
    assert worst < LOGPROB_TOLERANCE, f"{mode}: log-prob difference {worst}"
    assert spanning and min(differing) > 0.5, f"A and B route alike on the A tokens: {differing}"
    if mode == "in_place":
        batch = build_rl_batch(samples, with_advantages=False)
        flagged = sum(int(s.mixed_versions.sum()) for s in samples if s.mixed_versions is not None)
        assert batch.mixed_tokens == flagged > 0 and not (batch.loss_mask.bool() & batch.mixed_versions).any()
    print(f"\n[measured] {mode}: {spanning} of {len(samples)} requests span the update; (token, layer) routes of "
          f"A tokens that B routes elsewhere: {min(differing):.0%}..{max(differing):.0%}; max |log-prob - HF| "
          f"{worst:.1e}")


@pytest.mark.unit
def test_mixed_tokens_run_from_an_in_place_version_change_to_the_next_recompute():
    entered_in_place = {1: True, 2: False, 3: True}
    versions = np.array([0, 0, 1, 1, 2, 2, 3], np.int32)
    assert mixed_version_tokens(versions, entered_in_place, cached_prefix=False).tolist() == [
        False, False, True, True, False, False, True]
    assert mixed_version_tokens(np.array([0, 0, 2], np.int32), entered_in_place, cached_prefix=False) is None
    # a request started under an in-place version that reused a cached prefix: maybe the old weights' cache
    assert mixed_version_tokens(np.array([1, 1, 2], np.int32), entered_in_place, cached_prefix=True).tolist() == [
        True, True, False]
    assert mixed_version_tokens(np.array([1, 1], np.int32), entered_in_place, cached_prefix=False) is None


def _sample(prompt, response, mixed=None, version=0):
    r = len(response)
    return RolloutSample(prompt_ids=list(prompt), response_ids=list(response), loss_mask=np.ones(r, np.uint8),
                         rollout_logprobs=np.full(r, -1.0, np.float32), model_version=np.full(r, version, np.int32),
                         routed_experts=None, sampling_mask=None, finish_reason=FinishReason.ABORTED, advantage=1.0,
                         mixed_versions=None if mixed is None else np.array(mixed, bool))


@pytest.mark.unit
def test_mixed_flags_survive_a_splice_and_leave_the_loss():
    prefix = _sample([1, 2], [3, 4])
    spliced = splice_continuation(prefix, _sample([1, 2, 3, 4], [5, 6, 7], mixed=[False, True, True], version=1))
    assert spliced.mixed_versions.tolist() == [False, False, False, True, True]
    assert splice_continuation(prefix, _sample([1, 2, 3, 4], [5])).mixed_versions is None
    with pytest.raises(ValueError, match="mixed_versions must be bool"):
        _sample([1], [2, 3], mixed=[True])
    batch = build_rl_batch([spliced, _sample([8], [9, 10])], with_advantages=False)
    # positions: spliced 0..5 (targets 2..7), then 6..7; response token i of spliced is at position 1 + i
    assert batch.mixed_versions.nonzero().flatten().tolist() == [4, 5] and batch.mixed_tokens == 2
    assert batch.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 1, 1]
    assert batch.select([1]).mixed_tokens == 0 and batch.select([0]).mixed_tokens == 2


@pytest.mark.unit
def test_kept_routes_replace_the_recomputed_rows_they_cover():
    from megarl.platform.sglang_retracted_routes import overlay_kept_routes

    kept = torch.arange(4).view(4, 1, 1)  # rows 0..3, captured before a retraction
    recomputed = torch.full((6, 1, 1), -1)  # rows 0..5 after it
    assert overlay_kept_routes(recomputed, kept, 0).flatten().tolist() == [0, 1, 2, 3, -1, -1]
    from_row_2 = torch.full((4, 1, 1), -1)  # a caller's start_len of 2: rows 2..5
    assert overlay_kept_routes(from_row_2, kept, 2).flatten().tolist() == [2, 3, -1, -1]
    assert overlay_kept_routes(torch.full((1, 1, 1), -1), kept, 5).flatten().tolist() == [-1]
