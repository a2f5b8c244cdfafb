"""Per-token truth across a weight update in the middle of a request, for each way of handling the
requests in flight: every token carries the routes, sampling mask and log-prob it was sampled with,
and one forward with those routes replayed reproduces every token sampled by either weights.

On an SGLang CPU engine (the shared tiny one, and the TP2+EP2 one), 12 requests run with weights A;
part-way through, the engine pauses (``retract``, ``in_place`` or ``abort``), loads B = A + noise on
the routers (routes differ on most (token, layer) entries: checked) and continues. Against an HF
forward: the tokens sampled before the update have A's routes (exactly) and log-probs (within 1e-5);
those after it B's log-probs of a forward that replays the sample's routes, the prefix's rows being
A's (the engine replays them when it computes the prefix again), and B's own routing from there on.
After an ``in_place`` pause (B's weights over A's KV cache, which no single version reproduces) they
are marked in ``mixed_versions`` and left out of the trainer's loss. The Megatron trainer (one rank,
and TP2 x EP2 with sequence parallelism), with Keep Routing and Keep Sampling Mask, reproduces every
token of the ``retract`` and ``abort_resubmit`` samples within 1e-5: A's tokens under A, B's under B.
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

from megarl.engines.client import SGLangClient, mixed_version_tokens
from megarl.engines.types import GenerationOptions, PauseMode, SamplingParams
from megarl.parallel import Layout
from megarl.rollout.group import RolloutManager
from megarl.rollout.splice import splice_continuation
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.rewards import RewardScorer, arithmetic_reward
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching
from megarl.trainer.rl_batch import build_rl_batch

LOGPROB_TOLERANCE = 1e-5
NEW_TOKENS = 40
ATTEMPTS = 5
PAUSES = {"retract": PauseMode.RETRACT, "in_place": PauseMode.IN_PLACE, "abort_resubmit": PauseMode.ABORT}
# (engine fixture, its weights A) of each engine layout
ENGINES = {"tp1": ("tiny_engine", "tiny_checkpoint"), "tp2_ep2": ("tp2_ep2_engine", "sharp_checkpoint")}
CASES = [("tp1", "retract"), ("tp1", "in_place"), ("tp1", "abort_resubmit"), ("tp2_ep2", "retract"),
         ("tp2_ep2", "abort_resubmit")]
TRAINER_LAYOUTS = {"single": Layout(), "tp2_ep2": Layout(world_size=4, tp=2, ep=2, sequence_parallel=True)}


def noisy_copy(src: str, dst: Path) -> str:
    """B: the checkpoint ``src`` at ``dst`` with Gaussian noise of three times each router's spread on its weights."""
    from safetensors.torch import load_file, save_file

    for f in (p for p in Path(src).iterdir() if p.is_file()):
        shutil.copy(f, dst / f.name)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = w + 3 * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def weights(request, tmp_path_factory):
    """engine layout -> (A, B) checkpoint paths, made on first use."""
    made = {}

    def get(name: str) -> tuple[str, str]:
        if name not in made:
            a = request.getfixturevalue(ENGINES[name][1])
            made[name] = a, noisy_copy(a, tmp_path_factory.mktemp(f"noisy_{name}"))
        return made[name]
    return get


@pytest.fixture(scope="module")
def hf_models(weights):
    """engine layout -> (HF model A, HF model B), loaded on first use."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = tuple(hf_oracle.load_hf(path) for path in weights(name))
        return loaded[name]
    return get


@pytest.fixture(scope="module")
def spanning(request, weights, tokenizer, loop):
    """(engine layout, mode) -> the 12 samples of a group generated across the update, made on first use."""
    made = {}

    def get(name: str, mode: str) -> list[RolloutSample]:
        if (name, mode) not in made:
            engine = request.getfixturevalue(ENGINES[name][0])
            made[name, mode] = loop.run_until_complete(_samples_across_update(engine, tokenizer, *weights(name), mode))
        return made[name, mode]
    return get


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


async def _update_mid_generation(client, engine_url, manager, prompt, b_checkpoint, mode: str, delay: float):
    """One group generated with a pause + load of B (version 1) ``delay`` seconds after it runs."""
    task = asyncio.create_task(manager.generate_group(prompt, "g"))
    async for running, _ in engine_loads(engine_url):
        if running or task.done():
            break
    await asyncio.sleep(delay)
    await client.pause_generation(PAUSES[mode])
    try:
        await client.update_weights_from_disk(b_checkpoint, version=1, flush_cache=mode != "in_place")
    finally:
        await client.continue_generation()
    return (await asyncio.wait_for(task, timeout=120)).samples


async def _samples_across_update(engine, tokenizer, a_checkpoint: str, b_checkpoint: str,
                                 mode: str) -> list[RolloutSample]:
    """A group of 12 whose requests span the update of A to B (some of them), the engine back on A after."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, top_k=10, ignore_eos=True)
    async with SGLangClient(engine.url, engine.model) as client:
        manager = RolloutManager(client, tokenizer, RewardScorer(arithmetic_reward), GenerationOptions(params),
                                 samples_per_prompt=12)
        prompt = Prompt("2+5=", "7")
        t0 = time.monotonic()
        await manager.generate_group(prompt, "warm")
        delay = (time.monotonic() - t0) * 0.3
        try:
            for _ in range(ATTEMPTS):  # again, earlier or later, when the machine's load moved the pause off
                samples = await _update_mid_generation(client, engine.url, manager, prompt, b_checkpoint, mode,
                                                       delay)
                versions = [set(s.model_version.tolist()) for s in samples]
                if {0, 1} in versions:
                    return samples
                delay = delay / 2 if {0} in versions else delay * 1.5  # every request ended before it, or none began
                await client.update_weights_from_disk(a_checkpoint, version=0)
            raise AssertionError(f"no request spanned the weight update in {ATTEMPTS} attempts")
        finally:
            await client.update_weights_from_disk(a_checkpoint, version=0)


