"""Multi-turn episodes: an environment interface (reset / step) and a built-in calculator tool.

An episode is one sample (docs/architecture.md, "The sample"). The policy generates a turn; the environment reads
the turn's text and answers with an observation, whose tokens are appended to the response with
``loss_mask = 0``; the next turn is generated from the prompt + everything so far (token ids, never
re-tokenized text); and so on until the environment says done, a turn ends without stopping by itself
(length or abort), the turn limit is reached, or the response budget is spent
(``RolloutSample.episode_end`` says which; ``turn_ends`` where each policy turn ends). The episode
always ends with a policy turn.

Fields of the environment's tokens (loss_mask 0, the trainer never scores them):
``rollout_logprobs`` 0.0, ``model_version`` the version of the policy token before them, and
sampling-mask rows holding just the token itself (the token is inside its mask, and 0.0 is its
log-prob renormalised over that one-token mask, so the sample's invariants hold everywhere).
``routed_experts`` are kept per turn: the rows of the tokens a turn's request fed first (the previous
turn's last token, the observation, the turn's own tokens) come from that request, as
:func:`~megarl.rollout.splice.splice_continuation` does for an aborted request. Each turn's request
carries the rows of the tokens fed before it, which the engine replays when it computes them again (a
weight update between turns flushes its cache), so every turn is computed over the routes the trainer
replays, and the episode's routing equals the final request's.
"""
from __future__ import annotations

import ast
import asyncio
import collections
import dataclasses
import logging
import operator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from megarl.engines.protocol import Engines
from megarl.engines.types import SamplingParams
from megarl.rollout.splice import splice_continuation
from megarl.sample import FinishReason, RolloutSample, SamplingMask
from megarl.tasks import calculator
from megarl.tasks.prompts import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one policy turn: text appended to the episode (may be empty)
    and whether the episode is over (then ``observation`` is not appended)."""

    observation: str
    done: bool


class Environment(Protocol):
    """One episode's environment. A fresh instance (or a ``reset``) per episode."""

    stop: tuple[str, ...]  # stop strings that end a policy turn (e.g. a tool call's closing tag)

    async def reset(self, prompt: Prompt) -> str:
        """Start an episode for ``prompt``; returns the text the policy sees first."""
        ...

    async def step(self, turn_text: str) -> EnvStep:
        """React to the policy's latest turn (decoded without special tokens)."""
        ...


class CalculatorError(ValueError):
    """The expression is not plain arithmetic on numbers."""


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg,
              ast.UAdd: operator.pos}


def calculate(expression: str) -> float | int:
    """The value of ``+ - * / // %`` and parentheses over integer and decimal numbers; anything
    else (names, calls, powers, ...) raises CalculatorError. Never evaluates Python code."""

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise CalculatorError(f"not plain arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise CalculatorError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}") from e
    try:
        return value(tree.body)
    except ZeroDivisionError as e:
        raise CalculatorError("division by zero") from e


class CalculatorEnv:
    """A calculator tool. A policy turn that contains ``call_open`` calls the tool with the text
    after the last ``call_open`` (the turn stops at ``call_close``, a stop string); the observation
    is ``result_format`` of the value or of ``error``. A turn without a call ends the episode (it
    is the final answer), and so does the call after ``max_calls`` calls.

    ``call_open=""`` makes every turn a call (its whole text is the expression).
    """

    def __init__(self, max_calls: int = 3, call_open: str = "<calc>", call_close: str = "</calc>",
                 result_format: str = "<result>{}</result>"):
        self.max_calls, self.call_open, self.call_close, self.result_format = max_calls, call_open, call_close, \
            result_format
        self.stop = (call_close,) if call_close else ()
        self.calls = 0

    async def reset(self, prompt: Prompt) -> str:
        self.calls = 0
        return prompt.text

    async def step(self, turn_text: str) -> EnvStep:
        if self.call_open and self.call_open not in turn_text:
            return EnvStep(observation="", done=True)
        if self.calls >= self.max_calls:
            return EnvStep(observation="", done=True)
        self.calls += 1
        expression = turn_text.rsplit(self.call_open, 1)[-1] if self.call_open else turn_text
        expression = expression.removesuffix(self.call_close) if self.call_close else expression
        try:
            result = str(calculate(expression))
        except CalculatorError as e:
            result = f"error: {e}"
        return EnvStep(observation=self.result_format.format(result), done=False)


@dataclass(frozen=True)
class EpisodeLimits:
    """When an episode ends without the environment saying so: after ``max_turns`` policy turns, or
    when the response (policy and environment tokens) would pass ``max_response_tokens`` or the
    engine's context."""

    max_turns: int
    max_response_tokens: int

    def __post_init__(self):
        if self.max_turns < 1 or self.max_response_tokens < 1:
            raise ValueError(f"max_turns and max_response_tokens must be >= 1, got {self.max_turns}, "
                             f"{self.max_response_tokens}")


# Why an episode ended (``RolloutSample.episode_end``); "error: <why>" when the environment raised.
EPISODE_ENDS = ("done", "max_turns", "max_tokens", "length", "aborted")


