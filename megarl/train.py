"""``python -m megarl.train recipe=NAME key=value ...``: the megarl driver.

``--cfg job`` prints the resolved config and exits. A bad recipe or override exits with status 2
and one line naming the key. ``mode=warmup`` runs the supervised warm-up that makes the RL
starting checkpoint; ``mode=sync`` runs it when its checkpoint is missing, then synchronous RL
(one_step_off and async come with the async pipeline).
"""
from __future__ import annotations

import logging
import sys
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


def rl_sync(cfg: DictConfig, start_checkpoint: str) -> None:
    """Synchronous GRPO-style RL: generate a batch on the engine, train one step on it, sync the
    weights into the engine, repeat. (The async pipeline replaces the weight sync and the loop.)"""
    import asyncio
    import os
    import random
    import shutil
    import time

    import ray
    from rich.progress import Progress
    from transformers import AutoTokenizer

    from megarl.metrics.sink import MetricsFile
    from megarl.rollout import arithmetic
    from megarl.rollout.client import SamplingParams, ServedModel, SGLangClient
    from megarl.rollout.engine import EngineSettings, SGLangEngine
    from megarl.rollout.manager import fill_advantages, rollout_groups
    from megarl.trainer.actor import TrainerGroup
    from megarl.trainer.distributed import Layout
    from megarl.trainer.rl_batch import build_rl_batch

    r, t, p = cfg.rollout, cfg.trainer, cfg.parallel
    layout = Layout.from_config(p)
    tokenizer = AutoTokenizer.from_pretrained(start_checkpoint)
    served = ServedModel.from_hf_config(start_checkpoint)
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    weights_dir = Path(cfg.logging.run_dir) / "engine_weights"
    rng = random.Random(cfg.task.seed)
    if os.environ.get("RAY_ADDRESS"):  # a cluster started for us (slurm/megarl.sbatch exports it)
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, layout.world_size + 1), include_dashboard=False, log_to_driver=False)
    trainer = TrainerGroup(layout, backend=p.backend, seed=t.seed)
    trainer.call("build", start_checkpoint, optimizer_settings(cfg, cfg.trainer.lr), cfg.model.transformer_impl.value,
                 p.dispatcher.value, True)
    engine = SGLangEngine(EngineSettings(model_path=start_checkpoint, sampling_mask_max_tokens=max(r.top_k, 1),
                                         max_total_tokens=r.max_total_tokens, random_seed=cfg.task.seed))
    metrics = MetricsFile(cfg.logging.run_dir)

    async def loop(client: SGLangClient) -> None:
        with Progress() as progress:
            task = progress.add_task("RL", total=cfg.steps)
            for step in range(1, cfg.steps + 1):
                t0 = time.time()
                problems = arithmetic.sample_problems(r.prompts_per_step, rng, cfg.task.max_operand)
                samples = await rollout_groups(client, tokenizer, problems, r.samples_per_prompt, params,
                                               routing=True, sampling_mask=r.keep_sampling_mask)
                stats = fill_advantages(samples, cfg.algorithm.advantage)
                t1 = time.time()
                batch = build_rl_batch(samples, tokenizer.pad_token_id, p.tp if p.sequence_parallel else 1,
                                       with_sampling_mask=r.keep_sampling_mask)
                result = trainer.call("rl_step", batch, cfg.algorithm, vocab_size=served.vocab_size,
                                      max_tokens_per_microbatch=t.max_tokens_per_microbatch, keep_routing=r.keep_routing,
                                      sequence_parallel=p.sequence_parallel, temperature=r.temperature)
                t2 = time.time()
                shutil.rmtree(weights_dir, ignore_errors=True)
                trainer.call("save_hf", str(weights_dir))
                await client.update_weights_from_disk(weights_dir, version=step)
                t3 = time.time()
                row = {"reward/mean": stats.reward_mean, "response/len_mean": stats.response_len_mean,
                       "groups/mixed_frac": stats.mixed_group_frac, "train/grad_norm": result.grad_norm,
                       **{f"train/{k}" if "/" not in k else k: v for k, v in result.metrics.items()},
                       "perf/tokens_per_s": stats.tokens / (t1 - t0), "time/rollout_s": t1 - t0,
                       "time/train_s": t2 - t1, "sync/seconds": t3 - t2}
                metrics.log(step, row)
                progress.update(task, advance=1, description=f"RL reward {stats.reward_mean:.2f}")
                log.info("step %d: reward %.3f, mixed groups %.2f, mismatch %.2e, rollout %.1fs train %.1fs sync %.1fs",
                         step, stats.reward_mean, stats.mixed_group_frac, row.get("mismatch/logprob_abs_diff", float("nan")),
                         t1 - t0, t2 - t1, t3 - t2)

    try:
        engine.start()

        async def with_client():
            async with SGLangClient(engine.url, served) as client:
                await loop(client)

        asyncio.run(with_client())
    finally:
        metrics.close()
        engine.stop()
        trainer.shutdown()
        ray.shutdown()


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
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a new run (resuming one is not built yet)
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
        rl_sync(cfg, start)
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
