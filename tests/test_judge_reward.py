"""The judge reward (megarl/tasks/judge.py) against one real SGLang judge engine on CPU, started
from the run config's judge settings (megarl/pipeline/judge.py).

The judge is the tiny checkpoint with its lm_head edited so that it only ever writes '7' or
end-of-sequence (logits -+5 * sum(h)): greedy, it answers a run of sevens whose length depends on
the judge prompt. Every expected score is the parse of HF's greedy answer to the same prompt
(``hf_answer``); a score pattern that accepts one to four sevens makes the longer answers
malformed, which must be counted as reward errors, never fatal."""
import asyncio
import collections
import dataclasses
import json
import re
from pathlib import Path

import hf_oracle
import httpx
import numpy as np
import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.config.load import load_config
from megarl.config.schema import JudgeConfig, RewardConfig
from megarl.config.topology import RunTopology, pool_engine_settings
from megarl.engines.client import SGLangClient
from megarl.engines.server import SGLangEngine
from megarl.engines.types import GenerationOptions, SamplingParams
from megarl.parallel import free_port
from megarl.pipeline.judge import judge_generate, make_judge
from megarl.platform.description import detect
from megarl.rollout.group import RolloutManager
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.judge import JudgeParseError, JudgeReward, render
from megarl.tasks.prompts import DatasetSource, Prompt, chat_renderer
from megarl.tasks.reward_types import RewardInput
from megarl.tasks.rewards import RewardScorer, make_reward

TEMPLATE = "{prompt}{response}+{answer}="
PATTERN = r"^(7{1,4})$"  # one to four sevens; the judge's five or six are malformed
MAX_NEW = 6


def expected_score(answer_text: str) -> float | None:
    """The score of a judge answer under PATTERN, or None when it has none (independent of parse_score)."""
    return float(answer_text) if re.fullmatch("7{1,4}", answer_text) else None


@pytest.fixture(scope="module")
def judge_checkpoint(tiny_checkpoint, tokenizer, tmp_path_factory):
    """The tiny model writing only '7' or end-of-sequence (tests/hf_oracle.py)."""
    return str(hf_oracle.eos_or_seven_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("judge_sevens"), tokenizer))


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint, judge_checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("judge_run")
    return load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}",
                        f"reward.judge.hf_path={judge_checkpoint}", f"logging.run_dir={run_dir}"])


def judge_engine_settings(cfg, api_key: str):
    """The judge pool's one engine, as the run starts it."""
    topology = RunTopology.from_config(cfg)
    [settings] = pool_engine_settings(cfg, topology, topology.pool("judge"), detect(), api_key)
    return settings


@pytest.fixture(scope="module")
def engine(cfg):
    with SGLangEngine(judge_engine_settings(cfg, api_key="judge-key")) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine, loop):
    client = SGLangClient(engine.url, engine.model, api_key="judge-key")
    yield client
    loop.run_until_complete(client.aclose())


