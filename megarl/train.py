"""``python -m megarl.train recipe=NAME key=value ...``: the megarl driver.

``--cfg job`` prints the resolved config and exits. A bad recipe or override exits with status 2
and one line naming the key, and so do delta syncs whose host copies do not fit a node's memory
(:mod:`megarl.planner.delta_memory`). ``mode=warmup`` runs the tiny recipes' supervised warm-up that makes
their RL starting checkpoint; the RL modes (``sync``, ``one_step_off``, ``async``) run it first when
``warmup.steps`` > 0 and its checkpoint is missing, else start from ``model.hf_path``. A run
directory belongs to one run (:mod:`megarl.pipeline.run_dir`): one with a checkpoint resumes from it
(``trainer.resume``), in its own mode, or says in one line that it has nothing left to train (exit 0);
starting over sets the old run aside. A trainer node that leaves the Ray cluster, or a trainer rank whose
process dies alone, ends the run with one line naming it and status 75 (:mod:`megarl.pipeline.node_watch`).
SIGTERM or SIGUSR1 makes the run checkpoint after the current step and exit (during start-up: exit
at once, status 0), and so does Ctrl-C during the RL steps; a second Ctrl-C, or one before the steps
begin, stops at once (exit status 130, one line naming the command that resumes and its step).
A driver whose environment names an owner process (``MEGARL_END_WITH_PID``, :mod:`megarl.lifetime`) ends
with it.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megarl.config import ConfigError, load_config
from megarl.config.components import warmup_job
from megarl.lifetime import end_with_owner_from_env
from megarl.log import setup_logging
from megarl.pipeline.node_watch import NODE_LOST_EXIT, TrainerLost

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


def check_model(cfg: DictConfig) -> None:
    """``model.hf_path`` is an HF checkpoint directory, or the tiny demo checkpoint is to be built there
    (``model.make_tiny_if_missing``: the recipe's own path, :func:`megarl.config.load_config`); ConfigError else."""
    hf_path = Path(cfg.model.hf_path)
    if not (hf_path / "config.json").is_file() and not cfg.model.make_tiny_if_missing:
        raise ConfigError(f"model.hf_path: {hf_path} is not an HF checkpoint directory (no config.json)")


def ensure_model(cfg: DictConfig) -> Path:
    """``model.hf_path``, the tiny demo checkpoint built there when it is missing (:func:`check_model`)."""
    hf_path = Path(cfg.model.hf_path)
    if not (hf_path / "config.json").is_file():
        from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

        log.info("building the tiny demo checkpoint at %s", hf_path)
        spec = TinyMoeSpec.from_arch(cfg.model.arch, tool_calling=cfg.model.tiny_variant.value == "tool_calling")
        make_tiny_moe(hf_path, spec, max_operand=cfg.task.max_operand)
    return hf_path


def rl_start(cfg: DictConfig, hf_path: Path) -> str:
    """The checkpoint RL starts from: the warm-up's when ``warmup.steps`` > 0 (made first when absent; an existing
    one is used as it is, and a log line says so), else ``model.hf_path``."""
    if cfg.warmup.steps <= 0:
        return str(hf_path)
    if (Path(cfg.warmup.save_hf_path) / "config.json").is_file():
        log.info("warm-up skipped: its checkpoint %s exists (warmup.steps=%d is not run again; delete it or set "
                 "warmup.save_hf_path to warm up anew)", cfg.warmup.save_hf_path, cfg.warmup.steps)
    else:
        warmup(cfg)
    return cfg.warmup.save_hf_path


def run(cfg: DictConfig, command: list[str] | None = None) -> None:
    """The run ``cfg`` describes, from its run directory and model to its curves' PNG (module docstring);
    ``command``: the driver's arguments, for the lines that say how to resume or start over."""
    from megarl.config.platform_rules import refuse_what_is_not_built
    from megarl.pipeline.run_dir import open_run_dir
    from megarl.pipeline.signals import StopRequest
    from megarl.planner.delta_memory import check_delta_memory, node_host_bytes

    refuse_what_is_not_built(cfg)
    if cfg.mode != "warmup":
        check_delta_memory(cfg, node_host_bytes(cfg))
        StopRequest.install()
    check_model(cfg)
    run_dir = open_run_dir(cfg, command or [])
    hf_path = ensure_model(cfg)
    if cfg.mode == "warmup":
        warmup(cfg)
    else:
        import torch

        # the driver's tensor work (batches, advantages) is memory-bound bookkeeping: intra-op threads there
        # spin on cores the engines and ranks need and save nothing
        torch.set_num_threads(1)
        try:
            asyncio.run(rl(cfg, rl_start(cfg, hf_path)))
        except asyncio.CancelledError:
            if StopRequest.signal_name is None:
                raise
            log.warning("stopped by %s during start-up; %s", StopRequest.signal_name, what_a_rerun_does(cfg, command))
            return
        if StopRequest.signal_name is not None:
            log.warning("stopped by %s; %s", StopRequest.signal_name, what_a_rerun_does(cfg, command))
    from megarl.metrics.plot import plot_run

    log.info("curves: %s", plot_run(run_dir)[0])


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``, default ``sys.argv[1:]``) run; the process's exit status."""
    from megarl.pipeline.run_dir import NothingLeftToTrain

    args = list(sys.argv[1:] if argv is None else argv)
    end_with_owner_from_env()  # started by a test worker: ends with it (megarl.lifetime)
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
        run(cfg, args)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    except NothingLeftToTrain as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print(f"megarl: interrupted{'' if cfg is None else '; ' + what_a_rerun_does(cfg, args)}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
    except TrainerLost as exc:
        print(f"megarl: {exc}; {what_a_rerun_does(cfg, args)}", file=sys.stderr)
        return NODE_LOST_EXIT  # slurm/megarl.sbatch requeues the job on it
    return 0


def what_a_rerun_does(cfg: DictConfig, command: list[str] | None = None) -> str:
    """After a run was interrupted: the command that resumes it (``command``, the driver's arguments, without
    ``trainer.resume=false``) and where it would start (the newest complete checkpoint, as a resume takes it)."""
    from megarl.pipeline.run_dir import resume_command
    from megarl.trainer.checkpoint import CheckpointError, latest_step, newest_complete

    if cfg.mode == "warmup":
        return "the warm-up saves its checkpoint at its end only: the same command starts it over"
    root = Path(cfg.logging.run_dir) / "checkpoints"
    if latest_step(root) is None:
        return "no checkpoint to resume from: the same command starts the run over"
    rerun = "the same command" if command is None else f"`{resume_command(command)}`"
    try:
        path, skipped = newest_complete(root)
    except CheckpointError as e:
        return f"{e}: {rerun} cannot resume (trainer.resume=false starts over, the old run set aside)"
    step = int(path.name.removeprefix("iter_"))
    passed = f"; newer ones skipped: {'; '.join(skipped)}" if skipped else ""
    return f"{rerun} resumes after step {step} (the run's newest complete checkpoint{passed})"


if __name__ == "__main__":
    sys.exit(main())