@pytest.mark.processes  # the engines, through ``spanning``
@pytest.mark.parametrize("name,mode", CASES)
def test_tokens_keep_the_routes_and_logprobs_they_were_sampled_with(name, mode, spanning, hf_models):
    samples = spanning(name, mode)
    hf_a, hf_b = hf_models(name)
    spanning_requests, differing, worst = 0, [], 0.0
    for s in samples:
        v, p, r = s.model_version, len(s.prompt_ids), len(s.response_ids)
        assert s.finish_reason is FinishReason.LENGTH and r == NEW_TOKENS and (np.diff(v) >= 0).all()
        before = int((v == 0).sum())  # tokens sampled under A; rows [0, p + before - 1) were fed under A
        ids = s.prompt_ids + s.response_ids
        routes = np.sort(s.routed_experts, -1)
        routes_a, logprobs_a = hf_forward(hf_a, ids)
        fed_a = p + before - 1 if before else 0
        np.testing.assert_array_equal(routes[:fed_a], routes_a[:fed_a], err_msg=f"{mode}: A tokens' routes")
        worst = max(worst, logprob_error(s, logprobs_a, range(before)))
        mixed = np.zeros(r, bool) if s.mixed_versions is None else s.mixed_versions
        if 0 < before < r:
            spanning_requests += 1
            differing.append((routes_a[:fed_a] != hf_forward(hf_b, ids)[0][:fed_a]).any(-1).mean())
        if mode == "in_place" and 0 < before < r:  # B's weights over A's cache: marked, none of A's tokens
            assert not mixed[:before].any() and mixed[before:].all(), f"mixed flags {mixed.astype(int)}"
            continue
        if before:
            assert not mixed.any()
        # B's tokens: B's forward over the prefix's own (A's) routes, B's own routing from the first token it fed
        own_b, logprobs_b = hf_oracle.replayed_forward(hf_b, ids, s.routed_experts)
        np.testing.assert_array_equal(routes[fed_a:], own_b[fed_a:], err_msg=f"{mode}: B tokens' routes")
        worst = max(worst, logprob_error(s, logprobs_b, range(before, r)))
    assert worst < LOGPROB_TOLERANCE, f"{name} {mode}: log-prob difference {worst}"
    assert spanning_requests and min(differing) > 0.5, f"A and B route alike on the A tokens: {differing}"
    if mode == "in_place":
        batch = build_rl_batch(samples, with_advantages=False)
        flagged = sum(int(s.mixed_versions.sum()) for s in samples if s.mixed_versions is not None)
        assert batch.mixed_tokens == flagged > 0 and not (batch.loss_mask.bool() & batch.mixed_versions).any()
    print(f"\n[measured] {name} {mode}: {spanning_requests} of {len(samples)} requests span the update; (token, layer) "
          f"routes of A tokens that B routes elsewhere: {min(differing):.0%}..{max(differing):.0%}; max |log-prob - "
          f"HF| {worst:.1e}")


def trainer_logprobs(rank, layout, jobs):
    """Per job (HF checkpoint, samples): each sample's response log-probs (float32 [R]) from one forward
    of the Megatron trainer holding that checkpoint, with the samples' routes and masks replayed; None
    off the last pipeline stage."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.rl_step import policy_logprobs

    settings = optimizer_settings(default_config(), lr=0.0)
    out = []
    for path, samples in jobs:
        trainable = build_trainable(path, layout, settings,
                                    ModelSettings(transformer_impl="local", routing_replay=True))
        batch = build_rl_batch(samples, with_advantages=False)
        flat = policy_logprobs(trainable.chunks, batch, batching=MicroBatching(max_tokens=256,
                                                                               vocab_size=read_hf_config(path).vocab_size,
                               keep_routing=True, sequence_parallel=layout.sequence_parallel))
        RouterReplay.clear_global_router_replay_instances()
        if flat is None:
            return None
        at = [int(c) + len(s.prompt_ids) - 1 for c, s in zip(batch.cu_seqlens[:-1], samples)]
        out.append([flat[a:a + len(s.response_ids)].numpy() for a, s in zip(at, samples)])
    return out


@pytest.mark.processes  # the engines, through ``spanning``, and the trainer's ranks
@pytest.mark.parametrize("layout", list(TRAINER_LAYOUTS))
def test_the_trainer_reproduces_every_token_of_a_request_continued_across_the_update(layout, spanning, weights,
                                                                                       ray_local):
    jobs, checks = [], []
    for name, mode in CASES:
        if mode == "in_place":
            continue
        samples = spanning(name, mode)
        for version, path in enumerate(weights(name)):
            jobs.append((path, samples))
            checks.append((name, mode, version))
    per_rank = run_ranks(trainer_logprobs, TRAINER_LAYOUTS[layout], jobs)
    results = next(r for r in per_rank if r is not None)
    worst: dict[tuple[str, str], float] = {}
    for (name, mode, version), (_, samples), logprobs in zip(checks, jobs, results):
        for s, trainer in zip(samples, logprobs):
            tokens = s.model_version == version
            diff = float(np.abs(trainer[tokens] - s.rollout_logprobs[tokens]).max(initial=0.0))
            worst[name, mode] = max(worst.get((name, mode), 0.0), diff)
    assert max(worst.values()) < LOGPROB_TOLERANCE, f"trainer {layout}: |trainer - engine| {worst}"
    print(f"\n[measured] trainer {layout}: max |trainer - engine| log-prob over every token "
          + ", ".join(f"{n} {m} {w:.1e}" for (n, m), w in worst.items()))


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
