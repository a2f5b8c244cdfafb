"""Rollout of prompt groups on the engines: G samples per prompt, rewards, advantages.

:class:`RolloutManager` turns one :class:`Prompt` into a :class:`GroupResult`: G samples from an
``megarl.engines.protocol.Engines`` (a pool or one client), each scored by the reward function with a timeout.
Every outcome is counted, none is fatal:

- a prompt the engine cannot take (empty, or prompt + ``max_new_tokens`` beyond the context, or
  rejected by the engine) gives G empty samples with finish_reason error and ``rejected`` saying why;
- a reward that raises or times out gives that sample reward 0.0 and ``finish_reason`` error;
- with ``teacher`` (on-policy distillation) every scored sample gets the teacher's log-prob of each
  response token; a sample the teacher fails to score is an error sample (reward 0.0);
- with ``episodes`` (anything with ``run_group(prompt, group_id, n) -> (samples, resubmitted)``: an
  :class:`~megarl.rollout.env.EnvEpisodes` for ``task.env``, ``megarl.agents.rollout.AgentEpisodes``
  for ``task.agent``), each sample is a multi-turn episode (several, one per role, for multi-agent
  episodes); an episode that failed is an error sample (reward 0.0); samples an agent rewarded keep
  their reward;
- with ``partial_rollout="abort_resubmit"`` a sample that comes back aborted (``pause(ABORT)``,
  e.g. for a weight update) is resubmitted as prompt + its response so far, with the routes its
  tokens were computed with for the engine to replay over them, and the two parts are spliced into
  one sample (:func:`splice_continuation`); with ``"continue"`` it is kept as it is
  (the driver pauses with retract, and requests resume under the new weights), and so with ``"in_place"``
  (the driver pauses in place: requests keep their KV cache; the tokens that mix versions are marked).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from megarl.engines.protocol import Engines
from megarl.engines.types import EngineError, EngineUnreachable, SamplingParams
from megarl.rollout.splice import splice_continuation
from megarl.rollout.teacher import TeacherScorer
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.reward_types import RewardFn, RewardInput
from megarl.tasks.rewards import RewardScorer

log = logging.getLogger(__name__)

PARTIAL_ROLLOUT_MODES = ("continue", "abort_resubmit", "in_place")


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


class RolloutManager:
    """G samples per prompt with rewards; see the module docstring for the outcomes.

    ``target`` is an ``EnginePool`` or one ``SGLangClient`` (``megarl.engines.protocol.Engines``);
    ``reward_fn`` an async reward (``megarl.tasks.rewards``), awaited with ``reward_timeout_s``.
    Counters over the manager's life: ``resubmitted``, ``rejected`` (by reason kind), ``reward_errors`` (by kind).
    ``EngineUnreachable`` (an engine gone for good) propagates: no later group could run either.
    """

    def __init__(self, target: Engines, tokenizer, reward_fn: RewardFn, params: SamplingParams,
                 samples_per_prompt: int, routing: bool = True, sampling_mask: bool = True,
                 partial_rollout: str = "continue", reward_timeout_s: float = 30.0, episodes=None,
                 teacher: TeacherScorer | None = None, add_special_tokens: bool = True):
        if partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {partial_rollout!r}")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        self.target, self.tokenizer, self.params = target, tokenizer, params
        self.samples_per_prompt, self.routing, self.sampling_mask = samples_per_prompt, routing, sampling_mask
        self.partial_rollout = partial_rollout
        self.episodes, self.teacher = episodes, teacher
        self.add_special_tokens = add_special_tokens  # False: prompts come rendered, with their own BOS
        self.scorer = RewardScorer(reward_fn, reward_timeout_s)
        self.resubmitted = 0
        self.rejected: collections.Counter[str] = collections.Counter()

    @property
    def reward_errors(self) -> collections.Counter[str]:
        return self.scorer.errors

    @property
    def context_length(self) -> int:
        return self.target.model.context_length

    async def _generate(self, prompts: list[list[int]], params: SamplingParams, group_ids: list[str],
                        prefix_routes: list[np.ndarray | None] | None = None) -> tuple[list[RolloutSample], int]:
        result = await self.target.generate_batch_counted(prompts, params, group_ids=group_ids,
                                                          return_routed_experts=self.routing,
                                                          return_sampling_mask=self.sampling_mask, affinity=group_ids,
                                                          prefix_routes=prefix_routes)
        return result.samples, result.resubmitted

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
        prompt_ids = (self.tokenizer(prompt.text, add_special_tokens=self.add_special_tokens)["input_ids"]
                      if prompt.text else [])
        refusal = self._refusal(prompt, prompt_ids)
        if refusal is not None:
            return self._reject(prompt_ids, group_id, *refusal)
        g = self.samples_per_prompt
        try:
            if self.episodes is not None:
                samples, resubmitted = await self.episodes.run_group(prompt, group_id, g)
            else:
                samples, resubmitted = await self._generate([prompt_ids] * g, self.params, [group_id] * g)
                if self.partial_rollout == "abort_resubmit":
                    samples, continued = await self._continue_aborted(samples)
                    resubmitted += continued
        except EngineUnreachable:
            raise  # no engine left to generate on: the run cannot go on
        except (EngineError, ValueError) as e:
            return self._reject(prompt_ids, group_id, "engine_rejected", str(e))
        self.resubmitted += resubmitted
        # episodes may end in error, agents may have rewarded their samples already
        scorable = [s for s in samples if s.finish_reason is not FinishReason.ERROR and s.reward is None]
        outcomes = await asyncio.gather(*(self.scorer(self._reward_input(prompt, s)) for s in scorable))
        for sample, outcome in zip(scorable, outcomes):
            sample.reward = outcome.value
            if outcome.error is not None:
                sample.finish_reason = FinishReason.ERROR
        if self.teacher is not None:  # on-policy distillation: the teacher's log-prob of every response token
            await self.teacher.score([s for s in samples if s.finish_reason is not FinishReason.ERROR])
        errors = 0
        for sample in samples:
            if sample.finish_reason is FinishReason.ERROR:
                sample.reward = 0.0
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
                               [samples[i].group_id for i in indices],
                               [samples[i].routed_experts for i in indices])
                for remaining, indices in batches))
            for (_, indices), (continued, lost) in zip(batches, answers):
                for i, continuation in zip(indices, continued):
                    samples[i] = splice_continuation(samples[i], continuation)
                resubmitted += len(indices) + lost
            log.info("abort_resubmit: continued %d aborted samples", len(todo))

    def _reward_input(self, prompt: Prompt, sample: RolloutSample) -> RewardInput:
        """The reward sees the response, or a multi-turn episode's final policy turn (its answer)."""
        environment = np.flatnonzero(sample.loss_mask == 0) if sample.turn_ends else ()
        final = sample.response_ids[(int(environment[-1]) + 1 if len(environment) else 0):]
        text = self.tokenizer.decode(final, skip_special_tokens=True)
        return RewardInput(prompt=prompt, response_text=text, ended=sample.finish_reason is FinishReason.STOP,
                           sample=sample)
