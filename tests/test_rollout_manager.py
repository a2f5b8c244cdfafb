"""The rollout manager and multi-turn episodes against one real SGLang server (CPU here): counted
outcomes for bad prompts and failing rewards, abort_resubmit splicing checked against an HF forward
pass, and a calculator episode whose environment tokens carry loss_mask 0."""
import asyncio
import time

import hf_oracle
import numpy as np
import pytest
import torch
from in_flight import engine_loads

from megarl.engines.server import EngineSettings, SGLangEngine
from megarl.engines.types import GenerationOptions, PauseMode, SamplingParams
from megarl.rollout.env import CalculatorEnv, CalculatorError, EnvEpisodes, EnvStep, EpisodeLimits, calculate
from megarl.rollout.group import RolloutManager
from megarl.sample import FinishReason
from megarl.tasks.prompts import Prompt, chat_renderer
from megarl.tasks.reward_types import RewardInput
from megarl.tasks.rewards import RewardScorer, arithmetic_reward

LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    # Two requests at a time: a group of six runs in three waves, so a pause finds some samples
    # finished, some mid-generation and some not started.
    settings = EngineSettings(model_path=tiny_checkpoint, dtype="float32", max_total_tokens=4096,
                              max_running_requests=2, log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"))
    with SGLangEngine(settings) as eng:
        yield eng


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# --- prompts rendered by the chat template (task.chat_template) ------------------------------------

def test_rendered_prompts_are_tokenized_as_the_template_made_them(client, tokenizer, loop):
    """The template writes its own BOS: the engine gets exactly ``apply_chat_template``'s ids (one BOS;
    the tiny tokenizer adds another to plain text, which a rendered prompt must not get)."""
    messages = [{"role": "system", "content": "sums"}, {"role": "user", "content": "3+4="}]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers returns a BatchEncoding for one conversation
        expected = expected["input_ids"]
    text = chat_renderer(tokenizer)(messages)
    manager = RolloutManager(client, tokenizer, RewardScorer(arithmetic_reward),
                             GenerationOptions(SamplingParams(max_new_tokens=2, top_k=10)), samples_per_prompt=2,
                             add_special_tokens=False)
    (result,) = loop.run_until_complete(manager.generate_groups([Prompt(text, "7")], ["rendered"]))
    assert result.rejected is None and [s.prompt_ids for s in result.samples] == [expected] * 2
    assert expected.count(tokenizer.bos_token_id) == 1
    assert tokenizer(text)["input_ids"] != expected  # what the default tokenization would have sent


# --- counted outcomes -----------------------------------------------------------------------------

def test_bad_prompts_and_a_raising_reward_are_counted_and_the_batch_completes(client, tokenizer, loop):
    async def reward(inp: RewardInput) -> float:
        if inp.prompt.text == "1+8=":
            raise RuntimeError("the grader crashed")
        return await arithmetic_reward(inp)

    params = SamplingParams(max_new_tokens=6, top_k=10)
    manager = RolloutManager(client, tokenizer, RewardScorer(reward), GenerationOptions(params), samples_per_prompt=3)
    too_long = "1" * (client.model.context_length + 5)
    prompts = [Prompt("3+4=", "7"), Prompt("", "0"), Prompt(too_long, "1"), Prompt("1+8=", "9"),
               Prompt("1" * (client.model.context_length - 5), "1")]  # fits alone, not with 6 new tokens
    results = loop.run_until_complete(manager.generate_groups(prompts, [str(i) for i in range(5)]))

    assert [len(r.samples) for r in results] == [3] * 5  # every group completes with G samples
    good, empty, long_, raising, long_with_response = results
    assert good.rejected is None and good.errors == 0
    assert all(s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and s.reward in (0.0, 1.0)
               for s in good.samples)
    assert empty.rejected == "empty_prompt: the prompt has no text" and empty.errors == 3
    assert long_.rejected.startswith("too_long: prompt of ") and "exceeds the context length 64" in long_.rejected
    assert long_with_response.rejected.startswith("too_long:")
    for r in (empty, long_, long_with_response):
        assert all(s.finish_reason is FinishReason.ERROR and s.response_ids == [] and s.reward == 0.0
                   for s in r.samples)
    assert raising.rejected is None and raising.errors == 3
    assert all(s.finish_reason is FinishReason.ERROR and s.reward == 0.0 and s.response_ids for s in raising.samples)
    assert manager.rejected == {"empty_prompt": 1, "too_long": 2}
    assert manager.reward_errors == {"RuntimeError": 3}


# --- abort_resubmit -------------------------------------------------------------------------------

def _synthetic(prompt, response, routing_rows_from, version, first_id):
    """A sample whose routing row j is [[routing_rows_from + j]] and mask row i is [first_id + i, token]."""
    from megarl.sample import RolloutSample, SamplingMask

    r, t = len(response), len(prompt) + len(response)
    return RolloutSample(
        prompt_ids=list(prompt), response_ids=list(response), loss_mask=np.ones(r, np.uint8),
        rollout_logprobs=np.full(r, -float(version) - 1, np.float32), model_version=np.full(r, version, np.int32),
        routed_experts=(routing_rows_from + np.arange(t - 1, dtype=np.int16)).reshape(t - 1, 1, 1),
        sampling_mask=SamplingMask.from_rows([[first_id + i, tok] for i, tok in enumerate(response)]),
        finish_reason=FinishReason.ABORTED, group_id="g")


@pytest.mark.unit
def test_splice_keeps_the_prefix_rows_and_appends_the_continuation():
    from megarl.rollout.group import splice_continuation

    prefix = _synthetic([1, 2, 3], [4, 5], routing_rows_from=0, version=0, first_id=100)  # rows for tokens 0..3
    continuation = _synthetic([1, 2, 3, 4, 5], [6, 7, 8], routing_rows_from=1000, version=1, first_id=200)
    continuation.finish_reason = FinishReason.LENGTH
    spliced = splice_continuation(prefix, continuation)
    assert spliced.prompt_ids == [1, 2, 3] and spliced.response_ids == [4, 5, 6, 7, 8]
    # rows 0..3 (tokens 1,2,3,4) from the prefix; row 4 (token 5, never fed before the abort) onwards new
    assert spliced.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3, 1004, 1005, 1006]
    assert [spliced.sampling_mask.row(i).tolist() for i in range(5)] == [[100, 4], [101, 5], [200, 6], [201, 7],
                                                                          [202, 8]]
    assert spliced.model_version.tolist() == [0, 0, 1, 1, 1]
    assert spliced.rollout_logprobs.tolist() == [-1, -1, -2, -2, -2]
    assert spliced.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="not the prefix's prompt"):
        splice_continuation(prefix, _synthetic([1, 2, 3], [6], 0, 1, 0))


