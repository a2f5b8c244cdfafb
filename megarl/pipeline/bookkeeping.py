"""The books of an RL run's steps: one metrics row a step, the trained-prompts log, and how a resumed
run drops the rows it will redo.

:class:`StepBooks` owns the run directory's ``metrics.jsonl`` (through :class:`MetricsFile`, with
the run's trackers: TensorBoard, wandb, MLflow) and ``trained_prompts.jsonl`` (one ``{"step", "prompts"}`` line a step:
the audit trail that shows no prompt is trained twice across resumes), the GPU stats and the step's
clock. :func:`combine_updates` joins the results of one step's optimizer updates into the step's.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import operator
import time
from collections.abc import Mapping
from pathlib import Path

from megarl.algos.advantages import BatchStats
from megarl.metrics.expert_load import expert_load_metrics
from megarl.metrics.gpu import GpuStats
from megarl.metrics.sink import MetricsFile
from megarl.metrics.trackers import TrackerSettings
from megarl.pipeline.buffer import Batch
from megarl.sample import RolloutSample
from megarl.trainer.rl_step import RLStepResult

log = logging.getLogger(__name__)

JSONL_LOGS = ("metrics.jsonl", "trained_prompts.jsonl")  # the run directory's per-step logs
SUMMED_METRICS = ("mismatch/tokens_outside_mask",)  # the rl_step metrics that are counts


def combine_updates(results: list[RLStepResult]) -> RLStepResult:
    """One RL step's result from its updates': grad norms and metrics averaged, except counts
    (:data:`SUMMED_METRICS`: summed), maxima (``*_max``: the largest) and minima (``*_min``: the smallest);
    applied when every update was; their expert loads summed. A metric an update left out (over an empty token
    set) comes from the others."""
    if len(results) == 1:
        return results[0]
    metrics = {}
    for key in dict.fromkeys(k for r in results for k in r.metrics):
        values = [r.metrics[key] for r in results if key in r.metrics]
        if key.endswith("_max"):
            metrics[key] = max(values)
        elif key.endswith("_min"):
            metrics[key] = min(values)
        elif key in SUMMED_METRICS:
            metrics[key] = sum(values)
        else:
            metrics[key] = sum(values) / len(values)
    loads = [r.expert_load for r in results if r.expert_load is not None]
    return RLStepResult(grad_norm=sum(r.grad_norm for r in results) / len(results),
                        applied=all(r.applied for r in results), metrics=metrics,
                        expert_load=functools.reduce(operator.add, loads) if loads else None)


def episode_metrics(samples: list[RolloutSample]) -> dict[str, float]:
    """Multi-turn episodes: policy turns per episode and the share of each way they ended; agent
    episodes: the share that made a parsed tool call, and an unparsable one."""
    agent = [s.tool_calls for s in samples if s.tool_calls is not None]
    tools = {"agent/tool_call_frac": sum(c.get("parsed", 0) > 0 for c in agent) / len(agent),
             "agent/unparsable_call_frac": sum(c.get("unparsable", 0) > 0 for c in agent) / len(agent)} if agent else {}
    episodes = [s for s in samples if s.turn_ends]
    if not episodes:
        return tools
    ends = collections.Counter(s.episode_end.split(":")[0] for s in episodes)
    return {"episode/turns_mean": sum(len(s.turn_ends) for s in episodes) / len(episodes),
            **{f"episode/end_{end}_frac": n / len(episodes) for end, n in sorted(ends.items())}, **tools}


def prefix_cache_metrics(samples: list[RolloutSample]) -> dict[str, float]:
    """``rollout/cached_token_frac``: of the prompt tokens the samples' requests sent to the engines
    (every turn and continuation), the share the engines served from their prefix cache; empty when
    no sample counted any (samples that never reached an engine)."""
    sent = sum(s.prefill_tokens for s in samples)
    return {"rollout/cached_token_frac": sum(s.cached_tokens for s in samples) / sent} if sent else {}


def load_metrics(result: RLStepResult) -> dict[str, float]:
    """The step's ``experts/*`` metrics (:mod:`megarl.metrics.expert_load`), empty when it compared no routes."""
    load = result.expert_load
    return {} if load is None else expert_load_metrics(load.engine, load.trainer, load.layers)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the RL rows of ``path`` after ``last_step`` (what a resumed run redoes); warm-up rows stay."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kept = [json.dumps(row) for row in rows
                if row["step"] <= last_step or any(k.startswith("warmup/") for k in row)]
        path.write_text("".join(line + "\n" for line in kept))


