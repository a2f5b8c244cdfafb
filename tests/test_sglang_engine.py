"""One real SGLang server (CPU on machines without a GPU) for the whole module, checked against an
HF transformers forward pass over the same tokens: routing (Keep Routing), sampling masks and
masked log-probs (Keep Sampling Mask), pause/abort, bad prompts, weight versions, death and stop.
"""
import asyncio
import logging
import os
import signal
import time

import numpy as np
import psutil
import pytest
import torch

from megarl.models.tiny_moe import make_tiny_moe
from megarl.rollout.client import EngineError, PauseMode, SamplingParams, SGLangClient
from megarl.rollout.engine import EngineDiedError, EngineSettings, SGLangEngine
from megarl.rollout.sample import FinishReason

log = logging.getLogger(__name__)

LM_HEAD_SCALE = 25.0  # the random-init head gives near-uniform logits; scaled, top-p masks bite
LOGPROB_TOLERANCE = 1e-3
PROMPTS = ["3+4=", "9+9=", "0+1=", "7+2=", "5+5=", "1+8="]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny MoE checkpoint with its lm_head scaled by LM_HEAD_SCALE."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    weights["lm_head.weight"] = weights["lm_head.weight"] * LM_HEAD_SCALE
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    settings = EngineSettings(
        model_path=str(checkpoint), dtype="float32", max_total_tokens=4096, max_running_requests=1,
        log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"),
    )
    eng = SGLangEngine(settings)
    eng.start()
    log.info("SGLang server start-up: %.1f s", eng.startup_s)
    print(f"\n[measured] SGLang server start-up {eng.startup_s:.1f} s")
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def run_client(engine, body):
    """Run ``body(client)`` (a coroutine function) against the module's engine."""

    async def main():
        async with SGLangClient(engine.url, engine.model) as client:
            return await body(client)

    return asyncio.run(main())


def hf_forward(hf_model, token_ids):
    """HF logits [T, V] and per-layer router top-k ids [T, L, k] for ``token_ids``."""
    with torch.no_grad():
        out = hf_model(torch.tensor([token_ids]), output_router_logits=True)
    k = hf_model.config.num_experts_per_tok
    topk = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits], axis=1)
    return out.logits[0].float(), topk


def check_against_hf(sample, hf_model, with_mask=True):
    """Assert routing, mask membership and log-probs; returns (max |logprob diff|, routing rows compared)."""
    ids = sample.prompt_ids + sample.response_ids
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    logits, hf_topk = hf_forward(hf_model, ids[:-1])  # the last token is never fed: no routing row
    assert sample.routed_experts.dtype == np.int16
    assert sample.routed_experts.shape == (len(ids) - 1, hf_model.config.num_hidden_layers, hf_topk.shape[-1])
    np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), np.sort(hf_topk, -1))
    log_probs = torch.log_softmax(logits[p - 1 :], dim=-1)  # [R, V]: row i predicts response token i
    expected = np.empty(r, dtype=np.float64)
    for i, token in enumerate(sample.response_ids):
        if with_mask:
            kept = torch.from_numpy(sample.sampling_mask.row(i).astype(np.int64))
            assert token in set(kept.tolist()), f"token {token} at position {i} outside its mask"
            expected[i] = (log_probs[i, token] - torch.logsumexp(log_probs[i, kept], dim=0)).item()
        else:
            expected[i] = log_probs[i, token].item()
    diff = np.abs(expected - sample.rollout_logprobs.astype(np.float64))
    assert diff.max(initial=0.0) < LOGPROB_TOLERANCE, f"log-prob differences {diff}"
    return diff.max(initial=0.0), sample.routed_experts.shape[0] * sample.routed_experts.shape[1]


def test_routing_mask_and_logprobs_equal_the_hf_forward(engine, hf_model, tokenizer):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, top_k=20)

    async def body(client):
        return await asyncio.gather(*(client.generate(tokenizer.encode(t), params, group_id=t) for t in PROMPTS))

    samples = run_client(engine, body)
    max_diff, rows = 0.0, 0
    mask_sizes = []
    for sample in samples:
        assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if sample.finish_reason is FinishReason.LENGTH:
            assert len(sample.response_ids) == params.max_new_tokens
        else:
            assert sample.response_ids[-1] == tokenizer.eos_token_id
        assert (sample.model_version == 0).all() and (sample.loss_mask == 1).all()
        mask_sizes += np.diff(sample.sampling_mask.offsets).tolist()
        d, n = check_against_hf(sample, hf_model)
        max_diff, rows = max(max_diff, d), rows + n
    assert 1 <= min(mask_sizes) and max(mask_sizes) <= params.top_k
    assert min(mask_sizes) < params.top_k, "top_p never cut below top_k: the mask test would be vacuous"
    print(f"\n[measured] {len(samples)} samples, {sum(len(s.response_ids) for s in samples)} tokens: "
          f"routing equal to HF top-k on {rows}/{rows} (token, layer) rows; "
          f"max |masked log-prob - HF| = {max_diff:.2e}; mask sizes {min(mask_sizes)}..{max(mask_sizes)}")


