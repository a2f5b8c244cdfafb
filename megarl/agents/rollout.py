"""Agent programs as rollouts: ``task.agent = "package.module:function"`` runs that function once per
episode against megarl's gateway (``megarl/agents/gateway.py``) and turns what it generated into samples.

The contract of an agent function, ``async def`` or plain::

    async def agent(client: openai.AsyncOpenAI, prompt: megarl.tasks.prompts.Prompt) -> float | dict[str, float] | None
    def agent(client: openai.OpenAI, prompt: megarl.tasks.prompts.Prompt) -> float | dict[str, float] | None

``client`` is an ordinary OpenAI client whose base URL is this episode's gateway session and whose
``api_key`` is that session's credential (no retries, ``timeout_s`` per request); the agent calls
``client.chat.completions.create`` or ``client.completions.create`` as often as it needs, with ``model``
naming the role when there are roles (anything otherwise). Its return value:

- a float: the episode's reward, given to every sample;
- a dict: the reward of each role (multi-agent); it must name exactly the trained roles that made
  calls (not the ``frozen_roles``, served by frozen models: their calls give no sample);
- None: the rollout's reward function scores each sample's final completion (``reward_fn``; without
  one the rewards stay None for the caller to fill).

Where it runs: with ``workers`` (:class:`~megarl.agents.workers.AgentWorkers`, ``task.agent_workers`` > 0)
each episode runs in a thread of an agent worker process on any node, its client talking to the gateway
over the network, its tools' work there; without, in the driver: an ``async def`` agent in the driver's
event loop (it must not block it: one blocking call or CPU-bound tool stalls every episode), a plain
one in a thread of its own. The samples are the same either way: the gateway records them in the driver.

An episode gives one sample per segment of its trajectory (``megarl/agents/trajectory.py``: one
per trained role, more when an agent rewrote its history), with ``role`` and ``episode_end`` set:

Every sample carries its episode's ``tool_calls`` (the gateway's counts of answers with parsed and
unparsable tool calls). Its ``episode_end``:

- ``done``: the agent returned a valid result; ``finish_reason`` the last call's;
- ``max_turns`` / ``max_tokens``: the gateway refused a call for a budget (whatever the agent did
  then); ``finish_reason`` length, the recorded samples kept, the agent's reward if it returned one;
- ``error: ...``: the agent raised, ran past ``timeout_s``, returned something else than the above,
  or made no call, or its worker died; ``finish_reason`` error, reward 0.0 (not trained on), counted in
  ``errors`` by kind (raised, timeout, malformed_result, no_calls, worker_lost) and logged once per
  kind. An episode without a call to a trained role gives one empty error sample.

An engine that was unreachable during the episode raises :class:`EngineUnreachable` (no later
episode could run either), as ``RolloutManager`` does. The design follows AReaL's
``areal/experimental/openai`` (an OpenAI client whose calls are recorded into interactions with
tokens and log-probs, rewards set per episode) and verl's agent loop (agents run concurrently as
asyncio tasks in front of a server pool).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import numbers

import numpy as np

from megarl.agents.gateway import AgentGateway, Session
from megarl.agents.invoke import Failure, run_agent
from megarl.agents.spec import AgentFn, AgentResult
from megarl.agents.workers import AgentWorkers
from megarl.sample import FinishReason, RolloutSample
from megarl.tasks.prompts import Prompt
from megarl.tasks.reward_types import RewardInput
from megarl.tasks.rewards import RewardScorer

log = logging.getLogger(__name__)


class AgentEpisodes:
    """Runs agent episodes (module docstring) through one gateway, started on the first :meth:`run`
    in the running loop; :meth:`aclose` stops it.

    ``gateway``: the episodes' gateway, not started yet (``megarl/agents/gateway.py``; with ``workers``,
    listening on a host the workers' nodes reach), closed by :meth:`aclose`. ``timeout_s`` bounds an
    episode. ``scorer`` scores episodes whose agent returned None (its failures: reward 0, error).
    Counters over the object's life: ``errors`` (episode errors by kind), ``budget_ends`` (by
    budget), ``reward_errors`` (by kind), ``tool_call_counts`` (the gateway's). ``workers``: where the
    episodes run (None: in the driver); the caller closes them.
    """

    def __init__(self, gateway: AgentGateway, agent: AgentFn, *, timeout_s: float, scorer: RewardScorer | None = None,
                 workers: AgentWorkers | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.gateway = gateway
        self.tokenizer, self.agent, self.timeout_s, self.workers = gateway.tokenizer, agent, timeout_s, workers
        self.scorer = scorer
        self._starting = asyncio.Lock()
        self.errors: collections.Counter[str] = collections.Counter()
        self.budget_ends: collections.Counter[str] = collections.Counter()

    @property
    def tool_call_counts(self) -> collections.Counter[str]:
        return self.gateway.tool_call_counts

    @property
    def reward_errors(self) -> collections.Counter[str]:
        return self.scorer.errors if self.scorer is not None else collections.Counter()

    async def aclose(self) -> None:
        await self.gateway.aclose()

    async def run_group(self, prompt: Prompt, group_id: str, n: int) -> tuple[list[RolloutSample], int]:
        """``n`` episodes of ``prompt`` (episode ids ``<group_id>.<i>``) for ``RolloutManager``: their
        samples, each role's in a group of its own (``<group_id>/<role>``: advantages compare a role
        with itself), and 0 requests sent again (the gateway splices aborted calls itself)."""
        episodes = await asyncio.gather(*(self.run(prompt, group_id, f"{group_id}.{i}") for i in range(n)))
        samples = [s for episode in episodes for s in episode]
        for sample in samples:
            if sample.role:
                sample.group_id = f"{group_id}/{sample.role}"
        return samples, 0

    async def run(self, prompt: Prompt, group_id: str, episode_id: str) -> list[RolloutSample]:
        """One episode of the agent on ``prompt``: its samples (at least one), rewards filled when
        the agent returned them (or ``reward_fn`` scored them)."""
        async with self._starting:  # concurrent first episodes: one start, all after it
            if not self.gateway.started:
                await self.gateway.start()
        session = self.gateway.open_session(group_id, episode_id)
        runner = run_agent if self.workers is None else self.workers.run
        try:
            result, failure = await runner(self.agent, self.gateway.base_url(session.id), session.key, prompt,
                                           self.timeout_s)
        finally:
            self.gateway.close_session(session.id)
        if session.engine_failure is not None:
            raise session.engine_failure
        if failure is None:
            failure = self._check_result(result, session)
        samples = session.trajectory.samples(group_id=group_id, episode_id=episode_id, routing=self.gateway.routing,
                                             sampling_mask=self.gateway.sampling_mask,
                                             frozen_roles=self.gateway.frozen_roles)
        if failure is not None and (session.budget_end is None or not samples):
            samples = self._error(failure, samples, prompt, group_id, episode_id)
        else:
            await self._finish(samples, session, result, failure, prompt)
        for sample in samples:
            sample.tool_calls = dict(session.tool_call_counts)
        return samples

    async def _finish(self, samples: list[RolloutSample], session: Session, result: AgentResult,
                      failure: Failure | None, prompt: Prompt) -> None:
        """How the episode ended and its rewards, on the samples of an episode that did not fail."""
        end = session.budget_end or "done"
        if session.budget_end is not None:
            self.budget_ends[end] += 1
        for sample in samples:
            sample.episode_end = end
            if session.budget_end is not None:
                sample.finish_reason = FinishReason.LENGTH
        if failure is None and result is not None:
            for sample in samples:
                sample.reward = float(result[sample.role] if isinstance(result, dict) else result)
        elif self.scorer is not None:
            await self._score(prompt, samples, session)

    def _check_result(self, result, session: Session) -> Failure | None:
        called = session.trajectory.roles
        if not called:
            return "no_calls", "agent made no call to the gateway"
        frozen_roles = self.gateway.frozen_roles
        roles = [role for role in called if role not in frozen_roles]
        if not roles:
            return "no_calls", f"agent called only the frozen roles {sorted(called)}, no trained one"
        if result is None:
            return None
        if isinstance(result, dict):
            if set(result) != set(roles):
                frozen = f" (the frozen roles {sorted(frozen_roles)} get none)" if frozen_roles else ""
                return "malformed_result", (f"agent returned rewards for roles {sorted(map(str, result))}, "
                                            f"its calls were of the trained roles {sorted(roles)}{frozen}")
            values = list(result.values())
        else:
            values = [result]
        if not all(isinstance(v, numbers.Real) and math.isfinite(v) for v in values):
            return "malformed_result", (f"agent returned {result!r:.80}; expected a finite float, a dict of them "
                                        "per role, or None")
        return None

    def _error(self, failure: Failure, samples: list[RolloutSample], prompt: Prompt, group_id: str,
               episode_id: str) -> list[RolloutSample]:
        kind, reason = failure
        self.errors[kind] += 1
        if self.errors[kind] == 1:
            log.warning("agent episode %s: %s (logged once per kind, counted in errors)", episode_id, reason)
        if not samples:
            prompt_ids = self.tokenizer(prompt.text)["input_ids"] if prompt.text else []
            empty = np.zeros(0, np.float32)
            samples = [RolloutSample(prompt_ids=list(prompt_ids), response_ids=[], loss_mask=np.zeros(0, np.uint8),
                                     rollout_logprobs=empty, model_version=np.zeros(0, np.int32),
                                     routed_experts=None, sampling_mask=None, finish_reason=FinishReason.ERROR,
                                     group_id=group_id, episode_id=episode_id)]
        for sample in samples:
            sample.finish_reason, sample.reward, sample.episode_end = FinishReason.ERROR, 0.0, f"error: {reason}"
        return samples

    async def _score(self, prompt: Prompt, samples: list[RolloutSample], session: Session) -> None:
        """Each sample's reward from ``reward_fn`` on its final completion."""
        segments = session.trajectory.trained_segments(self.gateway.frozen_roles)
        inputs = [RewardInput(prompt=prompt, response_text=self.tokenizer.decode(seg.final_turn_ids,
                                                                                  skip_special_tokens=True),
                              ended=seg.calls[-1].sample.finish_reason is FinishReason.STOP, sample=sample)
                  for sample, seg in zip(samples, segments)]
        for sample, outcome in zip(samples, await asyncio.gather(*(self.scorer(i) for i in inputs))):
            sample.reward = outcome.value
            if outcome.error is not None:
                sample.finish_reason = FinishReason.ERROR
