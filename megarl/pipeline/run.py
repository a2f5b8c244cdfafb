"""The parts of an RL run and their wiring: the driver (``megarl/train.py``) reads as the algorithm,
this module builds what it runs on, keeps each step's books, and tears it all down.

:func:`open_pipeline` starts Ray, the trainer ranks (one actor each), the SGLang engines behind one
pool, the weight sync between them, the rollout buffer and its producer; resumes from the run
directory's latest checkpoint when there is one (trainer state, data position, sample ledger, and
the engines get the checkpoint's weights); and stops everything on exit. The modes differ only in
lag and buffer depth (:mod:`megarl.pipeline.modes`).

Per step, :meth:`Pipeline.take_batch` takes the oldest groups from the buffer, :meth:`Pipeline.sync_weights`
moves the new weights into the engines, and :meth:`Pipeline.end_step` writes the trained-prompt
log, checks the ledger, logs the metrics row and saves a checkpoint when one is due. With
``placement=colocated`` the engines hand the devices to the trainer from the end of ``take_batch``
to the end of ``sync_weights`` (:mod:`megarl.pipeline.colocate`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import gc
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from rich.progress import Progress
from transformers import AutoTokenizer

from megarl.agents.parsers import tool_call_parser
from megarl.agents.rollout import AgentEpisodes
from megarl.agents.spec import load_agent
from megarl.algos.advantages import BatchStats
from megarl.config.schema import Placement
from megarl.config.validate import AuxiliaryEngine, auxiliary_engines
from megarl.engines.pool import EnginePool
from megarl.engines.protocol import Engines
from megarl.engines.server import EngineSettings
from megarl.engines.types import EngineUnreachable, PauseMode, SamplingParams, ServedModel
from megarl.metrics.gpu import GpuStats
from megarl.metrics.sink import MetricsFile
from megarl.models.hf_config import read_hf_config
from megarl.models.lora import LoraSettings
from megarl.parallel import Layout
from megarl.pipeline.buffer import Group, RolloutBuffer
from megarl.pipeline.colocate import Colocation, empty_trainer_cache
from megarl.pipeline.judge import judge_engine_settings, make_judge
from megarl.pipeline.ledger import Ledger
from megarl.pipeline.modes import PAUSE_FOR_PARTIAL_ROLLOUT, lag_and_capacity
from megarl.pipeline.producer import RolloutProducer
from megarl.pipeline.signals import StopRequest
from megarl.platform.description import detect
from megarl.rollout.env import EnvEpisodes, EpisodeLimits, make_env_factory
from megarl.rollout.group import RolloutManager
from megarl.rollout.teacher import TeacherScorer
from megarl.sample import RolloutSample
from megarl.sync import AdapterSync, SyncSettings, WeightSync, WeightSyncError
from megarl.tasks.prompts import Prompt, make_prompt_source
from megarl.tasks.rewards import make_reward
from megarl.trainer.actor import TrainerGroup
from megarl.trainer.checkpoint import latest_step
from megarl.trainer.launch import ray_for_run
from megarl.trainer.model_setup import ModelSettings
from megarl.trainer.optimizer import OptimizerSettings
from megarl.trainer.rl_batch import RLBatch, build_rl_batch
from megarl.trainer.rl_step import RLStepResult

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """The prompt groups of one step, taken from the buffer, and how they came."""

    groups: list[Group]
    staleness: list[int]  # per sample, in weight versions
    wait_s: float  # how long the trainer waited for them

    @property
    def samples(self) -> list[RolloutSample]:
        return [s for g in self.groups for s in g.samples]


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in order as ``parts`` consecutive runs whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


SUMMED_METRICS = ("mismatch/tokens_outside_mask",)  # the rl_step metrics that are counts


def combine_updates(results: list[RLStepResult]) -> RLStepResult:
    """One RL step's result from its updates': grad norms and metrics averaged, except counts
    (:data:`SUMMED_METRICS`: summed) and maxima (``*_max``: the largest); applied when every update
    was. A metric an update left out (over an empty token set) comes from the others."""
    if len(results) == 1:
        return results[0]
    metrics = {}
    for key in dict.fromkeys(k for r in results for k in r.metrics):
        values = [r.metrics[key] for r in results if key in r.metrics]
        if key.endswith("_max"):
            metrics[key] = max(values)
        elif key in SUMMED_METRICS:
            metrics[key] = sum(values)
        else:
            metrics[key] = sum(values) / len(values)
    return RLStepResult(grad_norm=sum(r.grad_norm for r in results) / len(results),
                        applied=all(r.applied for r in results), metrics=metrics)


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
    metrics: MetricsFile
    pad_id: int
    vocab_size: int
    start_step: int  # the last completed step (0 for a new run)
    pause_mode: PauseMode
    colocation: Colocation | None = None  # placement=colocated: engines and trainer take turns
    teacher: TeacherScorer | None = None  # on-policy distillation (teacher.hf_path): scores every sample
    _trained_log: object = field(default=None, repr=False)
    _gpu: GpuStats = field(default_factory=GpuStats, repr=False)
    _progress: Progress | None = field(default=None, repr=False)
    _clock: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def stop_signal(self) -> str | None:
        """The signal that asked the run to stop (see :class:`StopRequest`), else None."""
        return StopRequest.signal_name

    @property
    def checkpoint_dir(self) -> str:
        return str(Path(self.cfg.logging.run_dir) / "checkpoints")

    def steps(self) -> Iterator[int]:
        """The steps still to run, with a progress bar; ends early when a stop signal arrived
        (the step before it checkpointed). While they run, Ctrl-C is such a signal (a second one
        cancels the run at once)."""
        if self.stop_signal is not None:
            log.warning("stopped by %s before the first step", self.stop_signal)
            return
        with StopRequest.ctrl_c_stops_after_the_step(), Progress() as self._progress:
            self._bar = self._progress.add_task(f"RL ({self.cfg.mode})", total=self.cfg.steps,
                                                completed=self.start_step)
            self._clock["started"], self._clock["produced"] = time.monotonic(), self.producer.generated_tokens
            for step in range(self.start_step + 1, self.cfg.steps + 1):
                yield step
                if self.stop_signal is not None:
                    log.warning("stopped by %s after step %d (checkpoint saved); rerun the same command to resume",
                                self.stop_signal, step)
                    return

    async def take_batch(self, step: int) -> Batch:
        """``rollout.prompts_per_step`` groups for ``step`` (the trainer holds version ``step - 1``);
        stale groups are dropped and counted by the buffer."""
        t0 = time.monotonic()
        taken = await self.producer.guard(self.buffer.take(self.cfg.rollout.prompts_per_step,
                                                           trainer_version=step - 1))
        self.producer.taken(taken.groups + taken.dropped_stale)
        if self.colocation is not None:  # the devices go to the trainer: nothing generates until the sync
            await self.colocation.before_training()
        self._clock["train_start"] = time.monotonic()
        return Batch(groups=taken.groups, staleness=taken.staleness, wait_s=self._clock["train_start"] - t0)

    async def train(self, batch: Batch, step: int) -> RLStepResult:
        """``trainer.updates_per_step`` optimizer steps on ``batch`` (advantages filled): its prompt
        groups split, in order, into as many mini-batches of near-equal size, one ``rl_step`` each
        (:func:`combine_updates` joins their results). Every update's PPO ratio is against the
        rollout's log-probs, so from the second update on it (and ``mismatch/*``) also carries the
        earlier updates' change of the policy."""
        parts = split_evenly(batch.groups, self.cfg.trainer.updates_per_step)
        results = []
        for groups in parts:
            samples = [s for g in groups for s in g.samples]
            results.append(await self.trainer.rl_step(self.rl_batch(samples, step), self.cfg.algorithm,
                                                      **self.step_kwargs()))
        return combine_updates(results)

    def rl_batch(self, samples: list[RolloutSample], step: int) -> RLBatch:
        """The trainer's tensors for ``samples`` (advantages filled) at ``step``, where the trainer
        holds version ``step - 1`` (per-token staleness against it)."""
        return build_rl_batch(samples, with_sampling_mask=self.cfg.rollout.keep_sampling_mask, trainer_version=step - 1)

    async def kl_penalties(self, samples: list[RolloutSample], step: int) -> list[float] | None:
        """``kl_coef * sum_t KL_t`` to the reference per sample at ``step`` when ``algorithm.kl_in_reward``
        (taken from the rewards before the advantages, as verl's ``use_kl_in_reward``), else None."""
        algo = self.cfg.algorithm
        if not (algo.kl_in_reward and algo.kl_coef != 0.0):
            return None
        batch = build_rl_batch(samples, with_sampling_mask=self.cfg.rollout.keep_sampling_mask, with_advantages=False,
                               trainer_version=step - 1)
        return [algo.kl_coef * kl for kl in await self.trainer.sequence_kl(batch, algo, **self.step_kwargs())]

    def step_kwargs(self) -> dict:
        """The rl_step arguments that come from the config and the served model."""
        r, p = self.cfg.rollout, self.cfg.parallel
        return dict(vocab_size=self.vocab_size, max_tokens_per_microbatch=self.cfg.trainer.max_tokens_per_microbatch,
                    keep_routing=r.keep_routing, sequence_parallel=p.sequence_parallel, temperature=r.temperature,
                    pack=self.cfg.trainer.pack_sequences, pad_id=self.pad_id)

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Sync the trainer's weights into the engines as ``version`` and let generation use them;
        the sync's metrics. A failed sync is reported and survived: engines held with partial
        weights are brought to ``version`` from disk, dead ones when their supervisor has
        restarted them (``pool.on_restart``)."""
        self._clock["sync_start"] = time.monotonic()
        if self.colocation is not None:  # the engines get their memory back around the sync
            synced = await self.colocation.after_training(lambda: self._sync(version))
            synced.update(self.colocation.metrics())
        else:
            synced = await self._sync(version)
        await self.producer.set_engine_version(version)
        return synced

    async def _sync(self, version: int) -> dict[str, float]:
        try:
            return (await self.sync.update(version, self.pause_mode)).metrics()
        except WeightSyncError as exc:
            log.error("%s", exc)
            for client in self.pool.clients:
                if client.base_url in exc.held:
                    await self.sync.recover(client)
            return {"sync/failed": 1.0}

    async def end_step(self, step: int, batch: Batch, stats: BatchStats, result, synced: dict[str, float]) -> None:
        """The step's books: trained-prompt log, ledger check, metrics row, progress, checkpoint.
        ``result`` is the trainer's ``RLStepResult``, ``synced`` what :meth:`sync_weights` returned."""
        now, c = time.monotonic(), self._clock
        self._record_trained(step, batch.groups)
        self.ledger.check()
        row = {"reward/mean": stats.reward_mean, "response/len_mean": stats.response_len_mean,
               "groups/mixed_frac": stats.mixed_group_frac, "train/grad_norm": result.grad_norm,
               **{k if "/" in k else f"train/{k}": v for k, v in result.metrics.items()},
               "staleness/mean": sum(batch.staleness) / len(batch.staleness), "staleness/max": max(batch.staleness),
               **self.ledger.metrics(),
               "perf/tokens_per_s": (self.producer.generated_tokens - c["produced"]) / (now - c["started"]),
               "perf/trainer_idle_frac": batch.wait_s / (now - c["train_start"] + batch.wait_s),
               "time/wait_s": batch.wait_s, "time/train_s": c["sync_start"] - c["train_start"],
               "sync/seconds": now - c["sync_start"], **synced, **episode_metrics(batch.samples), **stats.metrics,
               **self._gpu.sample()}
        self.metrics.log(step, row)
        self._progress.update(self._bar, advance=1, description=f"RL ({self.cfg.mode}) reward {stats.reward_mean:.2f}")
        log.info("step %d: reward %.3f, mismatch %s (fresh tokens), drift %s (stale), staleness %.2f, wait %.1fs "
                 "train %.1fs sync %.1fs", step, stats.reward_mean, _figure(row.get("mismatch/logprob_abs_diff")),
                 _figure(row.get("staleness/logprob_drift")), row["staleness/mean"], row["time/wait_s"],
                 row["time/train_s"], row["sync/seconds"])
        if self._save_due(step):
            await self.save(step)

    def _record_trained(self, step: int, groups: list[Group]) -> None:
        """Append the prompt indices trained at ``step`` to ``trained_prompts.jsonl`` (the audit
        trail that shows no prompt is trained twice across resumes)."""
        self._trained_log.write(json.dumps({"step": step, "prompts": sorted(g.index for g in groups)}) + "\n")
        self._trained_log.flush()

    def _save_due(self, step: int) -> bool:
        interval = self.cfg.trainer.save_interval
        return step == self.cfg.steps or self.stop_signal is not None or (interval > 0 and step % interval == 0)

    async def save(self, step: int) -> None:
        """Checkpoint the trainer with the data position and the ledger (all ranks, collective)."""
        position = self.producer.state_dict() | {"ledger": self.ledger.state_dict()}
        path = await self.trainer.save_checkpoint(self.checkpoint_dir, step, position)
        log.info("step %d: checkpoint %s", step, path)


