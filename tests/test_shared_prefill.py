"""A prompt that a batch sends several times (a GRPO group's) is prefilled once before the batch
(``SGLangClient(shared_prefill_min_tokens=...)``): against the same batch sent without that, on the
session's shared engine (prefix cache on, the cache flushed between the two), the copies are served
from the prefix cache while the samples stay what the engine generates without it (tokens, log-probs,
routed experts, sampling masks), and the prefill's prompt tokens are counted."""
import asyncio

import numpy as np
import pytest

from megarl.engines.client import SGLangClient, shared_prompts
from megarl.engines.types import EngineError, SamplingParams

# ids no other test's prompt starts with, so the shared engine's cache holds none of their prefixes
SHARED = [211, 17, 53, 99, 140, 8, 77, 31, 62, 150]  # 10 tokens, sent three times
SHORT = [213, 44, 45]  # 3 tokens, sent twice: under the threshold below
ALONE = [217, 12, 90, 91, 3, 5, 7, 9, 11, 13]  # 10 tokens, sent once
BATCH = [SHARED, SHORT, SHARED, ALONE, SHORT, SHARED]
MIN_TOKENS = 8


@pytest.mark.unit
def test_shared_prompts_are_the_first_copies_of_repeated_long_prompts():
    assert shared_prompts(BATCH, MIN_TOKENS) == [0]
    assert shared_prompts(BATCH, 1) == [0, 1]
    assert shared_prompts(BATCH, 0) == []  # off
    assert shared_prompts([ALONE, SHARED], 1) == []  # nothing repeated
    with pytest.raises(ValueError, match="shared_prefill_min_tokens must be >= 0"):
        SGLangClient("http://127.0.0.1:1", None, shared_prefill_min_tokens=-1)


def generate(engine, min_tokens: int, prompts=BATCH):
    """The samples of ``prompts`` as one batch from a fresh client, after flushing the engine's cache."""
    async def main():
        async with SGLangClient(engine.url, engine.model, shared_prefill_min_tokens=min_tokens) as client:
            await client.flush_cache()
            return await client.generate_batch(prompts, SamplingParams(max_new_tokens=4, temperature=0.0, top_k=5,
                                                                       ignore_eos=True),
                                               group_ids=[str(i) for i in range(len(prompts))])

    return asyncio.run(main())


def test_copies_read_the_prefilled_prompt_and_sample_the_same(tiny_engine):
    alone, shared = generate(tiny_engine, 0), generate(tiny_engine, MIN_TOKENS)
    assert [s.cached_tokens for s in alone] == [0] * len(BATCH)  # one batch: every copy computed its prompt
    n = len(SHARED)
    # the prefill computed SHARED (its tokens count as the first copy's), every copy then read it but its last
    # token; the short prompt and the lone one were computed as before
    assert [s.prefill_tokens for s in shared] == [2 * n, 3, n, n, 3, n]
    assert [s.cached_tokens for s in shared] == [n - 1, 0, n - 1, 0, 0, n - 1]
    for a, b in zip(alone, shared):
        assert a.response_ids == b.response_ids
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)  # the cached prefix's routes included
        np.testing.assert_array_equal(a.sampling_mask.ids, b.sampling_mask.ids)
        np.testing.assert_array_equal(a.sampling_mask.offsets, b.sampling_mask.offsets)


def test_a_shared_prompt_longer_than_the_context_is_the_engines_error(tiny_engine):
    too_long = [5] * (tiny_engine.model.context_length + 1)
    with pytest.raises(EngineError, match="HTTP 400"):
        generate(tiny_engine, MIN_TOKENS, [too_long, too_long])