@pytest.mark.unit
def test_prefix_cache_counts_add_up_over_continuations_and_samples():
    from megarl.pipeline.bookkeeping import prefix_cache_metrics
    from megarl.rollout.group import splice_continuation

    prefix = _synthetic([1, 2, 3], [4, 5], routing_rows_from=0, version=0, first_id=100)
    continuation = _synthetic([1, 2, 3, 4, 5], [6], routing_rows_from=1000, version=1, first_id=200)
    prefix.prefill_tokens, prefix.cached_tokens = 3, 0
    continuation.prefill_tokens, continuation.cached_tokens = 5, 4
    spliced = splice_continuation(prefix, continuation)
    assert (spliced.prefill_tokens, spliced.cached_tokens) == (8, 4)
    other = _synthetic([9], [8], routing_rows_from=0, version=0, first_id=0)
    other.prefill_tokens, other.cached_tokens = 2, 2
    assert prefix_cache_metrics([spliced, other]) == {"rollout/cached_token_frac": 6 / 10}
    assert prefix_cache_metrics([_synthetic([9], [8], 0, 0, 0)]) == {}  # nothing reached an engine


NEW = 48
WAVE_FRACTIONS = (0.3, 0.1, 0.0)  # into the second wave, one try each, until the abort finds a sample mid-generation


class FirstPass:
    """The engine target of a manager, recording (finish reason, response length) of each group's
    first batch, before any resubmission, by group id."""

    def __init__(self, target):
        self.target, self.outcomes = target, {}

    def __getattr__(self, name):
        return getattr(self.target, name)

    async def generate_batch_counted(self, prompts, params, group_ids, **kwargs):
        result = await self.target.generate_batch_counted(prompts, params, group_ids=group_ids, **kwargs)
        self.outcomes.setdefault(group_ids[0], [(s.finish_reason, len(s.response_ids)) for s in result.samples])
        return result


