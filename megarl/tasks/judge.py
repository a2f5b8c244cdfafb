"""A generative reward model (a judge): a model served by its own SGLang engine reads a prompt made
from the sample and answers with a score.

The judge prompt is ``reward.judge.prompt_template`` with ``{prompt}`` (the prompt as the dataset wrote
it, ``Prompt.plain_text``: without the policy's chat template), ``{response}`` and ``{answer}`` replaced
in one pass (text inside the values is never substituted again; other braces stay as
written), tokenized by the judge's tokenizer and answered by the judge engine (``max_new_tokens``,
``temperature``). The first group of ``score_pattern`` found in the decoded answer, as a float, is
the score. An answer without one raises :class:`JudgeParseError`, no answer within ``timeout_s``
raises :class:`JudgeTimeout`, an engine that cannot be reached raises its client's error:
:class:`~megarl.tasks.rewards.RewardScorer` counts each as a reward error (the sample gets reward 0
and finish_reason error and is not trained on), never a crash.

Outcome judging scores the whole response. Per-turn judging (``per_turn``) scores each policy turn
of a multi-turn episode on its own: ``{prompt}`` is the prompt followed by the episode before the
turn (earlier turns and observations), ``{response}`` the turn's tokens; ``weight`` times the scores
become ``sample.turn_rewards`` (process rewards, turned into token advantages by
:mod:`megarl.algos.process`).

The judge reaches its engine through a :data:`JudgeGenerate` call (prompt ids -> answer ids);
``megarl/pipeline/judge.py`` builds it on megarl's SGLang client or engine pool, since this layer
does not import the engines.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable, Callable

from megarl.sample import RolloutSample
from megarl.tasks.reward_types import RewardFn, RewardInput

log = logging.getLogger(__name__)

JudgeGenerate = Callable[[list[int]], Awaitable[list[int]]]
"""The judge engine: the judge prompt's token ids -> the answer's token ids."""

PLACEHOLDER = re.compile(r"\{(prompt|response|answer)\}")


class JudgeParseError(ValueError):
    """The judge's answer holds no score matching ``score_pattern``."""


class JudgeTimeout(RuntimeError):
    """The judge engine answered nothing within ``timeout_s``. Not a TimeoutError: the scorer counts
    it apart from its own reward timeout."""


def check_judge_config(judge_cfg) -> re.Pattern:
    """``score_pattern`` compiled; ValueError naming the ``reward.judge`` key that is wrong."""
    try:
        pattern = re.compile(judge_cfg.score_pattern)
    except re.error as e:
        raise ValueError(f"reward.judge.score_pattern: {judge_cfg.score_pattern!r} is not a regular expression "
                         f"({e})") from e
    if pattern.groups < 1:
        raise ValueError(f"reward.judge.score_pattern: {judge_cfg.score_pattern!r} has no group; its first group "
                         r"is the score, e.g. 'score: (\d+)'")
    if "{response}" not in judge_cfg.prompt_template:
        raise ValueError(f"reward.judge.prompt_template: {judge_cfg.prompt_template!r} has no {{response}}")
    if judge_cfg.max_new_tokens < 1:
        raise ValueError(f"reward.judge.max_new_tokens: must be >= 1, got {judge_cfg.max_new_tokens}")
    if judge_cfg.temperature < 0:
        raise ValueError(f"reward.judge.temperature: must be >= 0, got {judge_cfg.temperature}")
    if judge_cfg.timeout_s <= 0:
        raise ValueError(f"reward.judge.timeout_s: must be > 0, got {judge_cfg.timeout_s}")
    return pattern


def render(template: str, prompt: str, response: str, answer: str | None) -> str:
    """``template`` with ``{prompt}``, ``{response}`` and ``{answer}`` replaced in one pass."""
    values = {"prompt": prompt, "response": response, "answer": answer}

    def value(match: re.Match) -> str:
        if values[match[1]] is None:
            raise ValueError(f"reward.judge.prompt_template uses {{answer}} but the prompt {prompt[:60]!r} has none")
        return values[match[1]]

    return PLACEHOLDER.sub(value, template)


def parse_score(text: str, pattern: re.Pattern) -> float:
    """The float in ``pattern``'s first group in ``text``; JudgeParseError when there is none."""
    match = pattern.search(text)
    if match is None or match[1] is None:
        raise JudgeParseError(f"judge answer {text[:200]!r} has no score matching {pattern.pattern!r}")
    try:
        score = float(match[1])
    except ValueError:
        raise JudgeParseError(f"judge answer {text[:200]!r}: {match[1]!r} (the first group of "
                              f"{pattern.pattern!r}) is not a number") from None
    if not math.isfinite(score):
        raise JudgeParseError(f"judge answer {text[:200]!r} gives the score {score}")
    return score