@dataclass
class _Episode:
    """One episode in progress: its environment and the sample's fields so far."""

    env: Environment
    prompt_ids: list[int]
    budget: int  # response tokens the episode may hold
    key: str  # the episode's id
    response: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mixed: list[bool] = field(default_factory=list)  # per token: sampled from a forward mixing two versions
    mask_rows: list[list[int]] = field(default_factory=list)
    routing: np.ndarray | None = None  # rows of every token fed to the engine so far, by the turn that fed it
    turn_ends: list[int] = field(default_factory=list)
    turn_start: int = 0  # where the latest policy turn begins in the response
    observation: int = 0  # environment tokens at the end of the response, not yet followed by a policy turn
    finish: FinishReason = FinishReason.STOP
    end: str | None = None
    prefill_tokens: int = 0  # prompt tokens of the turns' requests, and those served from the prefix cache
    cached_tokens: int = 0

    def absorb(self, turn: RolloutSample) -> None:
        """Append one policy turn generated from ``prompt_ids + response``. Routing rows of the tokens
        fed before stay those of the turn that fed them; the turn's rows start at the first token it fed."""
        r = len(turn.response_ids)
        self.finish = turn.finish_reason
        self.prefill_tokens += turn.prefill_tokens
        self.cached_tokens += turn.cached_tokens
        if r == 0:  # aborted before it ran: the episode ends with the policy turn before the observation
            self._drop_observation()
            return
        if turn.routed_experts is not None:
            known = 0 if self.routing is None else len(self.routing)
            self.routing = turn.routed_experts if self.routing is None else np.concatenate(
                [self.routing, turn.routed_experts[known:]])
        self.turn_start = len(self.response)
        self.response += turn.response_ids
        self.loss_mask += turn.loss_mask.tolist()
        self.logprobs += turn.rollout_logprobs.tolist()
        self.versions += turn.model_version.tolist()
        self.mixed += [False] * r if turn.mixed_versions is None else turn.mixed_versions.tolist()
        if turn.sampling_mask is not None:
            self.mask_rows += [turn.sampling_mask.row(i).tolist() for i in range(r)]
        self.turn_ends.append(len(self.response))
        self.observation = 0

    def observe(self, tokens: list[int]) -> None:
        """Append environment tokens: loss mask 0, log-prob 0, the version of the token before them."""
        self.response += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [self.versions[-1]] * len(tokens)
        self.mixed += [False] * len(tokens)
        self.mask_rows += [[t] for t in tokens]
        self.observation = len(tokens)

    def _drop_observation(self) -> None:
        if self.observation:
            for field_ in (self.response, self.loss_mask, self.logprobs, self.versions, self.mixed, self.mask_rows):
                del field_[-self.observation:]
            self.observation = 0

    def last_turn(self) -> list[int]:
        """The tokens of the latest policy turn (not the observation before it)."""
        return self.response[self.turn_start:self.turn_ends[-1]]

    def sample(self, group_id: str, episode_id: str, routing: bool, sampling_mask: bool) -> RolloutSample:
        self._drop_observation()  # only when the episode ended on an unanswered observation (an aborted turn)
        return RolloutSample(
            prompt_ids=self.prompt_ids, response_ids=self.response, loss_mask=np.asarray(self.loss_mask, np.uint8),
            rollout_logprobs=np.asarray(self.logprobs, np.float32), model_version=np.asarray(self.versions, np.int32),
            routed_experts=self.routing if routing else None,
            sampling_mask=SamplingMask.from_rows(self.mask_rows) if sampling_mask else None,
            finish_reason=self.finish, group_id=group_id, episode_id=episode_id, turn_ends=tuple(self.turn_ends),
            episode_end=self.end or "max_turns", mixed_versions=np.asarray(self.mixed) if any(self.mixed) else None,
            prefill_tokens=self.prefill_tokens, cached_tokens=self.cached_tokens)


