"""The demo task: single-digit addition with a checkable answer.

A problem is ``a+b=`` (``0 <= a, b <= max_operand``); the answer is the decimal sum followed by
the end-of-sequence token. The reward is 1.0 for the exact answer and 0.0 otherwise.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "3+4="
    answer: str  # e.g. "7"


@functools.cache
def all_problems(max_operand: int = 9) -> tuple[Problem, ...]:
    """Every problem of the task, in a fixed order (made once per ``max_operand``: each batch draws from it)."""
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    return tuple(Problem(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1))


def sample_problems(n: int, rng: random.Random, max_operand: int = 9) -> list[Problem]:
    """``n`` problems drawn uniformly with replacement."""
    problems = all_problems(max_operand)
    return [problems[rng.randrange(len(problems))] for _ in range(n)]


def corpus(max_operand: int = 9) -> list[str]:
    """The task's own text (prompt + answer per line): what the demo tokenizer is trained on."""
    return [p.prompt + p.answer for p in all_problems(max_operand)]


def reward(response_text: str, answer: str, ended_with_eos: bool) -> float:
    """1.0 when the response is exactly the answer and generation stopped at end-of-sequence."""
    return 1.0 if ended_with_eos and response_text.strip() == answer else 0.0
