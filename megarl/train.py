"""``python -m megarl.train recipe=NAME key=value ...``: the megarl driver.

``--cfg job`` prints the resolved config and exits. A bad recipe or override exits with status 2
and one line naming the key. ``mode=warmup`` runs the supervised warm-up that makes the RL
starting checkpoint; the RL modes (``sync``, ``one_step_off``, ``async``) run it when its checkpoint
is missing, then RL. A run directory with a checkpoint resumes from it (``trainer.resume``);
SIGTERM or SIGUSR1 makes the run checkpoint after the current step and exit.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megarl.config import ConfigError, load_config
from megarl.log import setup_logging

log = logging.getLogger("megarl.train")


def warmup(cfg: DictConfig) -> list[float]:
    """Supervised warm-up on every trainer rank; saves the HF checkpoint; returns the losses."""
    from megarl.trainer.distributed import Layout
    from megarl.trainer.launch import run_ranks
    from megarl.trainer.warmup import WarmupJob, run_warmup

    t, w = cfg.trainer, cfg.warmup
    job = WarmupJob(
        hf_path=cfg.model.hf_path, save_hf_path=w.save_hf_path, run_dir=cfg.logging.run_dir, steps=w.steps,
        batch_size=w.batch_size, max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        optimizer=optimizer_settings(cfg, w.lr),
        max_operand=cfg.task.max_operand, seed=cfg.task.seed, log_interval=w.log_interval,
        transformer_impl=cfg.model.transformer_impl.value, dispatcher=cfg.parallel.dispatcher.value,
    )
    losses = run_ranks(run_warmup, Layout.from_config(cfg.parallel), job, backend=cfg.parallel.backend,
                       seed=t.seed)[-1]
    log.info("warm-up loss %.3f -> %.3f over %d steps; HF checkpoint: %s", losses[0], losses[-1], len(losses),
             w.save_hf_path)
    return losses


async def rl(cfg: DictConfig, start_checkpoint: str) -> None:
    """GRPO-style RL: the producer fills the buffer from the engines while this loop takes a batch,
    trains one step on it and syncs the weights into the engines (see megarl/pipeline.py for how
    the modes sync / one_step_off / async differ: only in lag and buffer depth)."""
    from rich.progress import Progress

    from megarl.metrics.gpu import GpuStats
    from megarl.pipeline import open_pipeline
    from megarl.rollout.manager import fill_advantages

    r = cfg.rollout
    gpu = GpuStats()
    async with open_pipeline(cfg, start_checkpoint) as pipe:
        produced, started = pipe.producer.generated_tokens, time.monotonic()
        with Progress() as progress:
            bar = progress.add_task(f"RL ({cfg.mode})", total=cfg.steps, completed=pipe.start_step)
            for step in range(pipe.start_step + 1, cfg.steps + 1):
                if pipe.stop_signal is not None and step == pipe.start_step + 1:
                    log.warning("stopped by %s before the first step", pipe.stop_signal)
                    break
                t0 = time.monotonic()
                taken = await pipe.producer.guard(pipe.buffer.take(r.prompts_per_step, trainer_version=step - 1))
                pipe.producer.taken(taken.groups + taken.dropped_stale)
                stats = fill_advantages(taken.samples, cfg.algorithm.advantage)
                t1 = time.monotonic()
                result = await pipe.trainer.call_async("rl_step", pipe.rl_batch(taken.samples), cfg.algorithm,
                                                       **pipe.step_kwargs())
                t2 = time.monotonic()
                synced = await pipe.sync_weights(step)
                await pipe.producer.set_engine_version(step)
                t3 = time.monotonic()
                pipe.record_trained(step, taken.groups)
                pipe.ledger.check()
                row = {"reward/mean": stats.reward_mean, "response/len_mean": stats.response_len_mean,
                       "groups/mixed_frac": stats.mixed_group_frac, "train/grad_norm": result.grad_norm,
                       **{k if "/" in k else f"train/{k}": v for k, v in result.metrics.items()},
                       "staleness/mean": sum(taken.staleness) / len(taken.staleness),
                       "staleness/max": max(taken.staleness), **pipe.ledger.metrics(),
                       "perf/tokens_per_s": (pipe.producer.generated_tokens - produced) / (t3 - started),
                       "perf/trainer_idle_frac": (t1 - t0) / (t3 - t0),
                       "time/wait_s": t1 - t0, "time/train_s": t2 - t1, "sync/seconds": t3 - t2,
                       **synced, **gpu.sample()}
                pipe.metrics.log(step, row)
                progress.update(bar, advance=1, description=f"RL ({cfg.mode}) reward {stats.reward_mean:.2f}")
                log.info("step %d: reward %.3f, mismatch %.2e, staleness %.2f, wait %.1fs train %.1fs sync %.1fs",
                         step, stats.reward_mean, row.get("mismatch/logprob_abs_diff", float("nan")),
                         row["staleness/mean"], t1 - t0, t2 - t1, t3 - t2)
                if pipe.save_due(step):
                    await pipe.save(step)
                if pipe.stop_signal is not None:
                    log.warning("stopped by %s after step %d (checkpoint saved); rerun the same command to resume",
                                pipe.stop_signal, step)
                    break
    gpu.close()


def resuming(cfg: DictConfig) -> bool:
    """Whether this run continues from a checkpoint in its run directory."""
    from megarl.trainer.checkpoint import latest_step

    return cfg.mode != "warmup" and cfg.trainer.resume and latest_step(Path(cfg.logging.run_dir) / "checkpoints") is not None


def optimizer_settings(cfg: DictConfig, lr: float):
    from megarl.trainer.optimizer import OptimizerSettings

    t = cfg.trainer
    return OptimizerSettings(
        lr=lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_steps, lr_decay_steps=max(cfg.steps, 1),
        lr_decay_style=t.lr_decay_style, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps, clip_grad=t.clip_grad, use_distributed_optimizer=t.use_distributed_optimizer,
        dtype=cfg.model.dtype)


def run(cfg: DictConfig) -> None:
    from megarl.config.validate import refuse_what_is_not_built

    refuse_what_is_not_built(cfg)
    if cfg.mode != "warmup":
        from megarl.pipeline import StopRequest

        StopRequest.install()
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    if not resuming(cfg):  # a new run: no rows of an earlier one in this directory
        for name in ("metrics.jsonl", "trained_prompts.jsonl"):
            (run_dir / name).unlink(missing_ok=True)
    hf_path = Path(cfg.model.hf_path)
    if not (hf_path / "config.json").is_file():
        if not cfg.model.make_tiny_if_missing:
            raise ConfigError(f"model.hf_path: {hf_path} is not an HF checkpoint directory (no config.json)")
        from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

        log.info("building the tiny demo checkpoint at %s", hf_path)
        make_tiny_moe(hf_path, TinyMoeSpec.from_arch(cfg.model.arch), max_operand=cfg.task.max_operand)
    if cfg.mode == "warmup":
        warmup(cfg)
    else:
        start = str(hf_path)
        if cfg.warmup.steps > 0:  # RL starts from the warmed-up checkpoint, made first if absent
            if not (Path(cfg.warmup.save_hf_path) / "config.json").is_file():
                warmup(cfg)
            start = cfg.warmup.save_hf_path
        asyncio.run(rl(cfg, start))
    from megarl.metrics.plot import plot_run

    log.info("curves: %s", plot_run(run_dir)[0])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print_job = False
    if "--cfg" in args:
        at = args.index("--cfg")
        if args[at + 1: at + 2] != ["job"]:
            print("megarl: only '--cfg job' is supported", file=sys.stderr)
            return 2
        del args[at: at + 2]
        print_job = True
    setup_logging()
    try:
        cfg = load_config(args)
        if print_job:
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        run(cfg)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
