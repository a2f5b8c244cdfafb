"""One real SGLang server (CPU on machines without a GPU) for the whole module, checked against an
HF transformers forward pass over the same tokens: routing (Keep Routing), sampling masks and
masked log-probs (Keep Sampling Mask), pause/abort, bad prompts, weight versions, death and stop.
The server runs without its tokenizer (a single-turn run's policy engine; the session's shared
engine keeps it), so every check here holds on that path too.
"""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pybase64
import pytest
import torch
from single_request import abort_request, generate_one

from megarl.engines.client import SGLangClient, decode_routed_experts
from megarl.engines.server import EngineSettings, EngineStartError, SGLangEngine
from megarl.engines.types import EngineError, PauseMode, SamplingParams, ServedModel
from megarl.sample import FinishReason, RolloutSample, SamplingMask

LM_HEAD_SCALE = 25.0  # the random-init head gives near-uniform logits; scaled, top-p masks bite
LOGPROB_TOLERANCE = 1e-3
CONFIG_EOS = 1  # config.json's and generation_config.json's EOS in the module's checkpoint; the tokenizer's is 2
PROMPTS = ["3+4=", "9+9=", "0+1=", "7+2=", "5+5=", "1+8="]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny MoE checkpoint with its lm_head scaled by LM_HEAD_SCALE."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny_moe_sharp")
    for f in Path(tiny_checkpoint).iterdir():
        shutil.copy(f, path / f.name)
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    weights["lm_head.weight"] = weights["lm_head.weight"] * LM_HEAD_SCALE
    save_file(weights, weights_file, metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):  # an EOS other than the tokenizer's
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, "eos_token_id": CONFIG_EOS}))
    return path


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    # One request at a time makes "mid-generation" observable for the pause tests (until_mid_generation);
    # no prefix cache (the session's shared engine keeps SGLang's default), so both paths serve the tests.
    settings = EngineSettings(
        model_path=str(checkpoint), dtype="float32", max_total_tokens=4096, max_running_requests=1, prefix_cache=False,
        tokenizer=False, log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"),
    )
    eng = SGLangEngine(settings)
    eng.start()
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


async def until_mid_generation(tasks):
    """Return while one of ``tasks`` is mid-generation: the engine runs one request at a time
    (max_running_requests=1), so a twelfth of the first request's duration after it finished, the
    next one is about a twelfth done (~5 of 56 tokens) and the rest are queued, at any engine speed,
    and still mid-way when the machine's load makes it run up to ~10x faster than the first (a third,
    then a sixth, were too little margin on a loaded machine: the next request had finished)."""
    t0 = time.monotonic()
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep((time.monotonic() - t0) / 12)


def hf_forward(hf_model, token_ids):
    """HF logits [T, V] and per-layer router top-k ids [T, L, k] for ``token_ids``."""
    with torch.no_grad():
        out = hf_model(torch.tensor([token_ids]), output_router_logits=True)
    k = hf_model.config.num_experts_per_tok
    topk = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in out.router_logits], axis=1)
    return out.logits[0].float(), topk


def check_against_hf(sample, hf_model, with_mask=True, temperature=1.0):
    """Assert routing, mask membership and log-probs of the temperature-scaled distribution;
    returns (max |logprob diff|, routing rows compared)."""
    ids = sample.prompt_ids + sample.response_ids
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    logits, hf_topk = hf_forward(hf_model, ids[:-1])  # the last token is never fed: no routing row
    assert sample.routed_experts.dtype == np.uint8  # the binary answer's ids: 8 experts fit uint8
    assert sample.routed_experts.shape == (len(ids) - 1, hf_model.config.num_hidden_layers, hf_topk.shape[-1])
    np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), np.sort(hf_topk, -1))
    log_probs = torch.log_softmax(logits[p - 1 :] / temperature, dim=-1)  # [R, V]: row i predicts token i
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


# --- decoding and validation, no server ---------------------------------------------------------

