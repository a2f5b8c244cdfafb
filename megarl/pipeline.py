"""The parts of an RL run and their wiring: the driver (``megarl/train.py``) reads as the algorithm,
this module builds what it runs on and tears it down.

:func:`open_pipeline` starts Ray, the trainer ranks (one actor each), the SGLang engines behind one
pool, the weight sync between them, the rollout buffer and its producer; resumes from the run
directory's latest checkpoint when there is one (trainer state, data position, sample ledger, and
the engines get the checkpoint's weights); and stops everything on exit.

Modes differ only in two numbers: how many weight versions generation may run ahead of training
(``lag``) and how many prompt groups the buffer holds (``capacity``):

=============  =================================  ==========================================
mode           lag                                capacity (prompt groups)
=============  =================================  ==========================================
sync           0 (a batch from the last weights)  prompts_per_step
one_step_off   1                                  prompts_per_step
async          buffer.max_staleness               buffer.max_buffer_batches * prompts_per_step
=============  =================================  ==========================================
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from megarl.buffer import Ledger, RolloutBuffer
from megarl.config import ConfigError
from megarl.metrics.sink import MetricsFile
from megarl.rollout.client import PauseMode
from megarl.rollout.producer import RolloutProducer

log = logging.getLogger(__name__)

PAUSE_FOR_PARTIAL_ROLLOUT = {"continue": PauseMode.RETRACT, "abort_resubmit": PauseMode.ABORT}


def lag_and_capacity(cfg: DictConfig) -> tuple[int, int, int]:
    """(lag in weight versions, buffer capacity in groups, max staleness) of ``cfg.mode``."""
    p, b = cfg.rollout.prompts_per_step, cfg.buffer
    if cfg.mode == "sync":
        return 0, p, 0
    if cfg.mode == "one_step_off":
        return 1, p, 1
    return b.max_staleness, b.max_buffer_batches * p, b.max_staleness


@dataclass
class Pipeline:
    """Everything one RL run holds; see the module docstring."""

    cfg: DictConfig
    trainer: object  # megarl.trainer.actor.TrainerGroup
    pool: object  # megarl.rollout.dispatcher.EnginePool
    sync: object  # megarl.sync.WeightSync
    buffer: RolloutBuffer
    producer: RolloutProducer
    ledger: Ledger
    metrics: MetricsFile
    pad_id: int
    vocab_size: int
    start_step: int  # the last completed step (0 for a new run)
    pause_mode: PauseMode
    _trained_log: object = field(default=None, repr=False)

    @property
    def stop_signal(self) -> str | None:
        """The signal that asked the run to stop (see :class:`StopRequest`), else None."""
        return StopRequest.signal_name

    @property
    def checkpoint_dir(self) -> str:
        return str(Path(self.cfg.logging.run_dir) / "checkpoints")

    def rl_batch(self, samples):
        from megarl.trainer.rl_batch import build_rl_batch

        p = self.cfg.parallel
        return build_rl_batch(samples, self.pad_id, p.tp if p.sequence_parallel else 1,
                              with_sampling_mask=self.cfg.rollout.keep_sampling_mask)

    def step_kwargs(self) -> dict:
        r, p = self.cfg.rollout, self.cfg.parallel
        return dict(vocab_size=self.vocab_size, max_tokens_per_microbatch=self.cfg.trainer.max_tokens_per_microbatch,
                    keep_routing=r.keep_routing, sequence_parallel=p.sequence_parallel, temperature=r.temperature)

    def record_trained(self, step: int, groups) -> None:
        """Append the prompt indices trained at ``step`` to ``trained_prompts.jsonl`` (the audit
        trail that shows no prompt is trained twice across resumes)."""
        self._trained_log.write(json.dumps({"step": step, "prompts": sorted(g.index for g in groups)}) + "\n")
        self._trained_log.flush()

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Sync the trainer's weights into the engines as ``version``; its metrics. A failed sync is
        reported and survived: engines held with partial weights are brought to ``version`` from
        disk, dead ones when their supervisor has restarted them (``pool.on_restart``)."""
        from megarl.sync import WeightSyncError

        try:
            return (await self.sync.update(version, self.pause_mode)).metrics()
        except WeightSyncError as exc:
            log.error("%s", exc)
            for client in self.pool.clients:
                if client.base_url in exc.held:
                    await self.sync.recover(client)
            return {"sync/failed": 1.0}

    def save_due(self, step: int) -> bool:
        interval = self.cfg.trainer.save_interval
        return step == self.cfg.steps or self.stop_signal is not None or (interval > 0 and step % interval == 0)

    async def save(self, step: int) -> None:
        """Checkpoint the trainer with the data position and the ledger (all ranks, collective)."""
        position = self.producer.state_dict() | {"ledger": self.ledger.state_dict()}
        path = await self.trainer.call_async("save_checkpoint", self.checkpoint_dir, step, position)
        log.info("step %d: checkpoint %s", step, path)


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the RL rows of ``path`` after ``last_step`` (what a resumed run redoes); warm-up rows stay."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kept = [json.dumps(row) for row in rows if row["step"] <= last_step or any(k.startswith("warmup/") for k in row)]
        path.write_text("".join(line + "\n" for line in kept))