def episode_metrics(samples: list[RolloutSample]) -> dict[str, float]:
    """Multi-turn episodes: policy turns per episode and the share of each way they ended."""
    episodes = [s for s in samples if s.turn_ends]
    if not episodes:
        return {}
    ends = collections.Counter(s.episode_end.split(":")[0] for s in episodes)
    return {"episode/turns_mean": sum(len(s.turn_ends) for s in episodes) / len(episodes),
            **{f"episode/end_{end}_frac": n / len(episodes) for end, n in sorted(ends.items())}}


def episode_runner(cfg: DictConfig, target: EnginePool, tokenizer, params: SamplingParams,
                   frozen: Mapping[str, Engines] | None = None, model_type: str | None = None):
    """What turns a prompt into multi-turn episodes: an environment (``task.env``), an agent program
    behind the OpenAI gateway (``task.agent``; its roles on the engines ``task.role_engines`` names,
    ``frozen``: role -> the engine of the frozen model serving it; its tool calls read by
    ``rollout.tool_call_parser``, or the parser of ``model_type``, the policy's family), or None for
    single-turn prompts."""
    task = cfg.task
    if task.agent is not None:
        frozen = dict(frozen or {})
        # a role task.role_engines does not place is served by all the policy's engines (None)
        placed = {entry.role: frozen[entry.role] if entry.hf_path else target.subset(entry.engines)
                  for entry in task.role_engines}
        roles = {role: placed.get(role) for role in task.roles} if task.roles else None
        return AgentEpisodes(target, tokenizer, load_agent(task.agent), params, max_turns=task.max_turns,
                             max_response_tokens=task.max_response_tokens, timeout_s=task.agent_timeout_s,
                             routing=cfg.rollout.keep_routing, sampling_mask=cfg.rollout.top_k > 0, roles=roles,
                             partial_rollout=cfg.buffer.partial_rollout, frozen_roles=frozen,
                             tool_call_parser=tool_call_parser(cfg.rollout.tool_call_parser, model_type))
    if task.env is None:
        return None
    budget = task.max_response_tokens or target.model.context_length  # and each episode's context
    return EnvEpisodes(target, tokenizer, make_env_factory(task.env), params,
                       EpisodeLimits(max_turns=task.max_turns, max_response_tokens=budget),
                       routing=cfg.rollout.keep_routing, sampling_mask=cfg.rollout.top_k > 0,
                       abort_resubmit=cfg.buffer.partial_rollout == "abort_resubmit")