@pytest.mark.unit
def test_sampling_mask_csr_round_trip_and_validation():
    rows = [[5, 1, 9], [], [7]]
    mask = SamplingMask.from_rows(rows)
    assert mask.offsets.tolist() == [0, 3, 3, 4] and mask.ids.dtype == np.int32
    assert [mask.row(i).tolist() for i in range(mask.num_rows)] == rows
    with pytest.raises(ValueError, match="end at nnz=4"):
        SamplingMask(ids=mask.ids, offsets=np.array([0, 3, 3, 5], dtype=np.int32))
    with pytest.raises(ValueError, match="never decrease"):
        SamplingMask(ids=mask.ids, offsets=np.array([0, 3, 2, 4], dtype=np.int32))
    with pytest.raises(ValueError, match="int32"):
        SamplingMask(ids=mask.ids.astype(np.int64), offsets=mask.offsets)
    empty = SamplingMask.from_rows([])
    assert empty.offsets.tolist() == [0] and empty.ids.size == 0


@pytest.mark.unit
def test_routed_experts_decoding_checks_shape_and_range():
    model = ServedModel(vocab_size=16, num_layers=2, topk=2, num_experts=8, context_length=32)
    ids = np.arange(3 * 2 * 2, dtype=np.int32) % 8  # 4 tokens -> 3 rows
    decoded = decode_routed_experts(pybase64.b64encode(ids.tobytes()).decode(), num_tokens=4, model=model)
    assert decoded.dtype == np.int16 and decoded.shape == (3, 2, 2)
    np.testing.assert_array_equal(decoded.reshape(-1), ids)
    with pytest.raises(EngineError, match="expected"):
        decode_routed_experts(pybase64.b64encode(ids.tobytes()).decode(), num_tokens=5, model=model)
    with pytest.raises(EngineError, match="outside"):
        decode_routed_experts(pybase64.b64encode((ids + 8).tobytes()).decode(), num_tokens=4, model=model)
    with pytest.raises(EngineError, match="outside"):  # negative ids too
        decode_routed_experts(pybase64.b64encode((ids - 1).tobytes()).decode(), num_tokens=4, model=model)
    big = ServedModel(vocab_size=16, num_layers=2, topk=2, num_experts=40000, context_length=32)
    assert big.routing_dtype == np.int32


@pytest.mark.unit
def test_rollout_sample_rejects_inconsistent_shapes():
    ok = dict(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=np.ones(3, np.uint8),
              rollout_logprobs=np.zeros(3, np.float32), model_version=np.zeros(3, np.int32),
              routed_experts=np.zeros((4, 2, 2), np.int16), sampling_mask=SamplingMask.from_rows([[3], [4], [5]]),
              finish_reason=FinishReason.LENGTH)
    RolloutSample(**ok)
    with pytest.raises(ValueError, match="rollout_logprobs must be float32"):
        RolloutSample(**{**ok, "rollout_logprobs": np.zeros(3, np.float64)})
    with pytest.raises(ValueError, match=r"T-1=4"):
        RolloutSample(**{**ok, "routed_experts": np.zeros((5, 2, 2), np.int16)})
    with pytest.raises(ValueError, match="2 rows, response has 3"):
        RolloutSample(**{**ok, "sampling_mask": SamplingMask.from_rows([[3], [4]])})


@pytest.mark.unit
def test_settings_and_model_reading_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        EngineSettings(model_path=str(tmp_path))
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "num_hidden_layers": 2, "max_position_embeddings": 8}')
    with pytest.raises(ValueError, match="not an MoE config: missing .*num_experts_per_tok"):
        ServedModel.from_hf_config(tmp_path)


# --- one real server ------------------------------------------------------------------------------

