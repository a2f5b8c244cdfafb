"""The calculator demo task: addition where calling the tool beats answering from memory.

A problem is the arithmetic task's ``a+b=`` (two-digit operands in the recipe). An episode either
answers at once (``81<eos>``) or calls the calculator first: the policy's turn ``[23+58]`` (stopped
by ``]``), the tool's answer ``=81;`` (environment tokens, loss mask 0), then the final turn
``81<eos>``. The reward is the arithmetic reward of the final turn (megarl/rollout/group.py).
"""
from __future__ import annotations

from megarl.tasks.arithmetic import Problem

CALL_OPEN, CALL_CLOSE, RESULT_FORMAT = "[", "]", "={};"


def transcript(problem: Problem, use_tool: bool) -> list[tuple[str, bool]]:
    """The episode after the prompt as (text, written by the policy) pieces; the end-of-sequence
    token follows the last piece."""
    if not use_tool:
        return [(problem.answer, True)]
    expression = problem.prompt.removesuffix("=")
    return [(f"{CALL_OPEN}{expression}{CALL_CLOSE}", True), (RESULT_FORMAT.format(problem.answer), False),
            (problem.answer, True)]