def test_without_metadata_logprobs_are_full_vocabulary(engine, hf_model, tokenizer):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20)

    async def body(client):
        return await client.generate(tokenizer.encode("2+3="), params, return_routed_experts=False,
                                     return_sampling_mask=False)

    sample = run_client(engine, body)
    assert sample.routed_experts is None and sample.sampling_mask is None
    ids = sample.prompt_ids + sample.response_ids
    logits, _ = hf_forward(hf_model, ids[:-1])
    log_probs = torch.log_softmax(logits[len(sample.prompt_ids) - 1 :], dim=-1)
    expected = log_probs[torch.arange(len(sample.response_ids)), torch.tensor(sample.response_ids)].numpy()
    np.testing.assert_allclose(sample.rollout_logprobs, expected, atol=LOGPROB_TOLERANCE, rtol=0)


def test_pause_with_abort_returns_partial_samples(engine, hf_model, tokenizer):
    # The engine runs one request at a time (max_running_requests=1), so when the first of these
    # finishes the second is mid-generation and the rest are still queued.
    params = SamplingParams(max_new_tokens=56, temperature=1.0, top_k=20, ignore_eos=True)

    async def body(client):
        tasks = [asyncio.create_task(client.generate(tokenizer.encode(t), params)) for t in PROMPTS]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.3)
        try:
            await asyncio.wait_for(client.pause_generation(PauseMode.ABORT), timeout=60)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        finally:
            await client.continue_generation()

    samples = run_client(engine, body)
    finished = [s for s in samples if s.finish_reason is FinishReason.LENGTH]
    aborted = [s for s in samples if s.finish_reason is FinishReason.ABORTED]
    assert len(finished) + len(aborted) == len(samples) and finished and aborted
    assert all(len(s.response_ids) == params.max_new_tokens for s in finished)
    partial = [s for s in aborted if 0 < len(s.response_ids) < params.max_new_tokens]
    assert partial, f"no partial sample among aborted lengths {[len(s.response_ids) for s in aborted]}"
    for sample in aborted:
        if sample.response_ids:
            check_against_hf(sample, hf_model)
    print(f"\n[measured] pause(abort): {len(finished)} finished, aborted lengths "
          f"{[len(s.response_ids) for s in aborted]}")


def test_engine_generates_after_pause_and_continue(engine, tokenizer):
    async def body(client):
        return await client.generate(tokenizer.encode("4+4="), SamplingParams(max_new_tokens=4, top_k=5))

    assert run_client(engine, body).finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_empty_prompt_is_a_clear_error(engine):
    async def body(client):
        return await asyncio.wait_for(client.generate([], SamplingParams(max_new_tokens=4, top_k=5)), 30)

    with pytest.raises(ValueError, match="empty prompt"):
        run_client(engine, body)


def test_prompt_longer_than_the_context_is_a_clear_error(engine, tokenizer):
    context = engine.model.context_length
    one_digit = tokenizer.encode("1", add_special_tokens=False)

    async def too_long_prompt(client):
        return await asyncio.wait_for(client.generate(one_digit * (context + 10), SamplingParams(max_new_tokens=4, top_k=5)), 60)

    async def too_long_with_response(client):
        return await asyncio.wait_for(client.generate(one_digit * (context - 2), SamplingParams(max_new_tokens=8, top_k=5)), 60)

    with pytest.raises(EngineError, match="longer than the model's context length"):
        run_client(engine, too_long_prompt)
    with pytest.raises(EngineError, match="maximum context length"):
        run_client(engine, too_long_with_response)
    assert engine.is_alive()


def test_out_of_vocabulary_prompt_is_rejected_before_it_reaches_the_engine(engine):
    async def body(client):
        return await client.generate([1, engine.model.vocab_size], SamplingParams(max_new_tokens=4, top_k=5))

    with pytest.raises(ValueError, match="outside the vocabulary"):
        run_client(engine, body)
    assert engine.is_alive()


def test_mask_without_finite_top_k_is_rejected(engine):
    async def body(client):
        return await client.generate([1, 5], SamplingParams(max_new_tokens=4))

    with pytest.raises(ValueError, match="finite top_k"):
        run_client(engine, body)


def test_weight_version_labels_every_generated_token(engine, tokenizer):
    async def body(client):
        await client.set_weight_version(7)
        try:
            version = await client.weight_version()
            sample = await client.generate(tokenizer.encode("6+1="), SamplingParams(max_new_tokens=6, top_k=5))
        finally:
            await client.set_weight_version(0)
        return version, sample, await client.weight_version()

    version, sample, restored = run_client(engine, body)
    assert version == 7 and restored == 0
    assert sample.model_version.tolist() == [7] * len(sample.response_ids)


def test_death_is_detected_and_stop_leaves_no_process(engine):
    """Last in the module: kills the server's leader like a crash would, then stops the rest."""
    pid = engine.pid
    pgid = os.getpgid(pid)
    group = [p for p in psutil.process_iter(["pid"]) if _pgid(p) == pgid]
    assert len(group) >= 2, "expected the server and its scheduler/detokenizer children"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.is_alive()
    with pytest.raises(EngineDiedError, match="exited with code -9"):
        engine.check_alive()
    engine.stop()
    psutil.wait_procs(group, timeout=30)
    assert [p.pid for p in psutil.process_iter(["pid"]) if _pgid(p) == pgid] == []


def _pgid(process):
    try:
        return os.getpgid(process.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None