def test_routing_mask_and_logprobs_equal_the_hf_forward(engine, hf_model, tokenizer):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, top_k=20)

    async def body(client):
        return await asyncio.gather(*(generate_one(client, tokenizer.encode(t), params, group_id=t) for t in PROMPTS))

    samples = run_client(engine, body)
    max_diff, rows = 0.0, 0
    mask_sizes = []
    for sample in samples:
        assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if sample.finish_reason is FinishReason.LENGTH:
            assert len(sample.response_ids) == params.max_new_tokens
        else:
            assert sample.response_ids[-1] in (tokenizer.eos_token_id, CONFIG_EOS)
        assert (sample.model_version == 0).all() and (sample.loss_mask == 1).all()
        mask_sizes += np.diff(sample.sampling_mask.offsets).tolist()
        d, n = check_against_hf(sample, hf_model)
        max_diff, rows = max(max_diff, d), rows + n
    assert 1 <= min(mask_sizes) and max(mask_sizes) <= params.top_k
    assert min(mask_sizes) < params.top_k, "top_p never cut below top_k: the mask test would be vacuous"
    print(f"\n[measured] {len(samples)} samples, {sum(len(s.response_ids) for s in samples)} tokens: "
          f"routing equal to HF top-k on {rows}/{rows} (token, layer) rows; "
          f"max |masked log-prob - HF| = {max_diff:.2e}; mask sizes {min(mask_sizes)}..{max(mask_sizes)}")


def test_logprobs_are_of_the_temperature_scaled_distribution(engine, hf_model, tokenizer):
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.95, top_k=20)

    async def body(client):
        return await generate_one(client, tokenizer.encode("6+3="), params)

    sample = run_client(engine, body)
    max_diff, _ = check_against_hf(sample, hf_model, temperature=params.temperature)
    with pytest.raises(AssertionError, match="log-prob differences"):  # the unscaled reference is far off
        check_against_hf(sample, hf_model, temperature=1.0)
    print(f"\n[measured] temperature 0.7: max |masked log-prob - HF(logits / 0.7)| = {max_diff:.2e}")


def test_without_metadata_logprobs_are_full_vocabulary(engine, hf_model, tokenizer):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20)

    async def body(client):
        return await generate_one(client, tokenizer.encode("2+3="), params, return_routed_experts=False,
                                     return_sampling_mask=False)

    sample = run_client(engine, body)
    assert sample.routed_experts is None and sample.sampling_mask is None
    ids = sample.prompt_ids + sample.response_ids
    logits, _ = hf_forward(hf_model, ids[:-1])
    log_probs = torch.log_softmax(logits[len(sample.prompt_ids) - 1 :], dim=-1)
    expected = log_probs[torch.arange(len(sample.response_ids)), torch.tensor(sample.response_ids)].numpy()
    np.testing.assert_allclose(sample.rollout_logprobs, expected, atol=LOGPROB_TOLERANCE, rtol=0)


def test_pause_with_abort_returns_partial_samples(engine, hf_model, tokenizer):
    params = SamplingParams(max_new_tokens=56, temperature=1.0, top_k=20, ignore_eos=True)

    async def body(client):
        tasks = [asyncio.create_task(generate_one(client, tokenizer.encode(t), params)) for t in PROMPTS]
        await until_mid_generation(tasks)
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
        else:  # aborted while queued: nothing ran, so no routing and an empty mask
            assert sample.routed_experts is None and sample.sampling_mask.num_rows == 0
    print(f"\n[measured] pause(abort): {len(finished)} finished, aborted lengths "
          f"{[len(s.response_ids) for s in aborted]}")


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.IN_PLACE])
def test_pause_that_keeps_requests_resumes_them_on_continue(engine, hf_model, tokenizer, mode):
    params = SamplingParams(max_new_tokens=56, temperature=1.0, top_k=20, ignore_eos=True)

    async def body(client):
        for _ in range(3):  # again when a loaded machine let every request end before the pause took hold
            tasks = [asyncio.create_task(generate_one(client, tokenizer.encode(t), params)) for t in PROMPTS[:3]]
            await until_mid_generation(tasks)
            try:
                await asyncio.wait_for(client.pause_generation(mode), timeout=60)
                done_at_pause = sum(t.done() for t in tasks)
                await asyncio.sleep(1.0)
                done_while_paused = sum(t.done() for t in tasks) - done_at_pause
            finally:
                await client.continue_generation()
            samples = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            if done_at_pause < len(tasks):
                break
        return done_at_pause, done_while_paused, samples

    done_at_pause, done_while_paused, samples = run_client(engine, body)
    assert done_at_pause < len(samples), "every request finished before the pause: nothing was paused"
    assert done_while_paused == 0, "a request finished while the engine was paused"
    for sample in samples:
        assert sample.finish_reason is FinishReason.LENGTH and len(sample.response_ids) == params.max_new_tokens
        check_against_hf(sample, hf_model)  # routing and log-probs stay exact across the pause


