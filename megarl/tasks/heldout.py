"""Held-out prompts for evaluation during a run, never in the training stream.

- The built-in arithmetic task: ``count`` of its problems, picked by a seeded permutation of its own
  (``eval.seed``); the training source draws from the other problems only (:func:`arithmetic_heldout`
  gives both).
- A dataset task (``jsonl`` / ``parquet``): the first ``count`` rows of the evaluation file
  (``eval.path``, read with the task's keys and chat template), without the rows whose prompt the
  training file also holds (:func:`dataset_heldout` says how many it left out); without an evaluation
  file, ``count`` rows of the training file, picked by a seeded permutation, which the training source
  then never visits (:func:`training_rows_heldout`).
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.tasks import arithmetic
from megarl.tasks.prompts import BadPrompt, DatasetSource, Prompt

log = logging.getLogger(__name__)


def arithmetic_heldout(max_operand: int, count: int, seed: int) -> tuple[list[Prompt], frozenset[str]]:
    """``count`` held-out problems of the arithmetic task (a permutation seeded by ``seed``) as prompts, and
    their prompt texts (what the training source leaves out). ValueError when ``count`` leaves no problem
    to train on."""
    problems = list(arithmetic.all_problems(max_operand))
    if count >= len(problems):
        raise ValueError(f"eval.prompts: {count} held-out problems leave none of the task's {len(problems)} "
                         f"(task.max_operand={max_operand}) to train on")
    random.Random(f"heldout:{seed}").shuffle(problems)
    chosen = problems[:count]
    return [Prompt(text=p.prompt, answer=p.answer) for p in chosen], frozenset(p.prompt for p in chosen)


def dataset_heldout(path: str | Path, train_path: str | Path, count: int, *, prompt_key: str,
                    answer_key: str | None, file_format: str,
                    render: Callable[[Any], str] | None = None) -> tuple[list[Prompt], int]:
    """The first ``count`` rows of the dataset ``path`` whose prompt is not also a prompt of ``train_path``
    (compared as the rows wrote them), as prompts; and how many rows were left out for that. Rows that are
    no prompt are skipped (logged). ValueError when no row is left."""
    train = DatasetSource(train_path, prompt_key=prompt_key, answer_key=None, shuffle=False, file_format=file_format)
    seen = {_key(value) for value in train.column(prompt_key)}
    source = DatasetSource(path, prompt_key=prompt_key, answer_key=answer_key, shuffle=False,
                           file_format=file_format, render=render)
    prompts, overlapping, bad = [], 0, 0
    for row, value in enumerate(source.column(prompt_key)):
        if len(prompts) == count:
            break
        if _key(value) in seen:
            overlapping += 1
            continue
        try:
            prompts.append(source.row(row))
        except BadPrompt as exc:
            bad += 1
            log.warning("eval.path: %s", exc)
    if not prompts:
        raise ValueError(f"eval.path: {path} has no prompt that is not also in the training data {train_path} "
                         f"({overlapping} overlapping, {bad} not prompts)")
    if overlapping:
        log.warning("eval.path: left out %d rows of %s whose prompt the training data %s also holds", overlapping,
                    path, train_path)
    return prompts, overlapping


def training_rows_heldout(path: str | Path, count: int, seed: int, *, prompt_key: str, answer_key: str | None,
                          file_format: str,
                          render: Callable[[Any], str] | None = None) -> tuple[list[Prompt], frozenset[int]]:
    """``count`` rows of the training dataset ``path`` held out (a permutation seeded by ``seed``) as prompts,
    and their row indices (what the training source leaves out). Rows that are no prompt are skipped (and
    stay out of training). ValueError when ``count`` leaves no row to train on."""
    source = DatasetSource(path, prompt_key=prompt_key, answer_key=answer_key, shuffle=False,
                           file_format=file_format, render=render)
    if count >= len(source):
        raise ValueError(f"eval.prompts: {count} held-out rows leave none of {path}'s {len(source)} to train on")
    rows = list(range(len(source)))
    random.Random(f"heldout:{seed}").shuffle(rows)
    prompts = []
    for row in rows[:count]:
        try:
            prompts.append(source.row(row))
        except BadPrompt as exc:
            log.warning("eval: %s", exc)
    if not prompts:
        raise ValueError(f"eval.prompts: none of the {count} rows of {path} held out is a prompt")
    return prompts, frozenset(rows[:count])


def _key(value: Any) -> str:
    """A prompt as the row wrote it, comparable across files (a list of chat messages by its repr)."""
    return value if isinstance(value, str) else repr(value)
