"""``python -m megarl.train recipe=NAME key=value ...``: the megarl driver.

``--cfg job`` prints the resolved config and exits. A bad recipe or override exits with status 2
and one line naming the key, and so do delta syncs whose host copies do not fit a node's memory
(:mod:`megarl.planner.delta_memory`). ``mode=warmup`` runs the tiny recipes' supervised warm-up that makes
their RL starting checkpoint; the RL modes (``sync``, ``one_step_off``, ``async``) run it first when
``warmup.steps`` > 0 and its checkpoint is missing, else start from ``model.hf_path``. A run
directory with a checkpoint resumes from it (``trainer.resume``). A trainer node that leaves the
Ray cluster ends the run with one line naming it and status 75 (:mod:`megarl.pipeline.node_watch`).
SIGTERM or SIGUSR1 makes the run checkpoint after the current step and exit (during start-up: exit
at once, status 0), and so does Ctrl-C during the RL steps; a second Ctrl-C, or one before the steps
begin, stops at once (exit status 130, one line saying where the same command would start again).
"""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megarl.config import ConfigError, load_config
from megarl.config.components import warmup_job
from megarl.log import setup_logging
from megarl.pipeline.node_watch import NODE_LOST_EXIT, TrainerNodeLost

log = logging.getLogger("megarl.train")


def warmup(cfg: DictConfig) -> list[float]:
    """Supervised warm-up on every trainer rank; saves the HF checkpoint; returns the losses."""
    from megarl.parallel import Layout
    from megarl.trainer.launch import run_ranks
    from megarl.trainer.warmup import run_warmup

    job = warmup_job(cfg)
    losses = run_ranks(run_warmup, Layout.from_config(cfg.parallel), job, backend=cfg.parallel.backend,
                       seed=cfg.trainer.seed)[-1]
    log.info("warm-up loss %.3f -> %.3f over %d steps; HF checkpoint: %s", losses[0], losses[-1], len(losses),
             job.save_hf_path)
    return losses


async def rl(cfg: DictConfig, start_checkpoint: str) -> None:
    """GRPO-style RL: the producer fills the buffer from the engines while this loop takes a batch,
    trains one step on it and syncs the weights into the engines (the modes sync / one_step_off /
    async differ only in lag and buffer depth: megarl/pipeline/modes.py)."""
    from megarl.algos.advantages import assign_advantages
    from megarl.pipeline.run import open_pipeline

    async with open_pipeline(cfg, start_checkpoint) as pipe:
        for step in pipe.steps():
            batch = await pipe.take_batch(step)
            penalties = await pipe.kl_penalties(batch.samples, step)  # KL to the reference, when in the reward
            # outcome, per-turn and (with a teacher: on-policy distillation) the teacher's token advantages
            stats = assign_advantages(batch.samples, cfg.algorithm, penalties, distill=pipe.teacher is not None)
            result = await pipe.train(batch, step, penalties)  # trainer.updates_per_step optimizer steps
            synced = await pipe.sync_weights(step)
            await pipe.end_step(step, batch, stats, result, synced)


def resuming(cfg: DictConfig) -> bool:
    """Whether this run continues from a checkpoint in its run directory."""
    from megarl.trainer.checkpoint import latest_step

    return (cfg.mode != "warmup" and cfg.trainer.resume
            and latest_step(Path(cfg.logging.run_dir) / "checkpoints") is not None)


def prepare_run_dir(cfg: DictConfig) -> Path:
    """The run directory, made if absent, with the run's resolved ``config.yaml``; a new run (not a resume)
    starts with no metrics or trained-prompt rows of an earlier one in it."""
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    if not resuming(cfg):
        for name in ("metrics.jsonl", "trained_prompts.jsonl"):
            (run_dir / name).unlink(missing_ok=True)
    return run_dir


def ensure_model(cfg: DictConfig) -> Path:
    """``model.hf_path``, the tiny demo checkpoint built there when it is missing and
    ``model.make_tiny_if_missing``; ConfigError when it is missing otherwise."""
    hf_path = Path(cfg.model.hf_path)
    if not (hf_path / "config.json").is_file():
        if not cfg.model.make_tiny_if_missing:
            raise ConfigError(f"model.hf_path: {hf_path} is not an HF checkpoint directory (no config.json)")
        from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

        log.info("building the tiny demo checkpoint at %s", hf_path)
        spec = TinyMoeSpec.from_arch(cfg.model.arch, tool_calling=cfg.model.tiny_variant.value == "tool_calling")
        make_tiny_moe(hf_path, spec, max_operand=cfg.task.max_operand)
    return hf_path


def run(cfg: DictConfig) -> None:
    """The run ``cfg`` describes, from its run directory and model to its curves' PNG (module docstring)."""
    from megarl.config.platform_rules import refuse_what_is_not_built
    from megarl.pipeline.signals import StopRequest
    from megarl.planner.delta_memory import check_delta_memory, node_host_bytes

    refuse_what_is_not_built(cfg)
    if cfg.mode != "warmup":
        check_delta_memory(cfg, node_host_bytes(cfg))
        StopRequest.install()
    run_dir, hf_path = prepare_run_dir(cfg), ensure_model(cfg)
    if cfg.mode == "warmup":
        warmup(cfg)
    else:
        start = str(hf_path)
        if cfg.warmup.steps > 0:  # RL starts from the warmed-up checkpoint, made first if absent
            if not (Path(cfg.warmup.save_hf_path) / "config.json").is_file():
                warmup(cfg)
            start = cfg.warmup.save_hf_path
        try:
            asyncio.run(rl(cfg, start))
        except asyncio.CancelledError:
            if StopRequest.signal_name is None:
                raise
            log.warning("stopped by %s during start-up; %s", StopRequest.signal_name, what_a_rerun_does(cfg))
            return
    from megarl.metrics.plot import plot_run

    log.info("curves: %s", plot_run(run_dir)[0])


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv[1:]``) run; the process's exit status."""
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
    cfg = None
    try:
        cfg = load_config(args)
        if print_job:
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        run(cfg)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megarl: interrupted{'' if cfg is None else '; ' + what_a_rerun_does(cfg)}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
    except TrainerNodeLost as exc:
        print(f"megarl: {exc}; {what_a_rerun_does(cfg)}", file=sys.stderr)
        return NODE_LOST_EXIT  # slurm/megarl.sbatch requeues the job on it
    return 0


def what_a_rerun_does(cfg: DictConfig) -> str:
    """After a run was interrupted: where the same command would start (the newest complete
    checkpoint, as a resume takes it)."""
    from megarl.trainer.checkpoint import CheckpointError, latest_step, newest_complete

    if cfg.mode == "warmup":
        return "the warm-up saves its checkpoint at its end only: the same command starts it over"
    root = Path(cfg.logging.run_dir) / "checkpoints"
    if latest_step(root) is None or not cfg.trainer.resume:
        return "no checkpoint to resume from: the same command starts the run over"
    try:
        path, skipped = newest_complete(root)
    except CheckpointError as e:
        return f"{e}: the same command cannot resume (move the checkpoints aside to start over)"
    step = int(path.name.removeprefix("iter_"))
    passed = f"; newer ones are incomplete: {'; '.join(skipped)}" if skipped else ""
    return f"the same command resumes after step {step} (the run's newest complete checkpoint{passed})"


if __name__ == "__main__":
    sys.exit(main())
