"""Rollout of prompt groups on the engines: G samples per prompt, rewards, advantages.

The demo task's reward is exact-match arithmetic; an ``error`` finish or a reward that raises
scores 0 and is counted, never fatal.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megarl.algos.advantages import advantage_fn, group_index
from megarl.rollout import arithmetic
from megarl.rollout.client import SamplingParams, SGLangClient
from megarl.rollout.sample import FinishReason, RolloutSample

log = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    reward_mean: float
    response_len_mean: float
    mixed_group_frac: float  # groups whose rewards are not all equal (GRPO has signal only there)
    tokens: int  # generated tokens


def score(sample: RolloutSample, problem: arithmetic.Problem, tokenizer) -> float:
    """The arithmetic reward of one sample (1.0 = exact answer then end-of-sequence)."""
    ids = list(sample.response_ids)
    ended = sample.finish_reason == FinishReason.STOP and bool(ids) and ids[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True)
    return arithmetic.reward(text, problem.answer, ended)


async def rollout_groups(client: SGLangClient, tokenizer, problems: list[arithmetic.Problem], samples_per_prompt: int,
                         params: SamplingParams, *, routing: bool, sampling_mask: bool) -> list[RolloutSample]:
    """``samples_per_prompt`` samples for each problem, rewards filled, in prompt-major order."""
    prompts, group_ids = [], []
    for index, problem in enumerate(problems):
        prompt_ids = tokenizer(problem.prompt)["input_ids"]
        prompts += [prompt_ids] * samples_per_prompt
        group_ids += [str(index)] * samples_per_prompt
    samples = await client.generate_batch(prompts, params, group_ids=group_ids, return_routed_experts=routing,
                                          return_sampling_mask=sampling_mask)
    for sample in samples:
        sample.reward = score(sample, problems[int(sample.group_id)], tokenizer)
    return list(samples)


def fill_advantages(samples: list[RolloutSample], estimator: str) -> RolloutStats:
    """Set each sample's advantage with the configured estimator over its prompt group."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = group_index([s.group_id for s in samples])
    for sample, value in zip(samples, advantage_fn(estimator)(rewards, groups).tolist()):
        sample.advantage = value
    group_min = torch.full((int(groups.max()) + 1,), float("inf"), dtype=torch.float64).scatter_reduce(0, groups, rewards, "amin")
    group_max = torch.full_like(group_min, float("-inf")).scatter_reduce(0, groups, rewards, "amax")
    lengths = [len(s.response_ids) for s in samples]
    return RolloutStats(reward_mean=float(rewards.mean()), response_len_mean=sum(lengths) / len(lengths),
                        mixed_group_frac=float((group_max > group_min).double().mean()), tokens=sum(lengths))
