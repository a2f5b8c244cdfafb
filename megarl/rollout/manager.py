"""Rollout of prompt groups on the engines: G samples per prompt, rewards, advantages.

:class:`RolloutManager` turns one :class:`Prompt` into a :class:`GroupResult`: G samples from an
:class:`EnginePool` (or one ``SGLangClient``), each scored by the reward function with a timeout.
Every outcome is counted, none is fatal:

- a prompt the engine cannot take (empty, or prompt + ``max_new_tokens`` beyond the context, or
  rejected by the engine) gives G empty samples with finish_reason error and ``rejected`` saying why;
- a reward that raises or times out gives that sample reward 0.0 and ``finish_reason`` error;
- with ``partial_rollout="abort_resubmit"`` a sample that comes back aborted (``pause(ABORT)``,
  e.g. for a weight update) is resubmitted as prompt + its response so far and the two parts are
  spliced into one sample (:func:`splice_continuation`); with ``"continue"`` it is kept as it is
  (the driver pauses with retract / in_place, and requests resume under the new weights).

``rollout_groups`` (one batched request for all groups, the arithmetic task) is what the sync
driver uses; ``RolloutManager.generate_groups`` is its general replacement.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from megarl.algos.advantages import advantage_fn, group_index
from megarl.rollout import arithmetic
from megarl.rollout.client import EngineError, EngineUnreachable, SamplingParams, SGLangClient
from megarl.rollout.dispatcher import EnginePool
from megarl.rollout.prompt_data import Prompt
from megarl.rollout.rewards import RewardFn, RewardInput, RewardScorer
from megarl.rollout.sample import FinishReason, RolloutSample, SamplingMask

log = logging.getLogger(__name__)

PARTIAL_ROLLOUT_MODES = ("continue", "abort_resubmit")


@dataclass
class RolloutStats:
    reward_mean: float
    response_len_mean: float
    mixed_group_frac: float  # groups whose rewards are not all equal (GRPO has signal only there)
    tokens: int  # generated tokens


@dataclass
class GroupResult:
    """The G samples of one prompt, rewards filled; always G of them.

    errors: samples with finish_reason error (reward 0.0, not to be trained on): those whose reward
    raised or timed out, or all G when the prompt was rejected (then their responses are empty and
    ``rejected`` is "<kind>: <why>", kind empty_prompt | too_long | engine_rejected).
    resubmitted: requests sent again for this group (engine died mid-batch, or an aborted sample
    continued with abort_resubmit).
    """

    samples: list[RolloutSample]
    resubmitted: int
    errors: int
    rejected: str | None = None


def _error_sample(prompt_ids: list[int], group_id: str) -> RolloutSample:
    """The stand-in for an attempt that never ran: no response, reward 0.0, finish_reason error."""
    empty = np.zeros(0, np.float32)
    return RolloutSample(prompt_ids=list(prompt_ids), response_ids=[], loss_mask=np.zeros(0, np.uint8),
                         rollout_logprobs=empty, model_version=np.zeros(0, np.int32), routed_experts=None,
                         sampling_mask=None, finish_reason=FinishReason.ERROR, reward=0.0, group_id=group_id)


def splice_continuation(prefix: RolloutSample, continuation: RolloutSample) -> RolloutSample:
    """One sample from an aborted ``prefix`` and the ``continuation`` generated for the prompt
    ``prefix.prompt_ids + prefix.response_ids``.

    Response, log-probs, per-token model versions, loss mask and sampling-mask rows are
    concatenated (the prefix's from the engine that made them); the routing keeps the prefix's rows
    for the prompt and prefix tokens it fed and takes the continuation's rows from the last prefix
    token on (the prefix's final token was never fed before the abort, so it has no row there).
    """
    p, m = len(prefix.prompt_ids), len(prefix.response_ids)
    if continuation.prompt_ids != prefix.prompt_ids + prefix.response_ids:
        raise ValueError("the continuation's prompt is not the prefix's prompt + response")
    routing = None
    if continuation.routed_experts is not None:
        if m == 0:
            routing = continuation.routed_experts
        elif prefix.routed_experts is None:
            raise ValueError("the continuation has routed experts, the prefix with tokens has none")
        else:
            routing = np.concatenate([prefix.routed_experts[: p + m - 1], continuation.routed_experts[p + m - 1:]])
    mask = None
    if continuation.sampling_mask is not None:
        if prefix.sampling_mask is None:
            raise ValueError("the continuation has a sampling mask, the prefix has none")
        a, b = prefix.sampling_mask, continuation.sampling_mask
        mask = SamplingMask(ids=np.concatenate([a.ids, b.ids]),
                            offsets=np.concatenate([a.offsets, b.offsets[1:] + a.offsets[-1]]).astype(np.int32))
    return RolloutSample(
        prompt_ids=list(prefix.prompt_ids), response_ids=prefix.response_ids + continuation.response_ids,
        loss_mask=np.concatenate([prefix.loss_mask, continuation.loss_mask]),
        rollout_logprobs=np.concatenate([prefix.rollout_logprobs, continuation.rollout_logprobs]),
        model_version=np.concatenate([prefix.model_version, continuation.model_version]),
        routed_experts=routing, sampling_mask=mask, finish_reason=continuation.finish_reason,
        group_id=prefix.group_id, episode_id=prefix.episode_id,
    )


class RolloutManager:
    """G samples per prompt with rewards; see the module docstring for the outcomes.

    ``target`` is an :class:`EnginePool` or one ``SGLangClient``; ``reward_fn`` an async reward
    (``megarl.rollout.rewards``), awaited with ``reward_timeout_s``. Counters over the manager's
    life: ``resubmitted``, ``rejected`` (by reason kind), ``reward_errors`` (by kind).
    ``EngineUnreachable`` (an engine gone for good) propagates: no later group could run either.
    """

    def __init__(self, target: EnginePool | SGLangClient, tokenizer, reward_fn: RewardFn, params: SamplingParams,
                 samples_per_prompt: int, routing: bool = True, sampling_mask: bool = True,
                 partial_rollout: str = "continue", reward_timeout_s: float = 30.0):
        if partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {partial_rollout!r}")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        self.target, self.tokenizer, self.params = target, tokenizer, params
        self.samples_per_prompt, self.routing, self.sampling_mask = samples_per_prompt, routing, sampling_mask
        self.partial_rollout = partial_rollout
        self.scorer = RewardScorer(reward_fn, reward_timeout_s)
        self.resubmitted = 0
        self.rejected: collections.Counter[str] = collections.Counter()

    @property
    def reward_errors(self) -> collections.Counter[str]:
        return self.scorer.errors

    @property
    def context_length(self) -> int:
        return self.target.model.context_length

    async def _generate(self, prompts: list[list[int]], params: SamplingParams,
                        group_ids: list[str]) -> tuple[list[RolloutSample], int]:
        kwargs = dict(group_ids=group_ids, return_routed_experts=self.routing, return_sampling_mask=self.sampling_mask)
        if isinstance(self.target, EnginePool):
            result = await self.target.generate_batch_counted(prompts, params, **kwargs)
            return result.samples, result.resubmitted
        return await self.target.generate_batch(prompts, params, **kwargs), 0

    def _refusal(self, prompt: Prompt, prompt_ids: list[int]) -> tuple[str, str] | None:
        """(kind, message) when the prompt cannot be generated from, else None."""
        if not prompt.text or not prompt_ids:
            return "empty_prompt", "the prompt has no text"
        if len(prompt_ids) + self.params.max_new_tokens > self.context_length:
            return "too_long", (f"prompt of {len(prompt_ids)} tokens + max_new_tokens {self.params.max_new_tokens} "
                                f"exceeds the context length {self.context_length}")
        return None

    def _reject(self, prompt_ids: list[int], group_id: str, kind: str, message: str) -> GroupResult:
        self.rejected[kind] += 1
        if self.rejected[kind] == 1:
            log.warning("group %s rejected (%s): %s (logged once per kind, counted in rejected)", group_id, kind,
                        message)
        g = self.samples_per_prompt
        return GroupResult(samples=[_error_sample(prompt_ids, group_id) for _ in range(g)], resubmitted=0, errors=g,
                           rejected=f"{kind}: {message}")

    async def generate_group(self, prompt: Prompt, group_id: str) -> GroupResult:
        """``samples_per_prompt`` scored samples of ``prompt`` (group ``group_id``)."""
        prompt_ids = self.tokenizer(prompt.text)["input_ids"] if prompt.text else []
        refusal = self._refusal(prompt, prompt_ids)
        if refusal is not None:
            return self._reject(prompt_ids, group_id, *refusal)
        g = self.samples_per_prompt
        try:
            samples, resubmitted = await self._generate([prompt_ids] * g, self.params, [group_id] * g)
            if self.partial_rollout == "abort_resubmit":
                samples, continued = await self._continue_aborted(samples)
                resubmitted += continued
        except EngineUnreachable:
            raise  # no engine left to generate on: the run cannot go on
        except (EngineError, ValueError) as e:
            return self._reject(prompt_ids, group_id, "engine_rejected", str(e))
        self.resubmitted += resubmitted
        outcomes = await asyncio.gather(*(self.scorer(self._reward_input(prompt, s)) for s in samples))
        errors = 0
        for sample, outcome in zip(samples, outcomes):
            sample.reward = outcome.value
            if outcome.error is not None:
                sample.finish_reason = FinishReason.ERROR
                errors += 1
        return GroupResult(samples=samples, resubmitted=resubmitted, errors=errors)

    async def generate_groups(self, prompts: list[Prompt], group_ids: list[str]) -> list[GroupResult]:
        """:meth:`generate_group` for every prompt, concurrently (the engines batch them)."""
        return list(await asyncio.gather(*(self.generate_group(p, g) for p, g in zip(prompts, group_ids))))

    async def _continue_aborted(self, samples: list[RolloutSample]) -> tuple[list[RolloutSample], int]:
        """Resubmit aborted samples as prompt + prefix until none is aborted; returns the spliced
        samples and the number of resubmitted requests."""
        resubmitted = 0
        while True:
            todo = [i for i, s in enumerate(samples) if s.finish_reason is FinishReason.ABORTED]
            for i in list(todo):
                if len(samples[i].response_ids) >= self.params.max_new_tokens:
                    samples[i].finish_reason = FinishReason.LENGTH  # aborted exactly at the limit
                    todo.remove(i)
            if not todo:
                return samples, resubmitted
            # Same remaining budget per request in one batch: group by prefix length.
            by_remaining: dict[int, list[int]] = collections.defaultdict(list)
            for i in todo:
                by_remaining[self.params.max_new_tokens - len(samples[i].response_ids)].append(i)
            batches = list(by_remaining.items())
            answers = await asyncio.gather(*(
                self._generate([samples[i].prompt_ids + samples[i].response_ids for i in indices],
                               dataclasses.replace(self.params, max_new_tokens=remaining),
                               [samples[i].group_id for i in indices])
                for remaining, indices in batches))
            for (_, indices), (continued, lost) in zip(batches, answers):
                for i, continuation in zip(indices, continued):
                    samples[i] = splice_continuation(samples[i], continuation)
                resubmitted += len(indices) + lost
            log.info("abort_resubmit: continued %d aborted samples", len(todo))

    def _reward_input(self, prompt: Prompt, sample: RolloutSample) -> RewardInput:
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return RewardInput(prompt=prompt, response_text=text, ended=sample.finish_reason is FinishReason.STOP,
                           sample=sample)


def score(sample: RolloutSample, problem: arithmetic.Problem, tokenizer) -> float:
    """The arithmetic reward of one sample (1.0 = exact answer then end-of-sequence)."""
    ids = list(sample.response_ids)
    ended = sample.finish_reason == FinishReason.STOP and bool(ids) and ids[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True)
    return arithmetic.reward(text, problem.answer, ended)


async def rollout_groups(client: SGLangClient | EnginePool, tokenizer, problems: list[arithmetic.Problem],
                         samples_per_prompt: int, params: SamplingParams, *, routing: bool,
                         sampling_mask: bool) -> list[RolloutSample]:
    """``samples_per_prompt`` samples for each arithmetic problem, rewards filled, in prompt-major
    order, sent as one batch (the fastest path on CPU for the demo's many short samples)."""
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