def _figure(value: float | None) -> str:
    """A log-prob difference for the step's log line; ``-`` when the step had no such tokens."""
    return "-" if value is None else f"{value:.2e}"


class StepBooks:
    """The per-step logs of the run in ``run_dir`` (module docstring), opened for a run whose last
    completed step is ``start_step``: the rows after it are dropped first, the files (and ``trackers``, the
    run's: :mod:`megarl.metrics.trackers`; None: TensorBoard) are closed when ``stack`` closes. The clock:
    :meth:`start` before the first step, :meth:`training_started` once a step's batch is taken,
    :meth:`sync_started` when its weight sync begins, then :meth:`record`."""

    def __init__(self, run_dir: Path, start_step: int, stack: contextlib.ExitStack | contextlib.AsyncExitStack,
                 trackers: TrackerSettings | None = None):
        for name in JSONL_LOGS:
            truncate_jsonl(run_dir / name, start_step)
        self.metrics = MetricsFile(run_dir, trackers)
        stack.callback(self.metrics.close)
        self._trained = stack.enter_context((run_dir / "trained_prompts.jsonl").open("a"))
        self._gpu = GpuStats()
        stack.callback(self._gpu.close)
        self._clock: dict[str, float] = {}

    def start(self, generated_tokens: int) -> None:
        """The steps begin; ``generated_tokens``: the producer's count so far (``perf/tokens_per_s`` is from here)."""
        self._clock["started"], self._clock["produced"] = time.monotonic(), generated_tokens

    def training_started(self) -> float:
        """A step's batch is taken; the time (``time.monotonic``)."""
        self._clock["train_start"] = time.monotonic()
        return self._clock["train_start"]

    def sync_started(self) -> None:
        self._clock["sync_start"] = time.monotonic()

    def record(self, step: int, batch: Batch, stats: BatchStats, result: RLStepResult, more: Mapping[str, float],
               generated_tokens: int) -> dict[str, float]:
        """Write ``step``'s trained prompts and its metrics row, log its line; the row. ``result``: the
        step's combined updates; ``more``: the rest of the row (ledger, weight sync, teacher);
        ``generated_tokens``: the producer's count so far."""
        self._trained.write(json.dumps({"step": step, "prompts": sorted(g.index for g in batch.groups)}) + "\n")
        self._trained.flush()
        now, c, staleness, wait_s = time.monotonic(), self._clock, batch.staleness, batch.wait_s
        row = {"reward/mean": stats.reward_mean, "response/len_mean": stats.response_len_mean,
               "groups/mixed_frac": stats.mixed_group_frac, "train/grad_norm": result.grad_norm,
               **{k if "/" in k else f"train/{k}": v for k, v in result.metrics.items()},
               "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
               "perf/tokens_per_s": (generated_tokens - c["produced"]) / (now - c["started"]),
               "perf/trainer_idle_frac": wait_s / (now - c["train_start"] + wait_s),
               "time/wait_s": wait_s, "time/train_s": c["sync_start"] - c["train_start"],
               "sync/seconds": now - c["sync_start"], **more, **episode_metrics(batch.samples),
               **prefix_cache_metrics(batch.samples), **stats.metrics, **load_metrics(result),
               **self._gpu.sample()}
        self.metrics.log(step, row)
        log.info("step %d: reward %.3f, mismatch %s max %s (tokens of the trainer's weights: fresh and boundary), "
                 "drift %s (stale), staleness %.2f, wait %.1fs train %.1fs sync %.1fs", step, stats.reward_mean,
                 _figure(row.get("mismatch/current_logprob_abs_diff")),
                 _figure(row.get("mismatch/current_logprob_abs_diff_max")), _figure(row.get("staleness/logprob_drift")),
                 row["staleness/mean"], row["time/wait_s"], row["time/train_s"], row["sync/seconds"])
        return row