def frozen_engine_settings(cfg: DictConfig, engine: AuxiliaryEngine, index: int, api_key: str) -> EngineSettings:
    """The engine of a frozen model (on-policy distillation's teacher, a frozen agent role): ``engine``'s
    checkpoint on its tp / ep ranks, otherwise served like the policy engines but without the policy's
    adapters (its weights are never synced), its seed that of engine ``index`` and its log
    ``<name>.log`` in the run directory."""
    served = EngineSettings.from_config(cfg, engine.hf_path, index, 0, tp=engine.devices, ep=engine.ep,
                                        dp_attention=engine.dp_attention)
    return dataclasses.replace(served, api_key=api_key, log_path=str(Path(cfg.logging.run_dir) / f"{engine.name}.log"),
                               lora_max_rank=0, lora_target_modules=())


def policy_engine_settings(cfg: DictConfig, start_checkpoint: str, api_key: str, platform) -> list[EngineSettings]:
    """The policy engines' settings on ``platform`` (a :class:`megarl.platform.description.Platform`),
    colocated ones each on its own GPUs of its node with the memory saver
    (:meth:`EngineSettings.colocated`)."""
    engines = [dataclasses.replace(EngineSettings.from_config(cfg, start_checkpoint, i, 0, platform=platform),
                                   api_key=api_key) for i in range(cfg.rollout.num_engines)]
    if Placement(cfg.placement) == Placement.colocated:
        engines = [e.colocated(i, cfg.cluster.gpus_per_node, platform) for i, e in enumerate(engines)]
    return engines


