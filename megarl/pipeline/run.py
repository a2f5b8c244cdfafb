"""An RL run's pipeline: the driver (``megarl/train.py``) reads as the algorithm, this module holds
what it runs on and its step's calls.

:func:`open_pipeline` starts Ray and the run's parts (:mod:`megarl.pipeline.startup`: engines, trainer
ranks and resume, weight sync, rollout), starts the producer and stops everything on exit. A run
directory with a checkpoint resumes from its latest one (trainer state, data position, sample ledger;
the engines get the checkpoint's weights). The modes differ only in lag and buffer depth
(:mod:`megarl.pipeline.modes`).

Per step, :meth:`Pipeline.take_batch` takes the oldest groups from the buffer, :meth:`Pipeline.train`
runs the step's optimizer updates, :meth:`Pipeline.sync_weights` moves the new weights into the
engines, and :meth:`Pipeline.end_step` checks the ledger, keeps the step's books
(:mod:`megarl.pipeline.bookkeeping`) and saves a checkpoint when one is due. With
``placement=colocated`` the engines hand the devices to the trainer from the end of ``take_batch``
to the end of ``sync_weights`` (:mod:`megarl.pipeline.colocate`).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import Progress
from transformers import AutoTokenizer

from megarl.algos.advantages import BatchStats
from megarl.algos.gae import ragged_gae
from megarl.algos.kl_control import KLController
from megarl.algos.value_loss import value_metrics
from megarl.config.components import micro_batching, tracker_settings
from megarl.engines.pool import EnginePool
from megarl.engines.types import PauseMode
from megarl.parallel import Layout
from megarl.pipeline.bookkeeping import StepBooks, combine_updates
from megarl.pipeline.buffer import Batch, RolloutBuffer
from megarl.pipeline.colocate import Colocation, trainer_release
from megarl.pipeline.evaluation import Evaluation
from megarl.pipeline.ledger import Ledger
from megarl.pipeline.membership import Membership
from megarl.pipeline.modes import PAUSE_FOR_PARTIAL_ROLLOUT
from megarl.pipeline.node_watch import cancel_on_loss, confirmed_loss, loss_of, rank_died_in, watch_trainer
from megarl.pipeline.producer import RolloutProducer
from megarl.pipeline.signals import StopRequest
from megarl.pipeline.startup.engines import ENGINE_CPUS, EnginePlan
from megarl.pipeline.startup.placement import place_run, work_platform
from megarl.pipeline.startup.rollout import start_rollout
from megarl.pipeline.startup.sync import start_sync
from megarl.pipeline.startup.trainer import checkpoint_dir
from megarl.rollout.teacher import TeacherScorer
from megarl.sample import RolloutSample
from megarl.sync import AdapterSync, WeightSync, WeightSyncError
from megarl.trainer.actor import TrainerGroup
from megarl.trainer.checkpoint import prune_checkpoints
from megarl.trainer.launch import ray_for_run
from megarl.trainer.micro_batching import MicroBatching
from megarl.trainer.rl_batch import RLBatch, build_rl_batch
from megarl.trainer.rl_step import RLStepResult

log = logging.getLogger(__name__)

LOSS_TEARDOWN_S = 60.0  # the most a run waits for its teardown after a trainer node was lost
LOSS_CONFIRM_S = 60.0  # after a trainer call failed in Ray, how long Ray may take to report a node dead


def step_progress() -> Progress:
    """The RL steps' progress bar: redrawn once a second on a terminal; elsewhere (a log file) drawn
    once at its end, with no refresh thread re-rendering it meanwhile."""
    console = Console()
    return Progress(console=console, auto_refresh=console.is_terminal, refresh_per_second=1)


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in order as ``parts`` consecutive runs whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


@dataclass
class Pipeline:
    """Everything one RL run holds; see the module docstring."""

    cfg: DictConfig
    trainer: TrainerGroup
    pool: EnginePool
    sync: WeightSync | AdapterSync
    buffer: RolloutBuffer
    producer: RolloutProducer
    ledger: Ledger
    books: StepBooks
    batching: MicroBatching  # how every trainer step cuts and runs its batch
    start_step: int  # the last completed step (0 for a new run)
    colocation: Colocation | None = None  # placement=colocated: engines and trainer take turns
    teacher: TeacherScorer | None = None  # on-policy distillation (teacher.hf_path): scores every sample
    membership: Membership | None = None  # disaggregated: engines lost, returned, joining and leaving
    kl_control: KLController | None = None  # algorithm.kl_in_reward: the KL coefficient of the next step's rewards
    _kl_metrics: dict[str, float] = field(default_factory=dict, repr=False)  # the last step's kl/* metrics
    evaluation: Evaluation | None = None  # eval.*: held-out prompts answered beside the training stream
    _progress: Progress | None = field(default=None, repr=False)

    @property
    def stop_signal(self) -> str | None:
        """The signal that asked the run to stop (see :class:`StopRequest`), else None."""
        return StopRequest.signal_name

    @property
    def pause_mode(self) -> PauseMode:
        """How the engines pause for a weight sync (``buffer.partial_rollout``)."""
        return PAUSE_FOR_PARTIAL_ROLLOUT[self.cfg.buffer.partial_rollout]

    def steps(self) -> Iterator[int]:
        """The steps still to run, with a progress bar; ends early when a stop signal arrived
        (the step before it checkpointed). While they run, Ctrl-C is such a signal (a second one
        cancels the run at once)."""
        if self.stop_signal is not None:
            log.warning("stopped by %s before the first step", self.stop_signal)
            return
        with StopRequest.ctrl_c_stops_after_the_step(), step_progress() as self._progress:
            self._bar = self._progress.add_task(f"RL ({self.cfg.mode})", total=self.cfg.steps,
                                                completed=self.start_step)
            self.books.start(self.producer.generated_tokens)
            if self.evaluation is not None and self.cfg.eval.before_training and self.start_step == 0:
                self.evaluation.start(0)  # the engines serve the starting weights
            for step in range(self.start_step + 1, self.cfg.steps + 1):
                yield step
                if self.stop_signal is not None:
                    log.warning("stopped by %s after step %d (checkpoint saved)", self.stop_signal, step)
                    return

    async def take_batch(self, step: int) -> Batch:
        """``rollout.prompts_per_step`` groups for ``step`` (the trainer holds version ``step - 1``);
        stale groups are dropped and counted by the buffer."""
        t0 = time.monotonic()
        taken = await self.producer.guard(self.buffer.take(self.cfg.rollout.prompts_per_step,
                                                           trainer_version=step - 1))
        self.producer.taken(taken.groups + taken.dropped_stale)
        if self.colocation is not None:  # the devices go to the trainer: nothing generates until the sync
            await self.settle_evaluation()
            await self.colocation.before_training()
        wait_s = self.books.training_started() - t0
        return Batch(groups=taken.groups, staleness=taken.staleness, wait_s=wait_s)

    async def train(self, batch: Batch, step: int, penalties: list[float] | None = None) -> RLStepResult:
        """``trainer.updates_per_step`` optimizer steps on ``batch`` (advantages filled): its prompt
        groups split, in order, into as many mini-batches of near-equal size, one ``rl_step`` each
        (:func:`combine_updates` joins their results). With several and ``algorithm.old_policy=recompute``
        the trainer's log-probs of the whole batch are taken once before the first: every update's PPO
        ratio (and ``mismatch/*``) is against the policy before the step. With a critic, its values of the
        whole batch come first and give the GAE advantages (:meth:`gae_targets`, ``penalties``: what
        :meth:`kl_penalties` took from each reward), and the critic trains on each mini-batch after the
        policy. ``rollout/mixed_version_tokens`` counts the response tokens left out of the loss because
        their forward mixed two weight versions."""
        parts = split_evenly(batch.groups, self.cfg.trainer.updates_per_step)
        samples = [s for g in batch.groups for s in g.samples]
        whole = self.rl_batch(samples, step)
        fit = await self.gae_targets(whole, samples, penalties) if self.cfg.critic.enabled else {}
        if len(parts) > 1 and self.cfg.algorithm.old_policy == "recompute":
            whole.old_logprobs = await self.trainer.policy_logprobs(whole, self.batching)
        results, start = [], 0
        for groups in parts:
            count = sum(len(g.samples) for g in groups)
            mini = whole if len(parts) == 1 else whole.select(range(start, start + count))
            results.append(await self._update(mini))
            start += count
        combined = combine_updates(results)
        combined.metrics |= fit | {"rollout/mixed_version_tokens": float(whole.mixed_tokens)}
        return combined

    async def _update(self, mini: RLBatch) -> RLStepResult:
        """One policy update on the mini-batch ``mini``, then, with a critic, one critic update on it (its
        ``critic/*`` metrics join the result's)."""
        result = await self.trainer.rl_step(mini, self.cfg.algorithm, self.batching)
        if self.cfg.critic.enabled:
            fitted = await self.trainer.critic_step(mini, self.batching, self.cfg.critic.value_clip)
            result.metrics |= fitted.metrics
        return result

    async def gae_targets(self, whole: RLBatch, samples: list[RolloutSample],
                          penalties: list[float] | None) -> dict[str, float]:
        """Fill ``whole``'s ``old_values`` (the critic's, before the step), ``returns`` and ``token_advantages``
        (GAE at ``algorithm.gamma`` / ``lam``, whitened, :func:`megarl.algos.gae.ragged_gae`) from each
        sample's reward minus its penalty; the values' fit to the returns (:func:`value_metrics`)."""
        if whole.token_advantages is not None:
            raise ValueError("algorithm.advantage=gae takes the sequence reward alone, but the batch has per-token "
                             "advantages (turn rewards)")
        a = self.cfg.algorithm
        values = await self.trainer.critic_values(whole, self.batching)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        if penalties is not None:
            rewards -= torch.tensor(penalties, dtype=torch.float64)
        whole.token_advantages, whole.returns = ragged_gae(rewards, values, whole.loss_mask, whole.cu_seqlens,
                                                           a.gamma, a.lam)
        whole.old_values = values
        return value_metrics(values, whole.returns, whole.loss_mask)

    def rl_batch(self, samples: list[RolloutSample], step: int) -> RLBatch:
        """The trainer's tensors for ``samples`` (advantages filled) at ``step``, where the trainer
        holds version ``step - 1`` (per-token staleness against it)."""
        return build_rl_batch(samples, with_sampling_mask=self.cfg.rollout.keep_sampling_mask, trainer_version=step - 1)

    async def kl_penalties(self, samples: list[RolloutSample], step: int) -> list[float] | None:
        """``beta * sum_t KL_t`` to the reference per sample at ``step`` when ``algorithm.kl_in_reward`` (taken from
        the rewards before the advantages, as verl's ``use_kl_in_reward``), else None. ``beta``: the KL
        controller's coefficient (``algorithm.kl_ctrl``), which then moves with the batch's mean token KL
        (:class:`megarl.algos.kl_control.KLController`, as verl's ``apply_kl_penalty``); both join the step's
        metrics as ``kl/coef`` and ``kl/reward_kl``."""
        algo = self.cfg.algorithm
        if not (algo.kl_in_reward and algo.kl_coef != 0.0):
            return None
        batch = build_rl_batch(samples, with_sampling_mask=self.cfg.rollout.keep_sampling_mask, with_advantages=False,
                               trainer_version=step - 1)
        sums = await self.trainer.sequence_kl(batch, algo, self.batching)
        trained = torch.zeros(len(batch), dtype=torch.float64).index_add_(
            0, torch.repeat_interleave(torch.arange(len(batch)), batch.lengths), (batch.loss_mask > 0).double())
        mean_kl = sum(kl / max(n, 1.0) for kl, n in zip(sums, trained.tolist())) / len(sums)
        beta = self.kl_control.value
        self.kl_control.update(mean_kl, len(samples))
        self._kl_metrics = {"kl/coef": beta, "kl/reward_kl": mean_kl}
        return [beta * kl for kl in sums]

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Sync the trainer's weights into the engines as ``version`` and let generation use them;
        the sync's metrics. A failed sync is reported and survived: engines held with partial
        weights are brought to ``version`` from disk, dead ones when their supervisor has
        restarted them (``pool.membership.on_restart``). Disaggregated engines come and go around it
        (:mod:`megarl.pipeline.membership`; ``rollout/engines`` in the metrics)."""
        self.books.sync_started()
        await self.settle_evaluation()  # no evaluation request is in flight across a sync
        if self.colocation is not None:  # the engines get their memory back around the sync
            synced = await self.colocation.after_training(lambda: self._sync(version))
            synced.update(self.colocation.metrics())
        elif self.membership is not None:
            await self.membership.before_sync()
            synced = await self._sync(version)
            synced.update(await self.membership.after_sync())
        else:
            synced = await self._sync(version)
        await self.producer.set_engine_version(version)
        if self.evaluation is not None and self.evaluation.due(version, self.cfg.steps) and "sync/failed" not in synced:
            self.evaluation.start(version)
        return synced

    async def settle_evaluation(self) -> None:
        """Wait for the evaluation under way (if any) to end and write its row
        (:meth:`megarl.pipeline.evaluation.Evaluation.settle`)."""
        if self.evaluation is not None:
            await self.evaluation.settle()

    async def _sync(self, version: int) -> dict[str, float]:
        """One sync to ``version``; after a failure, held engines are recovered, and when an engine failed
        (it died mid-sync) the others, resumed on their previous weights, are synced again once: the next
        batch must come from ``version`` (sync mode waits for it)."""
        for attempt in (1, 2):
            try:
                synced = (await self._sync_update(version)).metrics()
                return synced | ({"sync/retried": 1.0} if attempt > 1 else {})
            except WeightSyncError as exc:
                log.error("%s", exc)
                for client in self.pool.clients:
                    if client.base_url in exc.held:
                        await self.sync.recover(client)
                if not (exc.failed and self.sync.engines):
                    break
        return {"sync/failed": 1.0}

    async def _sync_update(self, version: int):
        """``sync.update`` to ``version``, ended early (WeightSyncError naming the failed engines) when one of
        its engines is lost meanwhile, rather than at ``sync.timeout_s``."""
        update = asyncio.ensure_future(self.sync.update(version, self.pause_mode))
        if self.membership is None:
            return await update
        lost = asyncio.ensure_future(self.membership.sync_engine_lost())
        try:
            await asyncio.wait([update, lost], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            update.cancel()
            raise
        finally:
            lost.cancel()
        if not update.done():
            log.warning("an engine of the weight sync to version %d was lost: ending the sync", version)
            update.cancel()
        return await update

    async def end_step(self, step: int, batch: Batch, stats: BatchStats, result: RLStepResult,
                       synced: dict[str, float]) -> None:
        """The step's books: ledger check, trained-prompts log and metrics row (:class:`StepBooks`),
        progress, checkpoint. ``synced`` is what :meth:`sync_weights` returned."""
        self.ledger.check()
        more = {**self.ledger.metrics(), **synced, **(self.teacher.metrics() if self.teacher is not None else {}),
                **self._kl_metrics}
        self.books.record(step, batch, stats, result, more, self.producer.generated_tokens)
        if step == self.cfg.steps:  # the last evaluation's row before the run ends
            await self.settle_evaluation()
        self._progress.update(self._bar, advance=1, description=f"RL ({self.cfg.mode}) reward {stats.reward_mean:.2f}")
        if self._save_due(step):
            await self.save(step)

    def _save_due(self, step: int) -> bool:
        interval = self.cfg.trainer.save_interval
        return step == self.cfg.steps or self.stop_signal is not None or (interval > 0 and step % interval == 0)

    async def save(self, step: int) -> None:
        """Checkpoint the trainer with the data position and the ledger (and the KL controller's state), and with
        the rollouts under way unless ``buffer.carry_in_flight`` is off (:meth:`RolloutProducer.carry`) (all
        ranks, collective)."""
        carry = self.cfg.buffer.carry_in_flight and self.colocation is None  # colocated: nothing runs across a step
        position = await self.producer.carry(self.pool) if carry else self.producer.position()
        if self.kl_control is not None:
            position["kl_ctrl"] = self.kl_control.state_dict()
        path = await self.trainer.save_checkpoint(str(checkpoint_dir(self.cfg)), step, position)
        pruned = prune_checkpoints(checkpoint_dir(self.cfg), self.cfg.trainer.keep_checkpoints)
        log.info("step %d: checkpoint %s%s", step, path,
                 f" (deleted {', '.join(p.name for p in pruned)}: trainer.keep_checkpoints)" if pruned else "")


@contextlib.asynccontextmanager
async def open_pipeline(cfg: DictConfig, start_checkpoint: str) -> AsyncIterator[Pipeline]:
    """Build (or resume) the run's pipeline; everything is stopped when the block exits. Engines
    start with the trainer ranks and load while the ranks build (colocated ones once they are built).
    A stop request during start-up cancels it (:meth:`StopRequest.cancels_the_start_up`). A trainer node
    or rank lost while the block runs, or a rank whose process died during start-up, ends it with
    :class:`~megarl.pipeline.node_watch.TrainerLost`."""
    layout = Layout.from_config(cfg.parallel)
    stack = contextlib.AsyncExitStack()
    try:
        start_tasks_eagerly(stack)
        agent_cpus = math.ceil(cfg.task.agent_workers * cfg.task.agent_worker_cpus) if cfg.task.agent else 0
        stack.enter_context(ray_for_run(layout.world_size + cfg.topology.engine_count + agent_cpus))
        StopRequest.install()  # again: ray.init replaced the handlers with its own (which just die)
        with StopRequest.cancels_the_start_up():
            pipe = await _start_pipeline(cfg, start_checkpoint, layout, stack)
        watch = await _watch_trainer(pipe.trainer, cfg.cluster.node_check_s)
    except BaseException as e:
        lost = rank_died_in(e)  # before the watch runs: a call to the dead rank failed
        if lost is None:
            await stack.__aexit__(type(e), e, e.__traceback__)
            raise
        await _close_after_loss(stack, lost)
        raise lost from None
    try:
        yield pipe
    except BaseException as e:
        lost = loss_of(watch) or await confirmed_loss(watch, e, LOSS_CONFIRM_S)
        watch.cancel()
        if lost is None:
            await stack.__aexit__(type(e), e, e.__traceback__)
            raise
        if isinstance(e, asyncio.CancelledError):  # the watch cancelled the run: the loss is the error
            asyncio.current_task().uncancel()
        await _close_after_loss(stack, lost)
        raise lost from None
    watch.cancel()
    await stack.aclose()


def start_tasks_eagerly(stack: contextlib.AsyncExitStack) -> None:
    """Run every task the run creates on its loop eagerly (``asyncio.eager_task_factory``: a new task
    runs at once up to its first wait), until ``stack`` closes. A group the new weights let start then
    reaches its engine's request within the turn that started it, where a task per hop (group, the
    pool's placement, the engine call, the joint request) would cost a loop turn each, and the turns
    would wait behind the step's own work (books, the next batch, the trainer call)."""
    loop = asyncio.get_running_loop()
    stack.callback(loop.set_task_factory, loop.get_task_factory())
    loop.set_task_factory(asyncio.eager_task_factory)


async def _watch_trainer(trainer: TrainerGroup, period_s: float) -> asyncio.Task:
    """Watch the trainer ranks and their nodes (:mod:`megarl.pipeline.node_watch`): the loss of one cancels
    this task."""
    watch = asyncio.create_task(watch_trainer(await trainer.node_addresses(), trainer.dead_ranks, period_s))
    cancel_on_loss(watch, asyncio.current_task())
    return watch


async def _close_after_loss(stack: contextlib.AsyncExitStack, lost: BaseException) -> None:
    """Stop what the run holds after a trainer node or rank was lost, within ``LOSS_TEARDOWN_S``: calls to
    its ranks fail or hang, so errors there are logged, not raised."""
    try:
        await asyncio.wait_for(stack.__aexit__(type(lost), lost, None), LOSS_TEARDOWN_S)
    except BaseException as e:  # the lost node's share of the teardown
        log.warning("teardown after the trainer's loss: %s: %s", type(e).__name__, e)


async def _start_pipeline(cfg: DictConfig, start_checkpoint: str, layout: Layout,
                          stack: contextlib.AsyncExitStack) -> Pipeline:
    """Start-up on a connected Ray (:mod:`megarl.pipeline.startup`): the trainer ranks start, the engines
    launch while the ranks build and resume (colocated engines once they are built), then the weight
    sync and the rollout; the producer starts last. What they hold goes into ``stack`` (closed by
    :func:`open_pipeline`)."""
    platform = await work_platform(cfg)
    api_key = secrets.token_urlsafe(32)  # this run's engines answer only megarl's clients (never logged)
    placed = await place_run(cfg, start_checkpoint, layout, stack, platform, api_key)
    trainer, plan, pools, resumed = placed.trainer, placed.plan, placed.pools, placed.resumed
    pool = pools["policy"]
    sync = await start_sync(cfg, trainer, pool, resumed.step, stack)
    tokenizer = AutoTokenizer.from_pretrained(start_checkpoint)
    rollout = start_rollout(cfg, start_checkpoint, tokenizer, pools, resumed, api_key, stack)
    colocation = Colocation(pool, abort=cfg.buffer.partial_rollout == "abort_resubmit", platform=platform,
                            release_trainer=lambda: trainer_release(trainer)) if plan.colocated else None
    membership = None if plan.colocated else _membership(cfg, plan, pool, sync, stack)
    books = StepBooks(Path(cfg.logging.run_dir), resumed.step, stack, tracker_settings(cfg))
    pipe = Pipeline(cfg=cfg, trainer=trainer, pool=pool, sync=sync, buffer=rollout.buffer, producer=rollout.producer,
                    ledger=resumed.ledger, books=books,
                    batching=micro_batching(cfg, pool.model.vocab_size, tokenizer.pad_token_id),
                    start_step=resumed.step, colocation=colocation,
                    teacher=rollout.teacher, membership=membership,
                    kl_control=resumed_kl_control(cfg, resumed.position),
                    evaluation=_evaluation(cfg, rollout, books, stack))
    _run_in_background(rollout.producer, stack)
    return pipe


def resumed_kl_control(cfg: DictConfig, position: dict | None) -> KLController:
    """The run's KL controller (``algorithm.kl_ctrl``), at the coefficient a resumed checkpoint saved."""
    control = KLController.from_config(cfg.algorithm)
    if position is not None and "kl_ctrl" in position:
        control.load_state_dict(position["kl_ctrl"])
    return control


def _evaluation(cfg: DictConfig, rollout, books: StepBooks, stack: contextlib.AsyncExitStack) -> Evaluation | None:
    """The run's held-out evaluation (``eval.*``) writing its rows into ``books``, None when it does not evaluate."""
    parts = rollout.evaluation
    if parts is None:
        return None
    producer = rollout.producer
    evaluation = Evaluation(parts.prompts, parts.sampled, parts.greedy, cfg.eval, write=books.metrics.log,
                            stream_samples=lambda: producer.generated_samples)
    stack.callback(evaluation.cancel)
    return evaluation


def _membership(cfg: DictConfig, plan: EnginePlan, pool: EnginePool, sync,
                stack: contextlib.AsyncExitStack) -> Membership:
    """The policy pool's membership, its engines under watch (``rollout.engine_*``, ``rollout.max_engines``)."""
    r = cfg.rollout
    pool.membership.lost_after_s = r.engine_lost_s
    membership = Membership(pool, sync, template=plan.settings["policy"][0],
                            launch={"num_cpus": ENGINE_CPUS, "num_gpus": plan.gpus["policy"]},
                            run_dir=Path(cfg.logging.run_dir), max_engines=r.max_engines, drain_s=r.engine_drain_s)
    membership.start(r.engine_health_check_s, stack)
    return membership


def _run_in_background(producer: RolloutProducer, stack: contextlib.AsyncExitStack) -> None:
    """Start ``producer``'s loop as a task, stopped when ``stack`` closes. Start-up's objects (imports,
    Ray, the tokenizer) leave Python's garbage collection for the run, whose full passes over them
    would stall steps; they are back in when ``stack`` closes."""
    gc.freeze()
    stack.callback(gc.unfreeze)
    task = asyncio.create_task(producer.run())
    stack.push_async_callback(producer.stop)
    stack.callback(task.cancel)
