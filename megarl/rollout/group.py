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
- a sample that comes back aborted (``pause(ABORT)``: a weight update under
  ``buffer.partial_rollout=abort_resubmit``, or a checkpoint reading the partial samples in flight)
  is resubmitted as prompt + its response so far, with the routes its tokens were computed with for
  the engine to replay over them, and the two parts are spliced into one sample
  (:func:`splice_continuation`). Under ``continue`` (the driver pauses with retract: requests resume
  under the new weights) and ``in_place`` (requests keep their KV cache; the tokens that mix
  versions are marked) no weight update aborts a request.

What the manager knows of a single-turn group in flight (``in_flight``: each attempt's sample so far,
finished or aborted with its tokens) is what a checkpoint carries of it
(:meth:`RolloutProducer.carry <megarl.pipeline.producer.RolloutProducer.carry>`); a resumed run hands it
back (``generate_group(..., carried=...)``) and the group goes on from there.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from megarl.engines.protocol import Engines
from megarl.engines.types import EngineError, EngineUnreachable, GenerationOptions, SamplingParams
from megarl.rollout.splice import splice_continuation
from megarl.rollout.teacher import TeacherScorer
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.reward_types import RewardInput
from megarl.tasks.rewards import RewardScorer

log = logging.getLogger(__name__)

PARTIAL_ROLLOUT_MODES = ("continue", "abort_resubmit", "in_place")


@dataclass
class PartialGroup:
    """A single-turn group in flight as far as its requests have come back: one sample per attempt
    (finished, or aborted with the tokens it had: continued by resubmitting it) and the requests sent
    again for it so far."""

    samples: list[RolloutSample]
    resubmitted: int


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
    ``scorer`` awaits the async reward (``megarl.tasks.rewards``) with its timeout; ``generation``: the
    sampling and what comes back with each token.
    Counters over the manager's life: ``resubmitted``, ``rejected`` (by reason kind), ``reward_errors`` (by kind).
    ``EngineUnreachable`` (an engine gone for good) propagates: no later group could run either.
    """

    def __init__(self, target: Engines, tokenizer, scorer: RewardScorer, generation: GenerationOptions,
                 samples_per_prompt: int, episodes=None, teacher: TeacherScorer | None = None,
                 add_special_tokens: bool = True):
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        self.target, self.tokenizer, self.params = target, tokenizer, generation.params
        self.samples_per_prompt = samples_per_prompt
        self.routing, self.sampling_mask = generation.routing, generation.sampling_mask
        self.episodes, self.teacher = episodes, teacher
        self.add_special_tokens = add_special_tokens  # False: prompts come rendered, with their own BOS
        self.scorer = scorer
        self.resubmitted = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.in_flight: dict[str, PartialGroup] = {}  # single-turn groups by id: their samples so far
        self._epoch = 0  # the requests' epoch (see mark)
        self._requests: collections.Counter[int] = collections.Counter()  # epoch -> requests out or not recorded

    def mark(self) -> int:
        """The epoch of the requests sent so far; those sent from now on are of a later one."""
        self._epoch += 1
        return self._epoch - 1

    async def returned(self, mark: int, timeout_s: float, poll_s: float = 0.01) -> bool:
        """Wait until every request sent by the epoch ``mark`` has come back and been recorded in
        ``in_flight`` (at most ``timeout_s``); whether they all did."""
        deadline = time.monotonic() + timeout_s
        while any(n for epoch, n in self._requests.items() if epoch <= mark):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    @contextlib.contextmanager
    def _request(self):
        """Counts a request of the current epoch from its sending until what it brought is recorded."""
        epoch = self._epoch
        self._requests[epoch] += 1
        try:
            yield
        finally:
            self._requests[epoch] -= 1

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

    async def generate_group(self, prompt: Prompt, group_id: str, carried: PartialGroup | None = None) -> GroupResult:
        """``samples_per_prompt`` scored samples of ``prompt`` (group ``group_id``); ``carried``: its samples so
        far (a checkpoint's, single-turn groups only), continued rather than generated anew."""
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
                samples, resubmitted = await self._single_turn(prompt_ids, group_id, carried)
        except EngineUnreachable:
            raise  # no engine left to generate on: the run cannot go on
        except (EngineError, ValueError) as e:
            return self._reject(prompt_ids, group_id, "engine_rejected", str(e))
        finally:
            self.in_flight.pop(group_id, None)
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

    async def _single_turn(self, prompt_ids: list[int], group_id: str,
                           carried: PartialGroup | None) -> tuple[list[RolloutSample], int]:
        """A single-turn group's samples (from ``carried`` on, when given), every aborted one continued,
        and the requests sent again for it."""
        if carried is None:
            with self._request():
                samples, resubmitted = await self._generate([prompt_ids] * self.samples_per_prompt, self.params,
                                                            [group_id] * self.samples_per_prompt)
                self.in_flight[group_id] = PartialGroup(list(samples), resubmitted)
        else:
            samples, resubmitted = list(carried.samples), carried.resubmitted
        return await self._continue_aborted(samples, group_id, resubmitted)

    async def _continue_aborted(self, samples: list[RolloutSample], group_id: str,
                                resubmitted: int) -> tuple[list[RolloutSample], int]:
        """Resubmit aborted samples as prompt + prefix until none is aborted, recording each state in
        ``in_flight``; returns the spliced samples and ``resubmitted`` plus the requests sent again."""
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
            self.in_flight[group_id] = PartialGroup(list(samples), resubmitted)
            with self._request():
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
                self.in_flight[group_id] = PartialGroup(list(samples), resubmitted)
            log.info("continued %d aborted samples", len(todo))

    def _reward_input(self, prompt: Prompt, sample: RolloutSample) -> RewardInput:
        """The reward sees the response, or a multi-turn episode's final policy turn (its answer)."""
        environment = np.flatnonzero(sample.loss_mask == 0) if sample.turn_ends else ()
        final = sample.response_ids[(int(environment[-1]) + 1 if len(environment) else 0):]
        text = self.tokenizer.decode(final, skip_special_tokens=True)
        return RewardInput(prompt=prompt, response_text=text, ended=sample.finish_reason is FinishReason.STOP,
                           sample=sample)