async def trainer_release(trainer: TrainerGroup) -> list[dict[str, float]]:
    """Every trainer rank's :func:`megarl.pipeline.colocate.empty_trainer_cache`, in rank order (logged)."""
    reports = list(await asyncio.gather(*trainer.run(empty_trainer_cache)))
    log.info("colocated: trainer ranks keep %s GiB reserved (%s allocated) while the engines resume",
             [round(r["reserved"], 2) for r in reports], [round(r["allocated"], 2) for r in reports])
    return reports


def _launch(stack: contextlib.AsyncExitStack, settings: list[EngineSettings], num_gpus: float) -> asyncio.Task:
    """``EnginePool.launch(settings)`` as a task; when ``stack`` closes, the launch is cancelled if still
    under way (which stops what it started) and the pool is closed otherwise."""
    launch = asyncio.ensure_future(EnginePool.launch(settings, num_cpus=0.5, num_gpus=num_gpus))

    async def stop() -> None:
        launch.cancel()
        try:
            pool = await launch
        except (asyncio.CancelledError, Exception):  # stopped by the launch; an error of it was raised where awaited
            return
        await pool.aclose()

    stack.push_async_callback(stop)
    return launch


def _figure(value: float | None) -> str:
    """A log-prob difference for the step's log line; ``-`` when the step had no such tokens."""
    return "-" if value is None else f"{value:.2e}"


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the RL rows of ``path`` after ``last_step`` (what a resumed run redoes); warm-up rows stay."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kept = [json.dumps(row) for row in rows
                if row["step"] <= last_step or any(k.startswith("warmup/") for k in row)]
        path.write_text("".join(line + "\n" for line in kept))