def policy_turns(sample: RolloutSample) -> list[tuple[int, int]]:
    """(start, end) response offsets of each policy turn: from the first policy token (loss mask 1)
    after the previous turn's end to the turn's end; the tokens in between are observations."""
    turns, previous = [], 0
    for end in sample.turn_ends:
        policy = [i for i in range(previous, end) if sample.loss_mask[i]]
        if not policy:
            raise ValueError(f"turn ending at {end} has no policy token (loss mask 1)")
        turns.append((policy[0], end))
        previous = end
    return turns


class JudgeReward:
    """The judge as an async reward: ``await judge(inp)`` is the score of the whole response,
    ``await judge.score_turns(inp)`` the scores of its policy turns (module docstring).

    ``judge_cfg``: ``reward.judge``; ``generate``: the judge engine; ``tokenizer``: the judge's;
    ``policy_tokenizer``: the policy's, which decodes the turns (needed with ``per_turn``).
    """

    def __init__(self, judge_cfg, generate: JudgeGenerate, tokenizer, policy_tokenizer=None):
        self.pattern = check_judge_config(judge_cfg)
        if judge_cfg.per_turn and policy_tokenizer is None:
            raise ValueError("reward.judge.per_turn: the judge decodes the policy's turns; pass policy_tokenizer")
        self.template, self.timeout_s = judge_cfg.prompt_template, float(judge_cfg.timeout_s)
        self.weight, self.per_turn = float(judge_cfg.weight), bool(judge_cfg.per_turn)
        self.generate, self.tokenizer, self.policy_tokenizer = generate, tokenizer, policy_tokenizer
        self.__name__ = "judge"

    def prompt_ids(self, prompt: str, response: str, answer: str | None) -> list[int]:
        """The judge prompt's token ids."""
        return list(self.tokenizer(render(self.template, prompt, response, answer))["input_ids"])

    async def score(self, prompt: str, response: str, answer: str | None) -> float:
        """One judge request: the score it gives ``response`` to ``prompt``."""
        ids = self.prompt_ids(prompt, response, answer)
        try:
            answer_ids = await asyncio.wait_for(self.generate(ids), self.timeout_s)
        except asyncio.TimeoutError:
            raise JudgeTimeout(f"the judge answered nothing within {self.timeout_s:g} s") from None
        return parse_score(self.tokenizer.decode(answer_ids, skip_special_tokens=True), self.pattern)

    async def __call__(self, inp: RewardInput) -> float:
        return await self.score(inp.prompt.plain_text, inp.response_text, inp.prompt.answer)

    async def score_turns(self, inp: RewardInput) -> tuple[float, ...]:
        """One score per policy turn of ``inp.sample`` (its ``turn_ends``), judged concurrently."""
        sample = inp.sample
        if not sample.turn_ends:
            raise ValueError("reward.judge.per_turn: the sample has no turns (turn_ends is empty); per-turn "
                             "judging needs a multi-turn task")

        def text(ids: list[int]) -> str:
            return self.policy_tokenizer.decode(ids, skip_special_tokens=True)

        ids = sample.response_ids
        return tuple(await asyncio.gather(*(
            self.score(inp.prompt.plain_text + text(ids[:start]), text(ids[start:end]), inp.prompt.answer)
            for start, end in policy_turns(sample))))


def with_judge(rule: RewardFn, rule_weight: float, judge: JudgeReward) -> RewardFn:
    """``rule_weight * rule + judge.weight * judge``. With per-turn judging the judge's weighted turn
    scores go to ``sample.turn_rewards`` instead and the reward is ``rule_weight * rule``. A rule
    weight of 0 skips the rule. Either part raising makes the reward raise (a counted error)."""

    async def reward(inp: RewardInput) -> float:
        rule_value = float(await rule(inp)) if rule_weight else 0.0
        if judge.per_turn:
            inp.sample.turn_rewards = tuple(judge.weight * s for s in await judge.score_turns(inp))
            return rule_weight * rule_value
        return rule_weight * rule_value + judge.weight * await judge(inp)

    reward.__name__ = f"{getattr(rule, '__name__', 'rule')}+judge"
    return reward