def test_abort_request_by_id_returns_the_partial_sample(engine, tokenizer):
    params = SamplingParams(max_new_tokens=56, temperature=1.0, top_k=20, ignore_eos=True)

    async def body(client):
        for attempt in range(3):  # again when a loaded machine let a second request end before the abort
            rids = [f"abort-me-{attempt}-{i}" for i in range(3)]
            tasks = [asyncio.create_task(generate_one(client, tokenizer.encode(t), params, rid=rid))
                     for t, rid in zip(PROMPTS, rids)]
            await until_mid_generation(tasks)
            for rid, task in zip(rids, tasks):
                if not task.done():
                    await abort_request(client, rid)
            samples = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            if sum(s.finish_reason is not FinishReason.ABORTED for s in samples) == 1:
                break
        return samples

    samples = run_client(engine, body)
    aborted = [s for s in samples if s.finish_reason is FinishReason.ABORTED]
    assert len(aborted) == len(samples) - 1, [s.finish_reason for s in samples]
    assert any(0 < len(s.response_ids) < params.max_new_tokens for s in aborted)
    for s in aborted:
        assert len(s.rollout_logprobs) == len(s.response_ids) == s.sampling_mask.num_rows < params.max_new_tokens


def test_engine_generates_after_pause_and_continue(engine, tokenizer):
    """Paused in each mode and continued, the engine answers as it did before the pause (greedy: the
    same tokens, the same finish)."""
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompt = tokenizer.encode("4+4=")
    kwargs = dict(return_routed_experts=False, return_sampling_mask=False)

    async def body(client):
        before = await generate_one(client, prompt, greedy, **kwargs)
        after = {}
        for mode in PauseMode:
            await client.pause_generation(mode)
            await client.continue_generation()
            after[mode] = await generate_one(client, prompt, greedy, **kwargs)
        return before, after

    before, after = run_client(engine, body)
    assert before.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert {mode: (s.response_ids, s.finish_reason) for mode, s in after.items()} == {
        mode: (before.response_ids, before.finish_reason) for mode in PauseMode}