def test_abort_resubmit_splices_prefix_and_continuation(engine, client, tokenizer, tiny_checkpoint, loop):
    # 48 new tokens: a continuation's input (prompt + prefix) stays under SGLang's input limit of the
    # 64-token context even when the abort lands late (at 56, a late abort was refused: 60 > 58 tokens)
    params = SamplingParams(max_new_tokens=NEW, top_k=10, ignore_eos=True)
    target = FirstPass(client)
    manager = RolloutManager(target, tokenizer, RewardScorer(arithmetic_reward), GenerationOptions(params),
                             samples_per_prompt=6)
    prompt = Prompt("2+5=", "7")

    async def aborted_group(group_id: str, wave_s: float, fraction: float):
        task = asyncio.create_task(manager.generate_group(prompt, group_id))
        # in the second of three waves: two of the six done, the next running (the six reach the engine
        # together, one batch, so its load goes 6, 4, 2; the first wave may be over before a loaded
        # machine's first poll answers)
        async for running, waiting in engine_loads(engine.url):
            if running and 3 <= running + waiting <= 4:
                break
        await asyncio.sleep(wave_s * fraction)
        await client.pause_generation(PauseMode.ABORT)
        try:
            await client.set_weight_version(1)  # the continuations run under "new weights"
        finally:
            await client.continue_generation()
        result = await asyncio.wait_for(task, timeout=120)
        await client.set_weight_version(0)
        return result

    async def body():
        t0 = time.monotonic()
        undisturbed = await manager.generate_group(prompt, "warm")
        wave_s, results = (time.monotonic() - t0) / 3, []
        for attempt, fraction in enumerate(WAVE_FRACTIONS):
            results.append(await aborted_group(f"g{attempt}", wave_s, fraction))
            if any(reason is FinishReason.ABORTED and 0 < n < NEW for reason, n in target.outcomes[f"g{attempt}"]):
                break  # a loaded machine's poll can see the second wave late, and the abort miss it
        return undisturbed, results

    undisturbed, results = loop.run_until_complete(body())
    result, first_pass = results[-1], target.outcomes[f"g{len(results) - 1}"]
    assert undisturbed.resubmitted == 0
    mid_flight = [i for i, (reason, n) in enumerate(first_pass) if reason is FinishReason.ABORTED and 0 < n < NEW]
    assert mid_flight, f"no try's abort found a sample mid-generation: first pass {first_pass}"
    versions = [s.model_version for s in result.samples]
    for i in mid_flight:  # the prefix under the old weights, the continuation under the new
        n = first_pass[i][1]
        assert versions[i].tolist() == [0] * n + [1] * (NEW - n), (i, n, versions[i].tolist())
    assert result.resubmitted >= len(mid_flight)
    assert manager.resubmitted == sum(r.resubmitted for r in results)
    model = hf_model(tiny_checkpoint)
    worst = 0.0
    for sample, v in zip(result.samples, versions):
        assert sample.finish_reason is FinishReason.LENGTH and len(sample.response_ids) == NEW
        assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {0, 1}
        assert (sample.loss_mask == 1).all() and sample.sampling_mask.num_rows == NEW
        worst = max(worst, hf_oracle.assert_sample_matches_hf(sample, model, LOGPROB_TOLERANCE))
    counts = sorted(int((v == 0).sum()) for v in versions)
    print(f"\n[measured] abort_resubmit: {result.resubmitted} resubmitted; version-0 tokens per sample {counts}; "
          f"max |log-prob - HF| {worst:.1e}")


# --- multi-turn: the calculator -------------------------------------------------------------------

@pytest.mark.unit
def test_calculator_evaluates_arithmetic_only():
    assert calculate("3+4*2") == 11 and calculate(" (1+2)/4 ") == 0.75 and calculate("-7 // 2") == -4
    for bad in ["__import__('os')", "2**10", "x+1", "", "1/0", "1" * 201]:
        with pytest.raises(CalculatorError):
            calculate(bad)


@pytest.mark.unit
def test_calculator_env_calls_and_final_answer(loop):
    env = CalculatorEnv(max_calls=2)

    async def body():
        await env.reset(Prompt("what is 6*7?"))
        return [await env.step(t) for t in ["let me <calc>6*7</calc>", "<calc>1/0</calc>", "<calc>1+1</calc>"]]

    assert loop.run_until_complete(body()) == [
        EnvStep("<result>42</result>", False), EnvStep("<result>error: division by zero</result>", False),
        EnvStep("", True)]  # the third call is past max_calls
    assert loop.run_until_complete(env.step("the answer is 42")) == EnvStep("", True)
    assert env.stop == ("</calc>",)


@pytest.fixture(scope="module")
def eos_or_seven_checkpoint(tiny_checkpoint, tokenizer, tmp_path_factory):
    return hf_oracle.eos_or_seven_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("tiny_moe_eos7"), tokenizer)


