"""Multi-turn episodes: an environment interface (reset / step) and a built-in calculator tool.

An episode is one sample (docs/architecture.md, "The sample"). The policy generates a turn; the environment reads
the turn's text and answers with an observation, whose tokens are appended to the response with
``loss_mask = 0``; the next turn is generated from the prompt + everything so far; and so on until
the environment says done, a turn ends without stopping by itself (length or abort), the turn
limit is reached, or the response budget is spent. The episode always ends with a policy turn.

Fields of the environment's tokens (loss_mask 0, the trainer never scores them):
``rollout_logprobs`` 0.0, ``model_version`` the version of the policy token before them, and
sampling-mask rows holding just the token itself (the token is inside its mask, and 0.0 is its
log-prob renormalised over that one-token mask, so the sample's invariants hold everywhere).
``routed_experts`` come from the final request, whose prompt held every earlier token: its rows
cover the whole episode, environment tokens included, as the trainer's forward pass sees them.
"""
from __future__ import annotations

import ast
import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megarl.engines.client import SamplingParams
from megarl.engines.protocol import Engines
from megarl.sample import FinishReason, RolloutSample, SamplingMask
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


async def run_episode(target: Engines, tokenizer, env: Environment, prompt: Prompt,
                      params: SamplingParams, *, max_turns: int, max_response_tokens: int, routing: bool = True,
                      sampling_mask: bool = True, group_id: str = "", episode_id: str = "") -> RolloutSample:
    """One episode of ``env`` as one sample (see the module docstring). Each policy turn gets at
    most ``params.max_new_tokens`` tokens, the whole response at most ``max_response_tokens``;
    ``env.stop`` is added to the turn's stop strings. Engine errors propagate."""
    if max_turns < 1 or max_response_tokens < 1:
        raise ValueError(f"max_turns and max_response_tokens must be >= 1, got {max_turns}, {max_response_tokens}")
    prompt_ids = tokenizer(await env.reset(prompt))["input_ids"]
    response: list[int] = []
    loss_mask, logprobs, versions, mask_rows = [], [], [], []
    last, last_version = None, 0
    for turn in range(max_turns):
        budget = min(params.max_new_tokens, max_response_tokens - len(response))
        if budget < 1:
            break  # the last turn filled the response budget exactly
        turn_params = dataclasses.replace(params, max_new_tokens=budget, stop=tuple(params.stop) + tuple(env.stop))
        [last] = await target.generate_batch([prompt_ids + response], turn_params, group_ids=[group_id],
                                             return_routed_experts=routing, return_sampling_mask=sampling_mask)
        r = len(last.response_ids)
        response += last.response_ids
        loss_mask.append(last.loss_mask)
        logprobs.append(last.rollout_logprobs)
        versions.append(last.model_version)
        if sampling_mask:
            mask_rows += [last.sampling_mask.row(i).tolist() for i in range(r)]
        if r == 0 or last.finish_reason is not FinishReason.STOP or turn == max_turns - 1:
            break
        last_version = int(last.model_version[-1])
        step = await env.step(tokenizer.decode(last.response_ids, skip_special_tokens=True))
        if step.done:
            break
        observation = tokenizer.encode(step.observation, add_special_tokens=False)
        if not observation:
            continue
        if len(response) + len(observation) >= max_response_tokens:
            log.info("episode %s: response budget spent after %d turns", episode_id or group_id, turn + 1)
            break
        response += observation
        loss_mask.append(np.zeros(len(observation), np.uint8))
        logprobs.append(np.zeros(len(observation), np.float32))
        versions.append(np.full(len(observation), last_version, np.int32))
        mask_rows += [[token] for token in observation]
    return RolloutSample(
        prompt_ids=prompt_ids, response_ids=response, loss_mask=np.concatenate(loss_mask),
        rollout_logprobs=np.concatenate(logprobs), model_version=np.concatenate(versions),
        routed_experts=last.routed_experts if routing else None,
        sampling_mask=SamplingMask.from_rows(mask_rows) if sampling_mask else None,
        finish_reason=last.finish_reason, group_id=group_id, episode_id=episode_id,
    )