def server_processes(engine) -> list[psutil.Process]:
    """The engine's server process and its children (scheduler, detokenizer)."""
    return [psutil.Process(engine.pid), *psutil.Process(engine.pid).children(recursive=True)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``processes`` so far."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def test_an_idle_engine_leaves_the_cores_alone(engine, tokenizer):
    """After a request, an idle engine's processes (server, scheduler, detokenizer) use almost no CPU:
    without ``--sleep-on-idle`` the scheduler polls in a busy loop, a whole core (~1 s of CPU a second)."""
    async def body(client):
        return await generate_one(client, tokenizer.encode("2+2="), SamplingParams(max_new_tokens=2, top_k=5))

    run_client(engine, body)
    processes = server_processes(engine)
    time.sleep(1.0)  # the request's tail (detokenizing, the idle-time bookkeeping) is done
    before = cpu_seconds(processes)
    time.sleep(3.0)
    used = cpu_seconds(processes) - before
    assert used < 0.6, f"the idle engine's {len(processes)} processes used {used:.2f} s of CPU in 3 s"


def test_a_paused_engine_leaves_the_cores_alone_and_wakes_for_the_next_call(engine, tokenizer):
    """Paused (a weight sync's window), the engine's processes use almost no CPU: SGLang's paused loop
    polls its sockets without a wait, a whole core, unless :mod:`megarl.engine_process.paused_wait`
    lets it sleep as an idle one does. Control calls and generation answer at once after it."""
    processes = server_processes(engine)

    async def body(client):
        await client.pause_generation(PauseMode.RETRACT)
        await asyncio.sleep(0.5)
        before = cpu_seconds(processes)
        await asyncio.sleep(3.0)
        used = cpu_seconds(processes) - before
        t0 = time.perf_counter()
        await client.begin_weight_update()
        await client.end_weight_update()
        await client.continue_generation()
        control_s = time.perf_counter() - t0
        sample = await generate_one(client, tokenizer.encode("3+4="), SamplingParams(max_new_tokens=2, top_k=5))
        return used, control_s, sample

    used, control_s, sample = run_client(engine, body)
    assert used < 0.6, f"the paused engine's {len(processes)} processes used {used:.2f} s of CPU in 3 s"
    assert control_s < 0.5, f"three control calls to a paused engine took {control_s:.2f} s"
    assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def cached_tokens_of_a_repeat(url: str, prompt_ids: list[int]) -> int:
    """SGLang's ``meta_info["cached_tokens"]`` of ``prompt_ids`` sent a second time, after the first finished."""
    for _ in range(2):
        body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 1}}
        response = httpx.post(f"{url}/generate", json=body, timeout=60)
        response.raise_for_status()
    return response.json()["meta_info"]["cached_tokens"]


def test_the_prefix_cache_is_the_settings_choice(engine, tiny_engine):
    prompt = [5, 9, 13, 17, 21, 25, 29, 33]
    assert cached_tokens_of_a_repeat(engine.url, prompt) == 0  # prefix_cache=False: --disable-radix-cache
    assert cached_tokens_of_a_repeat(tiny_engine.url, prompt) >= len(prompt) - 1  # SGLang's default: cached


def test_empty_prompt_is_a_clear_error(engine):
    async def body(client):
        return await asyncio.wait_for(generate_one(client, [], SamplingParams(max_new_tokens=4, top_k=5)), 30)

    with pytest.raises(ValueError, match="empty prompt"):
        run_client(engine, body)


def test_prompt_longer_than_the_context_is_a_clear_error(engine, tokenizer):
    context = engine.model.context_length
    one_digit = tokenizer.encode("1", add_special_tokens=False)

    async def too_long_prompt(client):
        params = SamplingParams(max_new_tokens=4, top_k=5)
        return await asyncio.wait_for(generate_one(client, one_digit * (context + 10), params), 60)

    async def too_long_with_response(client):
        params = SamplingParams(max_new_tokens=8, top_k=5)
        return await asyncio.wait_for(generate_one(client, one_digit * (context - 2), params), 60)

    with pytest.raises(EngineError, match="longer than the model's context length"):
        run_client(engine, too_long_prompt)
    with pytest.raises(EngineError, match="maximum context length"):
        run_client(engine, too_long_with_response)
    assert engine.is_alive()


def test_out_of_vocabulary_prompt_is_rejected_before_it_reaches_the_engine(engine):
    async def body(client):
        return await generate_one(client, [1, engine.model.vocab_size], SamplingParams(max_new_tokens=4, top_k=5))

    with pytest.raises(ValueError, match="outside the vocabulary"):
        run_client(engine, body)
    assert engine.is_alive()


def test_mask_without_finite_top_k_is_rejected(engine):
    async def body(client):
        return await generate_one(client, [1, 5], SamplingParams(max_new_tokens=4))

    with pytest.raises(ValueError, match="finite top_k"):
        run_client(engine, body)