@pytest.fixture(scope="module")
def hf_answer(judge_checkpoint, tokenizer):
    """HF's greedy answer (decoded, special tokens skipped) to a judge prompt text."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(judge_checkpoint, dtype=torch.float32).eval()

    def answer(text: str) -> str:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return answer


def judge_cfg(judge_checkpoint, **changes) -> JudgeConfig:
    return dataclasses.replace(JudgeConfig(hf_path=judge_checkpoint, prompt_template=TEMPLATE, score_pattern=PATTERN,
                                           max_new_tokens=MAX_NEW), **changes)


def reward_input(prompt: Prompt, sample: RolloutSample, tokenizer) -> RewardInput:
    return RewardInput(prompt=prompt, response_text=tokenizer.decode(sample.response_ids, skip_special_tokens=True),
                       ended=sample.finish_reason is FinishReason.STOP, sample=sample)


def text_sample(tokenizer, text: str, loss_mask=None, turn_ends=()) -> RolloutSample:
    ids = tokenizer.encode(text, add_special_tokens=False)
    r = len(ids)
    return RolloutSample(prompt_ids=[1], response_ids=ids,
                         loss_mask=np.ones(r, np.uint8) if loss_mask is None else np.asarray(loss_mask, np.uint8),
                         rollout_logprobs=np.zeros(r, np.float32), model_version=np.zeros(r, np.int32),
                         routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP,
                         turn_ends=tuple(turn_ends))


# --- config and pieces without the engine ---------------------------------------------------------

@pytest.mark.unit
def test_engine_settings_come_from_the_config(cfg, judge_checkpoint):
    settings = judge_engine_settings(cfg, api_key="secret-judge-key")
    assert settings.model_path == judge_checkpoint and settings.dtype == "float32" and settings.tp == 1
    assert settings.max_total_tokens == cfg.rollout.max_total_tokens and settings.api_key == "secret-judge-key"
    assert settings.log_path == str(Path(cfg.logging.run_dir) / "judge.log")
    assert "secret-judge-key" not in repr(settings)


def test_the_judge_engine_runs_with_the_configured_ranks_and_memory_share(engine, cfg):
    info = httpx.get(engine.url + "/server_info", headers={"Authorization": "Bearer judge-key"}, timeout=10).json()
    assert (info["tp_size"], info["ep_size"]) == (cfg.reward.judge.engine_tp, cfg.reward.judge.engine_ep)
    assert info["mem_fraction_static"] == cfg.rollout.mem_fraction_static


@pytest.mark.unit
def test_bad_judge_configs_are_refused_naming_the_key(tiny_checkpoint, judge_checkpoint, tmp_path):
    base = ["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}", f"logging.run_dir={tmp_path}"]
    with_judge = [*base, f"reward.judge.hf_path={judge_checkpoint}"]
    cases = [
        (with_judge + ["reward.judge.score_pattern=score"], "reward.judge.score_pattern: 'score' has no group"),
        (with_judge + ["reward.judge.prompt_template=prompt"], r"reward.judge.prompt_template: .* has no \{response\}"),
        (with_judge + ["reward.judge.timeout_s=60"], "reward.judge.timeout_s: 60.0 s exceeds reward.timeout_s"),
        (with_judge + ["reward.judge.per_turn=true"], "reward.judge.per_turn: scores the turns of multi-turn"),
        (base + ["reward.judge.per_turn=true"], "reward.judge.per_turn: per-turn judging needs a judge"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides)


@pytest.mark.unit
def test_template_is_filled_in_one_pass_and_reward_needs_its_judge(judge_checkpoint):
    assert render("{prompt}|{response}|{answer}|{other}", "p", "r {answer}", "a") == "p|r {answer}|a|{other}"
    with pytest.raises(ValueError, match="uses {answer} but the prompt '1\\+1=' has none"):
        render(TEMPLATE, "1+1=", "2", None)
    with pytest.raises(ValueError, match="pass make_reward"):
        make_reward(RewardConfig(judge=judge_cfg(judge_checkpoint)))
    with pytest.raises(ValueError, match="reward.judge.hf_path is not set"):
        make_reward(RewardConfig(), judge=object())


@pytest.mark.unit
def test_the_judge_reads_the_prompt_as_the_dataset_wrote_it(tokenizer, judge_checkpoint, tmp_path):
    """With task.chat_template the policy gets the template's rendering; the judge's {prompt} is the
    row's own text (one message's content, several as role-named paragraphs), not the template's markers."""
    rows = [{"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"},
            {"prompt": [{"role": "system", "content": "sums"}, {"role": "user", "content": "3+4="}], "answer": "7"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = DatasetSource(path, shuffle=False, render=chat_renderer(tokenizer)).next_batch(2)
    assert prompts[0].text == "<|bos|>U:3+4=\nA:"  # what the policy is given
    seen = []

    async def generate(ids: list[int]) -> list[int]:
        seen.append(ids)
        return tokenizer.encode("77", add_special_tokens=False)

    judge = JudgeReward(judge_cfg(judge_checkpoint), generate, tokenizer)
    sample = text_sample(tokenizer, "7")
    scores = [asyncio.run(judge(reward_input(p, sample, tokenizer))) for p in prompts]
    assert scores == [77.0, 77.0]
    assert seen == [tokenizer(written + "7+7=")["input_ids"] for written in ("3+4=", "system: sums\n\nuser: 3+4=")]


# --- the judge engine -----------------------------------------------------------------------------

CASES = [Prompt("3+0=", "3"), Prompt("3+1=", "4"), Prompt("3+2=", "5"), Prompt("3+4=", "7"), Prompt("3+6=", "9"),
         Prompt("3+8=", "11")]
RESPONSES = ["7", "7", "12", "8", "8", "77"]


def test_scores_equal_hf_greedy_and_malformed_answers_raise(client, tokenizer, hf_answer, judge_checkpoint, loop):
    judge = make_judge(judge_cfg(judge_checkpoint), client, tokenizer)

    async def score(prompt: Prompt, response: str):
        try:
            return await judge.score(prompt.text, response, prompt.answer)
        except JudgeParseError as e:
            return e

    async def all_cases():
        return await asyncio.gather(*(score(p, r) for p, r in zip(CASES, RESPONSES)))

    got = loop.run_until_complete(all_cases())
    expected = [expected_score(hf_answer(f"{p.text}{r}+{p.answer}=")) for p, r in zip(CASES, RESPONSES)]
    for prompt, value, reference in zip(CASES, got, expected):
        if reference is None:
            assert isinstance(value, JudgeParseError), (prompt, value)
            assert "has no score matching '^(7{1,4})$'" in str(value)
        else:
            assert value == reference, (prompt, value, reference)
    assert {v is None for v in expected} == {True, False}, f"the cases must include both kinds: {expected}"


def test_rule_and_judge_combine_by_weights_and_malformed_answers_are_counted(client, tokenizer, hf_answer,
                                                                             judge_checkpoint, loop):
    reward_cfg = RewardConfig(type="exact_match", rule_weight=0.5, judge=judge_cfg(judge_checkpoint, weight=2.0))
    reward = make_reward(reward_cfg, judge=make_judge(reward_cfg.judge, client, tokenizer))
    # greedy: the policy (the judge's checkpoint here too) answers with a run of sevens; the last two prompts
    # take what it answers them as their answer, so that the rule reward is 1 there
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    manager = RolloutManager(client, tokenizer, RewardScorer(reward),
                             GenerationOptions(params, routing=False, sampling_mask=False), samples_per_prompt=2)
    prompts = [*CASES, Prompt("3+4=", "777"), Prompt("0+0=", "7")]
    results = loop.run_until_complete(manager.generate_groups(prompts, [str(i) for i in range(len(prompts))]))

    malformed, scored = 0, []
    for prompt, result in zip(prompts, results):
        assert result.rejected is None and len(result.samples) == 2
        group_errors = 0
        for sample in result.samples:
            text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            judged = expected_score(hf_answer(f"{prompt.text}{text}+{prompt.answer}="))
            if judged is None:  # a malformed answer: reward 0, error, not trained on
                assert sample.finish_reason is FinishReason.ERROR and sample.reward == 0.0
                group_errors += 1
                continue
            rule = 1.0 if text.strip() == prompt.answer else 0.0  # exact match
            assert sample.reward == pytest.approx(0.5 * rule + 2.0 * judged), (prompt, text)
            scored.append((rule, judged))
        assert result.errors == group_errors
        malformed += group_errors
    assert manager.reward_errors == (collections.Counter({"JudgeParseError": malformed}) if malformed else {})
    assert 0 < malformed < 2 * len(prompts), "the cases must include both malformed and scored answers"
    assert {rule for rule, _ in scored} == {0.0, 1.0}, f"the cases must include right and wrong answers: {scored}"


def test_per_turn_judge_scores_each_turn_into_turn_rewards(client, tokenizer, hf_answer, judge_checkpoint, loop):
    reward_cfg = RewardConfig(type="exact_match", rule_weight=0.5,
                              judge=judge_cfg(judge_checkpoint, weight=3.0, score_pattern=r"(\d+)", per_turn=True))
    reward = make_reward(reward_cfg, judge=make_judge(reward_cfg.judge, client, tokenizer))
    # policy "1+2", environment "=3", policy "7", environment "1", policy "77"
    sample = text_sample(tokenizer, "1+2=371+77", loss_mask=[1, 1, 1, 0, 0, 1, 0, 1, 1, 1], turn_ends=(3, 6, 10))
    assert len(sample.response_ids) == 10  # one token per character
    prompt = Prompt("3+4=", "1+2=371+77")
    scorer = RewardScorer(reward)
    outcome = loop.run_until_complete(scorer(reward_input(prompt, sample, tokenizer)))
    assert outcome.error is None and outcome.value == 0.5  # rule_weight * the exact match; the judge adds nothing
    turns = [("", "1+2"), ("1+2=3", "7"), ("1+2=371", "+77")]  # (episode before the turn, the turn)
    expected = [3.0 * float(re.search(r"\d+", hf_answer(f"{prompt.text}{before}{turn}+{prompt.answer}=")).group())
                for before, turn in turns]
    assert sample.turn_rewards == pytest.approx(expected)

    single = text_sample(tokenizer, "7")  # no turns: per-turn judging cannot score it
    outcome = loop.run_until_complete(scorer(reward_input(prompt, single, tokenizer)))
    assert outcome.error.startswith("ValueError: reward.judge.per_turn: the sample has no turns")
    assert scorer.errors == {"ValueError": 1}


def test_unreachable_judge_and_a_timeout_are_counted_errors(client, tokenizer, judge_checkpoint, engine, loop):
    nowhere = SGLangClient(f"http://127.0.0.1:{free_port('127.0.0.1')}", engine.model)
    unreachable = JudgeReward(judge_cfg(judge_checkpoint), judge_generate(nowhere, judge_cfg(judge_checkpoint)),
                              tokenizer)
    slow = make_judge(judge_cfg(judge_checkpoint, timeout_s=1e-4), client, tokenizer)
    inp = reward_input(Prompt("3+4=", "7"), text_sample(tokenizer, "7"), tokenizer)
    for judge, kind, message in ((unreachable, "EngineUnreachable", "engine unreachable"),
                                 (slow, "JudgeTimeout", "the judge answered nothing within 0.0001 s")):
        scorer = RewardScorer(judge)
        outcome = loop.run_until_complete(scorer(inp))
        assert outcome.value == 0.0 and outcome.error.startswith(f"{kind}: ") and message in outcome.error
        assert scorer.errors == {kind: 1}
    loop.run_until_complete(nowhere.aclose())