class EnvEpisodes:
    """Runs the episodes of prompt groups: one fresh environment (``make_env()``) per episode, the
    group's episodes in lock-step (each turn of the live episodes is one batched engine request).

    ``abort_resubmit``: a turn that comes back aborted (a weight update in ``abort`` mode) is sent
    again as the episode so far + the turn's tokens, and the parts are spliced
    (:func:`~megarl.rollout.splice.splice_continuation`); otherwise an aborted turn ends its episode.
    Counters over the object's life: ``ends`` (by :data:`EPISODE_ENDS` or "error"), ``errors``
    (environment exceptions, by class). Engine errors propagate (the caller rejects the group).
    """

    def __init__(self, target: Engines, tokenizer, make_env, params: SamplingParams, limits: EpisodeLimits, *,
                 routing: bool = True, sampling_mask: bool = True, abort_resubmit: bool = False):
        self.target, self.tokenizer, self.make_env, self.params, self.limits = target, tokenizer, make_env, params, \
            limits
        self.routing, self.sampling_mask, self.abort_resubmit = routing, sampling_mask, abort_resubmit
        self.ends: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()

    async def run_group(self, prompt: Prompt, group_id: str, n: int) -> tuple[list[RolloutSample], int]:
        """``n`` episodes of ``prompt`` (episode ids ``<group_id>.<i>``) and the number of turn requests
        sent again after an abort."""
        episodes = []
        for i in range(n):
            env = self.make_env()
            ids = self.tokenizer(await env.reset(prompt))["input_ids"]
            episodes.append(_Episode(env=env, prompt_ids=ids, key=f"{group_id}.{i}", budget=min(
                self.limits.max_response_tokens, self.target.model.context_length - len(ids))))
        resubmitted = 0
        for turn in range(self.limits.max_turns):
            by_budget: dict[int, list[_Episode]] = collections.defaultdict(list)
            for e in episodes:
                if e.end is None:
                    budget = min(self.params.max_new_tokens, e.budget - len(e.response))
                    if budget < 1:
                        e.end = "max_tokens"
                    else:
                        by_budget[budget].append(e)
            if not by_budget:
                break
            turns = await asyncio.gather(*(self._turn(batch, budget, group_id) for budget, batch in by_budget.items()))
            stepping = []
            for (budget, batch), (results, again) in zip(by_budget.items(), turns):
                resubmitted += again
                for e, result in zip(batch, results):
                    e.absorb(result)
                    if e.finish is FinishReason.ABORTED or not result.response_ids:
                        e.end = "aborted"
                    elif e.finish is FinishReason.LENGTH:
                        e.end = "length" if budget == self.params.max_new_tokens else "max_tokens"
                    else:
                        stepping.append(e)
            await self._step(stepping, last_turn=turn == self.limits.max_turns - 1)
        samples = []
        for e in episodes:
            sample = e.sample(group_id, e.key, self.routing, self.sampling_mask)
            self.ends[sample.episode_end.split(":")[0]] += 1
            samples.append(sample)
        return samples, resubmitted

    async def _turn(self, batch: list[_Episode], budget: int, group_id: str) -> tuple[list[RolloutSample], int]:
        """One turn of ``batch`` with at most ``budget`` new tokens each; aborted turns continued when
        ``abort_resubmit``. Returns the turns and how many requests were sent again."""
        params = dataclasses.replace(self.params, max_new_tokens=budget,
                                     stop=tuple(self.params.stop) + tuple(batch[0].env.stop))
        contexts = [e.prompt_ids + e.response for e in batch]
        turns = await self.target.generate_batch(contexts, params, group_ids=[group_id] * len(batch),
                                                 return_routed_experts=self.routing,
                                                 return_sampling_mask=self.sampling_mask,
                                                 affinity=[group_id] * len(batch),
                                                 prefix_routes=[e.routing for e in batch])
        resubmitted = 0
        while self.abort_resubmit:
            todo = [i for i, t in enumerate(turns)
                    if t.finish_reason is FinishReason.ABORTED and len(t.response_ids) < budget]
            if not todo:
                break
            for i in todo:  # one request each: their remaining budgets differ
                rest = dataclasses.replace(params, max_new_tokens=budget - len(turns[i].response_ids))
                [more] = await self.target.generate_batch([contexts[i] + turns[i].response_ids], rest,
                                                          group_ids=[group_id], return_routed_experts=self.routing,
                                                          return_sampling_mask=self.sampling_mask,
                                                          affinity=[group_id],
                                                          prefix_routes=[turns[i].routed_experts])
                turns[i] = splice_continuation(turns[i], more)
            resubmitted += len(todo)
        for turn in turns:  # aborted exactly at the budget: the turn is complete
            if turn.finish_reason is FinishReason.ABORTED and len(turn.response_ids) == budget:
                turn.finish_reason = FinishReason.LENGTH
        return turns, resubmitted

    async def _step(self, episodes: list[_Episode], last_turn: bool) -> None:
        """The environments' answers to the turns that stopped by themselves."""
        steps = await asyncio.gather(*(e.env.step(self.tokenizer.decode(e.last_turn(), skip_special_tokens=True))
                                       for e in episodes), return_exceptions=True)
        for e, step in zip(episodes, steps):
            if isinstance(step, Exception):
                e.end, e.finish = f"error: {type(step).__name__}: {step}", FinishReason.ERROR
                self.errors[type(step).__name__] += 1
                if self.errors[type(step).__name__] == 1:
                    log.warning("environment raised %s: %s (logged once per kind, counted)", type(step).__name__,
                                step)
            elif step.done:
                e.end = "done"
            elif last_turn:
                e.end = "max_turns"
            else:
                observation = self.tokenizer.encode(step.observation, add_special_tokens=False)
                if len(e.response) + len(observation) >= e.budget:
                    e.end = "max_tokens"
                elif observation:
                    e.observe(observation)


ENVIRONMENTS = {
    # the calculator demo's format (megarl/tasks/calculator.py): "[23+58]" calls the tool, "=81;" answers; one call
    "calculator": lambda: CalculatorEnv(max_calls=1, call_open=calculator.CALL_OPEN, call_close=calculator.CALL_CLOSE,
                                        result_format=calculator.RESULT_FORMAT),
}


def make_env_factory(name: str):
    """The environment factory ``task.env`` names (a fresh environment per call)."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown task.env {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]