def test_an_engine_without_its_tokenizer_refuses_stop_strings_and_grammars(engine):
    async def body(client):
        for params in (SamplingParams(max_new_tokens=4, top_k=5, stop=("</call>",)),
                       SamplingParams(max_new_tokens=4, top_k=5, grammar=(("ebnf", 'root ::= "a"'),))):
            with pytest.raises(ValueError, match="without its tokenizer"):
                await client.generate_batch([[1, 5]], params, group_ids=["g"])

    run_client(engine, body)


def test_an_engine_without_its_tokenizer_stops_at_the_tokenizers_eos(engine, tokenizer):
    """SGLang reads only config.json's EOS without the tokenizer; megarl's layer adds the tokenizer's."""
    assert tokenizer.eos_token_id != CONFIG_EOS
    params = SamplingParams(max_new_tokens=32, temperature=1.0, top_k=20)
    prompts = [tokenizer.encode(t) for t in PROMPTS] * 4

    async def body(client):
        return await client.generate_batch(prompts, params, group_ids=["g"] * len(prompts))

    samples = run_client(engine, body)
    ends = {s.response_ids[-1] for s in samples if s.finish_reason is FinishReason.STOP}
    assert tokenizer.eos_token_id in ends, f"no response ended at the tokenizer's EOS: {ends}"
    for s in samples:  # no response runs past either EOS
        assert not set(s.response_ids[:-1]) & {tokenizer.eos_token_id, CONFIG_EOS}


def test_weight_version_labels_every_generated_token(engine, tokenizer):
    async def body(client):
        await client.set_weight_version(7)
        try:
            version = await client.weight_version()
            sample = await generate_one(client, tokenizer.encode("6+1="), SamplingParams(max_new_tokens=6, top_k=5))
        finally:
            await client.set_weight_version(0)
        return version, sample, await client.weight_version()

    version, sample, restored = run_client(engine, body)
    assert version == 7 and restored == 0
    assert sample.model_version.tolist() == [7] * len(sample.response_ids)


