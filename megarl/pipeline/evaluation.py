"""Held-out evaluation during a run (``eval.*``): the policy's engines answer the held-out prompts
(:mod:`megarl.tasks.heldout`) ``eval.samples_per_prompt`` times each at ``eval.temperature`` and once greedily,
scored by the task's reward, every ``eval.interval`` steps and after the last step.

Each evaluation runs under one weight version, the one its row names (``eval/weight_version``): it starts
right after the weight sync that made the engines serve that version (:meth:`Evaluation.start`, with no
pause of the training stream, whose groups keep generating beside it) and the next weight sync first waits
for it to end (:meth:`Evaluation.settle`, also before a colocated trainer takes the devices and after the
last step), so no evaluation request is in flight across a sync: a sync's pause (retract, abort or in place)
would otherwise continue it under the next version. Every answer's tokens are checked to carry that
version; a row whose answers do not is not written (logged as an error), nor is that of an evaluation
that failed (an engine lost): the run goes on either way.

The row (``step`` = the version), beside :mod:`megarl.metrics.evaluation`'s ``eval/reward``,
``eval/pass@1``, ``eval/pass@<k>``, ``eval/response_len_mean`` and ``eval/greedy/*``:
``eval/weight_version``, ``eval/prompts``, ``eval/errors`` (answers whose generation or reward failed,
scored 0), ``eval/seconds`` (its wall time), ``eval/wait_s`` (how long the next sync waited for it), and
the training stream's samples a second during the evaluation (``eval/stream_samples_per_s``) and between
the previous one and it (``eval/stream_samples_per_s_outside``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megarl.metrics.evaluation import greedy_metrics, sampled_metrics
from megarl.rollout.group import GroupResult, RolloutManager
from megarl.sample import FinishReason
from megarl.tasks.prompts import Prompt

log = logging.getLogger(__name__)
# the evaluation's requests' priority in the engines' queues (SamplingParams.priority): ahead of the training
# stream's queued requests (0), so that an evaluation ends long before the next sync
EVAL_PRIORITY = 1


@dataclass
class EvalRun:
    """One evaluation under way: its version, its task, when it started and the training stream's count then."""

    version: int
    task: asyncio.Task
    started: float
    stream_at_start: int
    outside: float | None  # the training stream's samples/s between the previous evaluation and this one


class Evaluation:
    """Evaluates ``prompts`` with ``sampled`` (``samples_per_prompt`` answers a prompt) and ``greedy`` (one; None:
    no greedy answers) at the versions :meth:`due` picks; ``write(step, row)`` writes a row,
    ``stream_samples()`` counts the training stream's samples so far. ``settings``: the ``eval`` section."""

    def __init__(self, prompts: Sequence[Prompt], sampled: RolloutManager, greedy: RolloutManager | None, settings,
                 write: Callable[[int, dict[str, float]], None], stream_samples: Callable[[], int]):
        self.prompts, self.sampled, self.greedy, self.settings = list(prompts), sampled, greedy, settings
        self.write, self.stream_samples = write, stream_samples
        self._run: EvalRun | None = None
        self._since = (time.monotonic(), stream_samples())  # the end of the previous evaluation

    def due(self, step: int, last_step: int) -> bool:
        """Whether the weights after ``step`` are evaluated: every ``eval.interval`` steps and the last."""
        interval = self.settings.interval
        return interval > 0 and (step % interval == 0 or step == last_step)

    def start(self, version: int) -> None:
        """Start evaluating the engines' weights, ``version`` (none may be under way)."""
        if self._run is not None:
            raise RuntimeError(f"an evaluation of version {self._run.version} is still under way")
        now, count = time.monotonic(), self.stream_samples()
        outside = (count - self._since[1]) / (now - self._since[0]) if now > self._since[0] else None
        self._run = EvalRun(version, asyncio.create_task(self._answers(version)), now, count, outside)

    async def _answers(self, version: int) -> tuple[list[GroupResult], list[GroupResult], float, int]:
        """Every prompt's sampled and greedy answers; when they were done and the stream's count then."""
        sampled = self.sampled.generate_groups(self.prompts, [f"eval{version}:{i}" for i in range(len(self.prompts))])
        greedy = (self.greedy.generate_groups(self.prompts, [f"eval{version}g:{i}" for i in range(len(self.prompts))])
                  if self.greedy is not None else _nothing())
        done = await asyncio.gather(sampled, greedy)
        return done[0], done[1], time.monotonic(), self.stream_samples()

    async def settle(self) -> dict[str, float] | None:
        """Wait for the evaluation under way, if any, and write its row; the row (None: none was under way, or
        its answers were not all of its version)."""
        run, self._run = self._run, None
        if run is None:
            return None
        waited = time.monotonic()
        try:
            sampled, greedy, ended, stream_at_end = await run.task
        except Exception as exc:  # noqa: BLE001 -- an evaluation never stops the run
            log.error("evaluation of version %d failed (%s: %s); no row", run.version, type(exc).__name__, exc)
            self._since = (time.monotonic(), self.stream_samples())
            return None
        row = self._row(run, sampled, greedy, ended - run.started)
        self._since = (ended, stream_at_end)
        if row is None:
            return None
        row |= {"eval/wait_s": time.monotonic() - waited,
                "eval/stream_samples_per_s": (stream_at_end - run.stream_at_start) / (ended - run.started)}
        if run.outside is not None:
            row["eval/stream_samples_per_s_outside"] = run.outside
        self.write(run.version, row)
        return row

    def _row(self, run: EvalRun, sampled: list[GroupResult], greedy: list[GroupResult],
             seconds: float) -> dict[str, float] | None:
        """The row of ``run`` (module docstring) from its answers; None when not every answer is of its version."""
        results = [*sampled, *greedy]
        versions = {int(v) for r in results for s in r.samples if s.finish_reason is not FinishReason.ERROR
                    for v in s.model_version}
        if versions - {run.version}:
            log.error("evaluation of version %d: answers hold tokens of versions %s; its row is not written",
                      run.version, sorted(versions))
            return None
        s, threshold = self.settings, self.settings.pass_threshold
        row = sampled_metrics([[x.reward for x in r.samples[:s.samples_per_prompt]] for r in sampled],
                              [[len(x.response_ids) for x in r.samples[:s.samples_per_prompt]] for r in sampled],
                              threshold, (1, s.pass_k))
        if greedy:
            row |= greedy_metrics([r.samples[0].reward for r in greedy],
                                  [len(r.samples[0].response_ids) for r in greedy], threshold)
        errors = sum(x.finish_reason is FinishReason.ERROR for r in results for x in r.samples)
        return row | {"eval/weight_version": float(run.version), "eval/prompts": float(len(sampled)),
                      "eval/errors": float(errors), "eval/seconds": seconds}

    def cancel(self) -> None:
        """Stop an evaluation under way (the run ends)."""
        if self._run is not None:
            self._run.task.cancel()
            self._run = None


async def _nothing() -> list:
    return []