def _engine_settings(cfg: DictConfig, start_checkpoint: str, weights_version: int):
    from megarl.rollout.engine import EngineSettings

    r = cfg.rollout
    run_dir = Path(cfg.logging.run_dir)
    # dtype: the trainer's. SGLang's "auto" serves a float32 checkpoint in float16, which alone
    # puts a ~3e-4 mean (1e-3 max) gap between the engine's and the trainer's log-probs.
    return [EngineSettings(model_path=start_checkpoint, dtype=cfg.model.dtype, sampling_mask_max_tokens=max(r.top_k, 1),
                           max_total_tokens=r.max_total_tokens, random_seed=cfg.task.seed + i,
                           weight_version=weights_version, log_path=str(run_dir / f"engine-{i}.log"))
            for i in range(r.num_engines)]


@contextlib.asynccontextmanager
async def open_pipeline(cfg: DictConfig, start_checkpoint: str) -> AsyncIterator[Pipeline]:
    """Build (or resume) the run's pipeline; everything is stopped when the block exits."""
    import ray
    from transformers import AutoTokenizer

    from megarl.rollout.client import EngineUnreachable, SamplingParams, ServedModel
    from megarl.rollout.dispatcher import EnginePool
    from megarl.rollout.manager import RolloutManager
    from megarl.rollout.prompt_data import Prompt, make_prompt_source
    from megarl.rollout.rewards import make_reward
    from megarl.sync import SyncSettings, WeightSync
    from megarl.trainer.actor import TrainerGroup
    from megarl.trainer.checkpoint import latest_step
    from megarl.trainer.distributed import Layout
    from megarl.train import optimizer_settings

    r, p, t = cfg.rollout, cfg.parallel, cfg.trainer
    run_dir = Path(cfg.logging.run_dir)
    layout = Layout.from_config(p)
    tokenizer = AutoTokenizer.from_pretrained(start_checkpoint)
    served = ServedModel.from_hf_config(start_checkpoint)
    if r.max_new_tokens >= served.context_length:
        raise ConfigError(f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for a prompt in the model's "
                          f"context of {served.context_length} tokens ({start_checkpoint})")
    checkpoints = run_dir / "checkpoints"
    resume_step = latest_step(checkpoints) if t.resume else None
    if os.environ.get("RAY_ADDRESS"):  # a cluster started for us (slurm/megarl.sbatch exports it)
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, layout.world_size + r.num_engines), include_dashboard=False, log_to_driver=False)
    StopRequest.install()  # again: ray.init replaced the handlers with its own (which just die)
    stack = contextlib.AsyncExitStack()
    try:
        stack.callback(ray.shutdown)
        trainer = TrainerGroup(layout, backend=p.backend, seed=t.seed)
        stack.callback(trainer.shutdown)
        await trainer.call_async("build", start_checkpoint, optimizer_settings(cfg, t.lr),
                                 cfg.model.transformer_impl.value, p.dispatcher.value, r.keep_routing)
        position, ledger, start_step = None, Ledger(), 0
        if resume_step is not None:
            resumed = await trainer.call_async("load_checkpoint", str(checkpoints))
            start_step, position = resumed.step, resumed.data_position
            ledger = Ledger.from_state_dict(position["ledger"])
            log.info("resuming at step %d from %s", start_step, resumed.path)
        pool = EnginePool.launch(_engine_settings(cfg, start_checkpoint, 0), num_cpus=0.5)
        stack.push_async_callback(pool.aclose)
        sync = WeightSync(SyncSettings.of(cfg.sync), trainer, pool.clients, initial_version=0)
        stack.push_async_callback(sync.close)
        await sync.setup()
        pause_mode = PAUSE_FOR_PARTIAL_ROLLOUT[cfg.buffer.partial_rollout]
        if start_step:  # the engines get the checkpoint's weights before they generate anything
            await sync.update(start_step, pause_mode)

        async def bring_to_current(index, client, info):
            await sync.recover(client)

        pool.on_restart = bring_to_current
        source = make_prompt_source(cfg.task)
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
        manager = RolloutManager(pool, tokenizer, make_reward(cfg.reward), params, r.samples_per_prompt,
                                 routing=r.keep_routing, sampling_mask=r.top_k > 0,
                                 partial_rollout=cfg.buffer.partial_rollout, reward_timeout_s=cfg.reward.timeout_s)
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
                        start_step=start_step, pause_mode=pause_mode, _trained_log=trained_log)
        producer_task = asyncio.create_task(producer.run())
        stack.push_async_callback(producer.stop)
        stack.callback(producer_task.cancel)
        async with stack:
            yield pipe
    except BaseException:
        await stack.aclose()
        raise


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's preemption and time-limit warnings) ask the run to stop: the RL
    loop checkpoints after the step in progress and exits. Installed once per process by the
    driver, before anything else starts, so a signal during start-up is not lost."""

    signal_name: str | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.signal_name = signal.Signals(signum).name
        log.warning("%s received: checkpoint after the current step, then exit", cls.signal_name)