@pytest.fixture(scope="module")
def checkpoint_42_43(checkpoint, tmp_path_factory):
    """The checkpoint with an lm_head whose logits are +s, -s, 0: greedy always picks 42 or 43."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny_moe_42_43")
    for f in checkpoint.iterdir():
        shutil.copy(f, path / f.name)
    weights = load_file(checkpoint / "model.safetensors")
    head = torch.zeros_like(weights["lm_head.weight"])
    head[42], head[43] = 1.0, -1.0
    weights["lm_head.weight"] = head
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_update_weights_from_disk_changes_outputs_and_versions(engine, checkpoint, checkpoint_42_43, tokenizer):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompt = tokenizer.encode("2+2=")

    async def body(client):
        kwargs = dict(return_routed_experts=False, return_sampling_mask=False)
        before = await generate_one(client, prompt, greedy, **kwargs)
        await client.update_weights_from_disk(checkpoint_42_43, version=5)
        updated = await generate_one(client, prompt, greedy, **kwargs)
        version = await client.weight_version()
        await client.update_weights_from_disk(checkpoint, version=0)
        restored = await generate_one(client, prompt, greedy, **kwargs)
        return before, updated, version, restored

    before, updated, version, restored = run_client(engine, body)
    assert version == 5 and updated.model_version.tolist() == [5] * 6
    assert not set(before.response_ids) <= {42, 43}, "the original weights already emit only 42/43"
    assert set(updated.response_ids) <= {42, 43} and len(updated.response_ids) == 6
    assert restored.response_ids == before.response_ids and (restored.model_version == 0).all()


def test_partial_rollout_across_a_weight_update_carries_both_versions(engine, checkpoint, checkpoint_42_43,
                                                                     tokenizer):
    # The request that is mid-generation at the pause is retracted, the weights change, and it
    # resumes on the new ones.
    greedy = SamplingParams(max_new_tokens=56, temperature=0.0, ignore_eos=True)

    async def body(client):
        kwargs = dict(return_routed_experts=False, return_sampling_mask=False)
        for _ in range(3):  # again when a loaded machine let every request end before the pause took hold
            tasks = [asyncio.create_task(generate_one(client, tokenizer.encode(t), greedy, **kwargs))
                     for t in PROMPTS[:4]]
            await until_mid_generation(tasks)
            await asyncio.wait_for(client.pause_generation(PauseMode.RETRACT), timeout=60)
            done_at_pause = sum(t.done() for t in tasks)
            try:
                await client.update_weights_from_disk(checkpoint_42_43, version=5)
            finally:
                await client.continue_generation()
            samples = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            await client.update_weights_from_disk(checkpoint, version=0)
            if done_at_pause < len(tasks):
                break
        return samples

    samples = run_client(engine, body)
    mixed = 0
    for sample in samples:
        versions = sample.model_version
        assert sample.finish_reason is FinishReason.LENGTH and set(versions.tolist()) <= {0, 5}
        assert (np.diff(versions) >= 0).all(), f"versions go back in time: {versions}"
        new_tokens = np.asarray(sample.response_ids)[versions == 5]
        assert set(new_tokens.tolist()) <= {42, 43}, "a token labelled version 5 was not made by it"
        mixed += int(versions[0] == 0 and versions[-1] == 5)
    assert mixed >= 1, f"no sample spans the update: {[s.model_version.tolist() for s in samples]}"
    counts = [[int((s.model_version == v).sum()) for v in (0, 5)] for s in samples]
    print(f"\n[measured] partial rollout: tokens of version 0 and 5 per sample {counts}")


@pytest.mark.processes
def test_start_failure_reports_the_server_log(checkpoint, tmp_path):
    """A server that exits during its start: here at its first argument check, before it imports SGLang
    (megarl.engine_process.model_registry reads ``--json-model-override-args``), so the failure costs no import."""
    settings = EngineSettings(model_path=str(checkpoint), extra_args=("--json-model-override-args", "no-such-json"),
                              log_path=str(tmp_path / "server.log"))
    engine = SGLangEngine(settings)
    with pytest.raises(EngineStartError, match="(?s)exited with code .*is not a JSON object: 'no-such-json'"):
        engine.start()
    assert engine.pid is None and servers_on_port(engine.port) == []


@pytest.mark.processes
def test_start_timeout_stops_the_server(checkpoint, tmp_path):
    settings = EngineSettings(model_path=str(checkpoint), startup_timeout_s=2.0, log_path=str(tmp_path / "server.log"))
    engine = SGLangEngine(settings)
    with pytest.raises(EngineStartError, match="not healthy after 2 s"):
        engine.start()
    assert engine.pid is None and servers_on_port(engine.port) == []


@pytest.mark.processes
def test_stopping_an_engine_actor_while_its_server_loads_cancels_the_start(checkpoint, tmp_path):
    """A run that fails or is interrupted while its engines load (minutes for a big checkpoint) stops
    them at once: ``EngineActor.stop`` makes the start under way give up (it held the actor's lock,
    so the stop used to wait for the server to become healthy first)."""
    from megarl.engines.actor import EngineActor

    actor = EngineActor(EngineSettings(model_path=str(checkpoint), log_path=str(tmp_path / "server.log")))
    outcome = []

    def start():
        try:
            outcome.append(actor.start())
        except EngineStartError as e:
            outcome.append(e)

    starter = threading.Thread(target=start)
    starter.start()
    deadline = time.monotonic() + 60
    while not servers_on_port(actor._settings.port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers_on_port(actor._settings.port), "the server never spawned"
    actor.stop()
    starter.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], EngineStartError), outcome
    assert "cancelled" in str(outcome[0])
    assert servers_on_port(actor._settings.port) == []
    assert not actor.info().alive


def test_death_is_detected_and_stop_leaves_no_process(engine):
    """Last in the module: kills the server's leader like a crash would, then stops the rest."""
    pid = engine.pid
    pgid = os.getpgid(pid)
    group = [p for p in psutil.process_iter(["pid"]) if _pgid(p) == pgid]
    assert len(group) >= 2, "expected the server and its scheduler/detokenizer children"
    scratch = Path(psutil.Process(pid).environ()["TMPDIR"])
    assert any(scratch.iterdir()), "SGLang's socket files belong in the server's own TMPDIR"
    segments = (scratch / "segments").read_text().split()  # its /dev/shm files, noted once healthy
    loads = [name for name in segments if name.startswith("sglang_loads_")]  # SGLang's load-report slots
    assert loads and all((Path("/dev/shm") / name).exists() for name in loads), segments
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.is_alive()
    assert engine._process.returncode == -9  # the server itself was killed, not ended by its owner
    engine.stop()
    psutil.wait_procs(group, timeout=30)
    assert [p.pid for p in psutil.process_iter(["pid"]) if _pgid(p) == pgid] == []
    assert not scratch.exists()
    assert not any((Path("/dev/shm") / name).exists() for name in segments)  # SGLang's unlink was SIGKILLed