def test_calculator_episode_is_one_sample_with_env_tokens_masked(client, tokenizer, tiny_checkpoint,
                                                                 eos_or_seven_checkpoint, loop):
    # every turn is a call
    episodes = EnvEpisodes(client, tokenizer, lambda: CalculatorEnv(max_calls=3, call_open="", call_close="",
                                                                    result_format="={}\n"),
                           SamplingParams(max_new_tokens=8, top_k=5),
                           EpisodeLimits(max_turns=3, max_response_tokens=48))

    async def body():
        # sampled: a first turn may run out of tokens before its EOS (no tool call); take the first of
        # a few episodes that called the tool (the engine's RNG state depends on the tests before)
        await client.update_weights_from_disk(eos_or_seven_checkpoint, version=3)
        try:
            for _ in range(4):
                [episode], _ = await episodes.run_group(Prompt("3+4="), "e", 1)
                if 0 in episode.loss_mask.tolist():
                    break
            return episode
        finally:
            await client.update_weights_from_disk(tiny_checkpoint, version=0)

    sample = loop.run_until_complete(body())
    assert sample.episode_id == "e.0" and sample.group_id == "e"
    assert sample.episode_end in ("done", "max_turns", "max_tokens", "length")
    mask = sample.loss_mask.tolist()
    # split the response into alternating policy (1) and environment (0) segments
    segments, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            segments.append((mask[start], sample.response_ids[start:i]))
            start = i
    kinds = [kind for kind, _ in segments]
    ends = np.cumsum([len(t) for _, t in segments])
    assert list(sample.turn_ends) == [int(end) for (kind, _), end in zip(segments, ends) if kind == 1]
    assert kinds[0] == 1 and kinds[-1] == 1 and kinds.count(0) >= 1, kinds  # ends with a policy turn
    for (kind, tokens), (_, following) in zip(segments, segments[1:]):
        if kind == 1:  # a policy turn that the environment answered: ended by EOS, answered by the tool
            assert tokens[-1] == tokenizer.eos_token_id
            turn_text = tokenizer.decode(tokens, skip_special_tokens=True)
            try:
                expected = f"={calculate(turn_text)}\n"
            except CalculatorError as e:
                expected = f"=error: {e}\n"
            assert following == tokenizer.encode(expected, add_special_tokens=False)
    assert (sample.model_version == 3).all()  # env tokens carry the version of the policy token before them
    hf_oracle.assert_sample_matches_hf(sample, hf_model(eos_or_seven_checkpoint), LOGPROB_TOLERANCE)
    # turn k was fed the prompt and the response before it; from turn 2 on the engine had computed all
    # of that but the previous turn's last token (its KV is made when it is fed)
    starts = [int(end - len(t)) for (kind, t), end in zip(segments, ends) if kind == 1]
    p = len(sample.prompt_ids)
    assert sample.prefill_tokens == sum(p + start for start in starts)
    assert sum(p + end - 1 for end in sample.turn_ends[:-1]) <= sample.cached_tokens <= sample.prefill_tokens
    print(f"\n[measured] calculator episode: segments {[(k, len(t)) for k, t in segments]}, "
          f"text {tokenizer.decode(sample.response_ids)!r}")


class _Echo:
    """An environment that answers every turn with ``={n}`` (n = its turns so far) and never ends an
    episode by itself, or raises at turn ``raise_at``."""

    stop = ()

    def __init__(self, raise_at: int | None = None):
        self.turns, self.raise_at = 0, raise_at

    async def reset(self, prompt):
        return prompt.text

    async def step(self, turn_text):
        self.turns += 1
        if self.turns == self.raise_at:
            raise RuntimeError("the tool crashed")
        return EnvStep(observation=f"={self.turns}\n", done=False)