@contextlib.asynccontextmanager
async def open_pipeline(cfg: DictConfig, start_checkpoint: str) -> AsyncIterator[Pipeline]:
    """Build (or resume) the run's pipeline; everything is stopped when the block exits. Engines
    start with the trainer ranks and load while the ranks build (colocated ones once they are built).
    A stop request during start-up cancels it (:meth:`StopRequest.cancels_the_start_up`)."""
    layout = Layout.from_config(cfg.parallel)
    stack = contextlib.AsyncExitStack()
    try:
        stack.enter_context(ray_for_run(layout.world_size + cfg.rollout.num_engines + len(auxiliary_engines(cfg))))
        StopRequest.install()  # again: ray.init replaced the handlers with its own (which just die)
        with StopRequest.cancels_the_start_up():
            pipe = await _start_pipeline(cfg, start_checkpoint, layout, stack)
        async with stack:
            yield pipe
    except BaseException as e:
        await stack.__aexit__(type(e), e, e.__traceback__)  # a no-op when `async with` closed it
        raise


async def _start_pipeline(cfg: DictConfig, start_checkpoint: str, layout: Layout,
                          stack: contextlib.AsyncExitStack) -> Pipeline:
    """Start-up on a connected Ray: trainer ranks, engines, weight sync, producer; what they hold
    goes into ``stack`` (closed by :func:`open_pipeline`)."""
    r, p, t = cfg.rollout, cfg.parallel, cfg.trainer
    run_dir = Path(cfg.logging.run_dir)
    tokenizer = AutoTokenizer.from_pretrained(start_checkpoint)
    served = ServedModel.from_hf_config(start_checkpoint)
    checkpoints = run_dir / "checkpoints"
    resume_step = latest_step(checkpoints) if t.resume else None
    started = time.monotonic()
    trainer = TrainerGroup(layout, backend=p.backend, seed=t.seed)
    stack.push(lambda failure, *_: trainer.shutdown(keep=failure is None))  # ranks may be stuck after one
    api_key = secrets.token_urlsafe(32)  # this run's engines answer only megarl's clients (never logged)
    platform = detect()
    colocated = Placement(cfg.placement) == Placement.colocated
    engines = policy_engine_settings(cfg, start_checkpoint, api_key, platform)
    # Disaggregated GPU engines reserve their devices through Ray (CUDA_VISIBLE_DEVICES reaches the
    # server); colocated ones share the trainer's (each on its own, --base-gpu-id), CPU engines reserve half a CPU
    own_gpus = r.engine_tp if platform.is_cuda and not colocated else 0
    # The teacher, the judge and frozen agent roles: an engine of its own each (weights never synced), on
    # devices of its own in either placement; a pool each, as the policy's engines are one
    auxiliary = auxiliary_engines(cfg)
    pooled = {"policy": engines}
    gpus = {"policy": own_gpus}
    for i, a in enumerate(auxiliary):
        pooled[a.name] = [judge_engine_settings(cfg, api_key) if a.name == "judge" else
                          frozen_engine_settings(cfg, a, r.num_engines + i, api_key)]
        gpus[a.name] = a.devices if platform.is_cuda else 0
    # Disaggregated engines load while the trainer ranks build and load their checkpoint (on a cluster
    # both take minutes); colocated ones start after, as they size their memory by what the trainer left.
    def launch_engines() -> dict[str, asyncio.Task]:
        return {name: _launch(stack, settings, gpus[name]) for name, settings in pooled.items()}

    launches = {} if colocated else launch_engines()
    launched_s = time.monotonic() - started
    await trainer.build(start_checkpoint, OptimizerSettings.from_config(cfg, updates_per_step=t.updates_per_step),
                        ModelSettings.from_config(cfg))
    position, ledger, start_step = None, Ledger(), 0
    if resume_step is not None:
        resumed = await trainer.load_checkpoint(str(checkpoints))
        start_step, position = resumed.step, resumed.data_position
        ledger = Ledger.from_state_dict(position["ledger"])
        log.info("resuming at step %d from %s", start_step, resumed.path)
    trainer_s = time.monotonic() - started
    if colocated:
        launches, launched_s = launch_engines(), trainer_s
    pools = dict(zip(launches, await asyncio.gather(*launches.values())))
    pool = pools["policy"]
    log.info("start-up: engines (%s) launched at %.1f s, trainer ranks built at %.1f s, engines healthy at %.1f s",
             ", ".join(pools), launched_s, trainer_s, time.monotonic() - started)
    log.info("placement: trainer ranks on nodes %s, engines on nodes %s at %s", await trainer.node_addresses(),
             [a.node for a in await asyncio.gather(*(e.info.remote() for e in pool.actors))],
             [c.base_url for c in pool.clients])
    teacher = None
    if "teacher" in pools:
        teacher = TeacherScorer(pools["teacher"].clients[0].base_url, pools["teacher"].model.vocab_size,
                                api_key=api_key, timeout_s=cfg.teacher.timeout_s)
        stack.push_async_callback(teacher.aclose)
        log.info("teacher %s served at %s", cfg.teacher.hf_path, teacher.base_url)
    judge = make_judge(cfg.reward.judge, pools["judge"], tokenizer) if "judge" in pools else None
    lora = LoraSettings.from_config(cfg.lora)
    sync_kind = AdapterSync if lora is not None and lora.sync == "adapter" else WeightSync
    sync = sync_kind(SyncSettings.from_config(cfg.sync, r.engine_tp), trainer, pool.clients, initial_version=0)
    stack.push_async_callback(sync.close)
    await sync.setup()
    pause_mode = PAUSE_FOR_PARTIAL_ROLLOUT[cfg.buffer.partial_rollout]
    if start_step:  # the engines get the checkpoint's weights before they generate anything
        await sync.update(start_step, pause_mode)

    async def bring_to_current(index, client, info):
        await sync.recover(client)

    pool.on_restart = bring_to_current
    source = make_prompt_source(cfg.task, tokenizer)
    requeue = ()
    if position is not None:
        source.load_state_dict(position["source"])
        requeue = [(i, Prompt(**fields)) for i, fields in position["requeue"]]
    lag, capacity, max_staleness = lag_and_capacity(cfg)
    buffer = RolloutBuffer(capacity, max_staleness, ledger)
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            top_k=r.top_k)
    # The engine's log-probs are always those of the distribution it sampled from (renormalised
    # over its top-k mask); keep_sampling_mask decides whether the trainer applies that mask too.
    frozen = {a.role: pools[a.name] for a in auxiliary if a.role is not None}
    episodes = episode_runner(cfg, pool, tokenizer, params, frozen, read_hf_config(start_checkpoint).model_type)
    if isinstance(episodes, AgentEpisodes):
        stack.push_async_callback(episodes.aclose)
    manager = RolloutManager(pool, tokenizer, make_reward(cfg.reward, judge=judge), params, r.samples_per_prompt,
                             routing=r.keep_routing, sampling_mask=r.top_k > 0,
                             partial_rollout=cfg.buffer.partial_rollout, reward_timeout_s=cfg.reward.timeout_s,
                             episodes=episodes, teacher=teacher, add_special_tokens=not cfg.task.chat_template)
    producer = RolloutProducer(manager, source, buffer, ledger, prompts_per_step=r.prompts_per_step,
                               samples_per_prompt=r.samples_per_prompt, lag=lag,
                               dynamic_sampling=r.dynamic_sampling, engine_version=start_step,
                               requeue=requeue, next_index=position["next_index"] if position else 0,
                               fatal=(EngineUnreachable,))
    for name in ("metrics.jsonl", "trained_prompts.jsonl"):
        _truncate_jsonl(run_dir / name, start_step)
    metrics = MetricsFile(run_dir)
    stack.callback(metrics.close)
    trained_log = stack.enter_context((run_dir / "trained_prompts.jsonl").open("a"))
    pipe = Pipeline(cfg=cfg, trainer=trainer, pool=pool, sync=sync, buffer=buffer, producer=producer,
                    ledger=ledger, metrics=metrics, pad_id=tokenizer.pad_token_id, vocab_size=served.vocab_size,
                    start_step=start_step, pause_mode=pause_mode, _trained_log=trained_log, teacher=teacher,
                    colocation=Colocation(pool, abort=cfg.buffer.partial_rollout == "abort_resubmit",
                                          platform=platform, release_trainer=lambda: trainer_release(trainer))
                    if colocated else None)
    stack.callback(pipe._gpu.close)
    # Start-up's objects (imports, Ray, the tokenizer) out of the garbage collector for the run: its
    # full passes over them stalled a third of the demo's steps by ~0.3 s. Back in at the end.
    gc.freeze()
    stack.callback(gc.unfreeze)
    producer_task = asyncio.create_task(producer.run())
    stack.push_async_callback(producer.stop)
    stack.callback(producer_task.cancel)
    return pipe