def servers_on_port(port):
    """Pids of live processes started with ``--port <port>``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--port" in cmd and cmd[cmd.index("--port") + 1 :][:1] == [str(port)]:
            found.append(p.pid)
    return found


def _pgid(process):
    try:
        return os.getpgid(process.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None


@pytest.mark.processes
def test_orphaned_scratch_is_removed_and_a_live_or_starting_servers_is_kept(tmp_path, monkeypatch):
    import tempfile

    from megarl.engines.server import SCRATCH_PREFIX, remove_orphaned_scratch

    # a server killed with its owner left its TMPDIR; a running one's, and one not yet started, stay
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    dirs = {name: tmp_path / (SCRATCH_PREFIX + name) for name in ("dead", "live", "starting")}
    for path in dirs.values():
        path.mkdir()
        (path / "tmpsocket").touch()
    (dirs["dead"] / "server.pid").write_text(str(dead.pid))
    (dirs["live"] / "server.pid").write_text(str(os.getpid()))
    (tmp_path / "other").mkdir()
    # the /dev/shm files each server noted when healthy: the dead one's go with its directory
    noted = {name: f"megarl-test-{name}-{os.getpid()}-{dead.pid}" for name in ("dead", "live")}
    for name, segment in noted.items():
        Path("/dev/shm", segment).write_bytes(b"\0" * 64)
        (dirs[name] / "segments").write_text(segment + "\n")
    try:
        remove_orphaned_scratch()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["other", dirs["live"].name,
                                                                     dirs["starting"].name])
        assert not Path("/dev/shm", noted["dead"]).exists() and Path("/dev/shm", noted["live"]).exists()
    finally:
        for segment in noted.values():
            Path("/dev/shm", segment).unlink(missing_ok=True)


@pytest.mark.processes
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_sglangs_segments_of_a_gone_process_go_but_mapped_or_live_ones_stay():
    import mmap
    import uuid

    from megarl.engines.server import remove_orphaned_scratch
    from megarl.engines.shared_memory import SHARED_MEMORY

    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = uuid.uuid4().hex[:8]
    names = {"dead": f"sgl_shm_mq_{dead.pid}_{tag}", "mapped": f"sgl_shm_mq_{dead.pid}_{tag}m",
             "live": f"sgl_shm_mq_{os.getpid()}_{tag}"}  # SGLang's pid-stamped names
    for name in names.values():
        (SHARED_MEMORY / name).write_bytes(b"\0" * 4096)
    try:
        with open(SHARED_MEMORY / names["mapped"], "r+b") as f, mmap.mmap(f.fileno(), 0):
            remove_orphaned_scratch()
            assert {k for k, n in names.items() if (SHARED_MEMORY / n).exists()} == {"mapped", "live"}
        remove_orphaned_scratch()
        assert {k for k, n in names.items() if (SHARED_MEMORY / n).exists()} == {"live"}
    finally:
        for name in names.values():
            (SHARED_MEMORY / name).unlink(missing_ok=True)