def test_episodes_end_with_a_reason_and_a_raising_environment_is_counted(client, tokenizer, tiny_checkpoint,
                                                                         eos_or_seven_checkpoint, loop):
    params = SamplingParams(max_new_tokens=8, top_k=1)  # greedy: the same turns every run

    def run(make_env, limits, n=2, turn_params=params):
        episodes = EnvEpisodes(client, tokenizer, make_env, turn_params, limits)
        samples, _ = loop.run_until_complete(episodes.run_group(Prompt("3+4="), "g", n))
        return episodes, samples

    loop.run_until_complete(client.update_weights_from_disk(eos_or_seven_checkpoint, version=0))
    try:
        _, by_turns = run(_Echo, EpisodeLimits(max_turns=2, max_response_tokens=50))
        _, by_tokens = run(_Echo, EpisodeLimits(max_turns=9, max_response_tokens=12))
        _, by_length = run(_Echo, EpisodeLimits(max_turns=3, max_response_tokens=50),
                           turn_params=SamplingParams(max_new_tokens=3, top_k=1, ignore_eos=True))
        raising, crashed = run(lambda: _Echo(raise_at=2), EpisodeLimits(max_turns=3, max_response_tokens=50))
    finally:
        loop.run_until_complete(client.update_weights_from_disk(tiny_checkpoint, version=0))
    stopped = [s for s in by_turns if s.finish_reason is FinishReason.STOP]
    assert stopped and all(s.episode_end == "max_turns" and len(s.turn_ends) == 2 for s in stopped)
    assert all(len(s.response_ids) <= 12 for s in by_tokens)
    assert {s.episode_end for s in by_tokens} <= {"max_tokens", "length"} and any(
        s.episode_end == "max_tokens" for s in by_tokens)
    assert all(s.episode_end == "length" and s.finish_reason is FinishReason.LENGTH and len(s.turn_ends) == 1
               for s in by_length)
    errored = [s for s in crashed if s.finish_reason is FinishReason.ERROR]
    assert errored and all(s.episode_end == "error: RuntimeError: the tool crashed" for s in errored)
    assert raising.errors == {"RuntimeError": len(errored)} and raising.ends["error"] == len(errored)
    for s in by_turns + by_tokens + crashed:  # the trajectory so far is kept, ending with a policy turn
        assert s.loss_mask[-1] == 1 and s.turn_ends[-1] == len(s.response_ids)


@pytest.mark.parametrize("partial_rollout", ["continue", "abort_resubmit"])
def test_episodes_span_a_weight_update_and_match_hf(partial_rollout, client, tokenizer, tiny_checkpoint,
                                                    eos_or_seven_checkpoint, loop):
    """A weight update (version 0 -> 1, same weights) lands inside a group's episodes: tokens carry both
    versions, turns after it the new one, aborted turns are continued (abort_resubmit), and routing,
    masks and log-probs over the whole trajectory still equal an HF forward within 1e-4."""
    env = lambda: CalculatorEnv(max_calls=3, call_open="", call_close="", result_format="={}\n")  # noqa: E731
    episodes = EnvEpisodes(client, tokenizer, env, SamplingParams(max_new_tokens=8, top_k=5),
                           EpisodeLimits(max_turns=3, max_response_tokens=48),
                           abort_resubmit=partial_rollout == "abort_resubmit")
    pause = PauseMode.ABORT if partial_rollout == "abort_resubmit" else PauseMode.RETRACT

    async def body():
        await client.update_weights_from_disk(eos_or_seven_checkpoint, version=0)
        try:
            t0 = time.monotonic()
            await episodes.run_group(Prompt("3+4="), "warm", 6)
            duration = time.monotonic() - t0
            for attempt in range(4):  # the update must land inside an episode with turns on both sides
                await client.set_weight_version(0)
                task = asyncio.create_task(episodes.run_group(Prompt("3+4="), f"g{attempt}", 6))
                await asyncio.sleep(duration * 0.4)
                await client.pause_generation(pause)
                try:
                    await client.set_weight_version(1)
                finally:
                    await client.continue_generation()
                samples, resubmitted = await asyncio.wait_for(task, timeout=120)
                if any(set(s.model_version.tolist()) == {0, 1} and len(s.turn_ends) > 1 for s in samples):
                    return samples, resubmitted
            raise AssertionError("no episode spanned the update in 4 attempts")
        finally:
            await client.update_weights_from_disk(tiny_checkpoint, version=0)

    samples, resubmitted = loop.run_until_complete(body())
    model = hf_model(eos_or_seven_checkpoint)
    worst = 0.0
    for s in samples:
        v = s.model_version
        assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {0, 1}
        environment = np.flatnonzero(s.loss_mask == 0)
        assert (v[environment] == v[environment - 1]).all()  # the version of the policy token before them
        assert s.episode_end != "aborted"
        worst = max(worst, hf_oracle.assert_sample_matches_hf(s, model, 1e-4))
    print(f"\n[measured] episodes across an update ({partial_rollout}): {resubmitted} turns resubmitted, "
          f"versions per episode {[sorted(set(s.model_version.tolist())) for s in samples]}, "
          f"max |log-prob - HF| {worst:.1e}")
