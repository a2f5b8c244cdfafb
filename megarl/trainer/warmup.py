"""Supervised warm-up on the task's format: the way the demo's starting checkpoint is made.

RL from a random model sees groups whose rewards are all zero; a short supervised pass on
``prompt -> answer<eos>`` (loss on the answer tokens only) gives GRPO a policy with mixed rewards
to push (docs/architecture.md, "Warm-up before RL"). With the calculator environment, or the
tool-calling tiny model, the examples are whole episodes, ``tool_fraction`` of them calling the tool.
Runs on every rank of the layout; rank 0 reports.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from megarl.parallel import Layout
from megarl.tasks import arithmetic, calculator, tool_calling
from megarl.trainer.optimizer import OptimizerSettings
from megarl.trainer.settings import WarmupConfig
from megarl.trainer.token_batch import TokenBatch, masked_token_batch, token_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WarmupJob(WarmupConfig):
    """One warm-up run: the config's ``warmup`` section (its schema node,
    :class:`megarl.trainer.settings.WarmupConfig`) and what it takes from the rest
    (:func:`megarl.config.components.warmup_job`)."""

    hf_path: str
    run_dir: str
    optimizer: OptimizerSettings
    max_tokens_per_microbatch: int
    max_operand: int
    seed: int
    transformer_impl: str
    dispatcher: str
    env: str | None  # calculator: examples are episodes, tool_fraction of them calling the tool
    tool_calling: bool = False  # the tool-calling tiny model: examples are its task's chat episodes, as above


def answer_batch(tokenizer, problems: list[arithmetic.Problem]) -> TokenBatch:
    """``prompt + answer + eos`` per problem, the loss on ``answer + eos``."""
    sequences, starts = [], []
    for problem in problems:
        prompt = tokenizer(problem.prompt)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt + answer)
        starts.append(len(prompt))
    return token_batch(sequences, starts)


def episode_batch(tokenizer, problems: list[arithmetic.Problem], use_tool: list[bool]) -> TokenBatch:
    """The calculator task's episodes (:func:`megarl.tasks.calculator.transcript`), each piece
    tokenized on its own as the rollout does; the loss on the policy's pieces and the final eos."""
    sequences, trained = [], []
    for problem, tool in zip(problems, use_tool, strict=True):
        ids = tokenizer(problem.prompt)["input_ids"]
        mask = [0] * len(ids)
        for text, policy in calculator.transcript(problem, tool):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(policy)] * len(piece)
        sequences.append(ids + [tokenizer.eos_token_id])
        trained.append(mask + [1])
    return masked_token_batch(sequences, trained)


def chat_episode_batch(tokenizer, problems: list[arithmetic.Problem], use_tool: list[bool]) -> TokenBatch:
    """The tool-calling task's episodes (:func:`megarl.tasks.tool_calling.transcript`, rendered by the
    tokenizer's chat template with the task's tools), each piece tokenized on its own as the agent
    gateway does; the loss on the policy's pieces (their end-of-sequence tokens included)."""
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tool_calling.TOOLS, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    sequences, trained = [], []
    for problem, tool in zip(problems, use_tool, strict=True):
        ids, mask = [], []
        for text, policy in tool_calling.transcript(render, problem, tool):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(policy)] * len(piece)
        sequences.append(ids)
        trained.append(mask)
    return masked_token_batch(sequences, trained)


def run_warmup(rank: int, layout: Layout, job: WarmupJob) -> list[float]:
    """Train ``job.steps`` steps, save the HF checkpoint; returns the loss per step (rank 0: all)."""
    from megatron.core import parallel_state
    from rich.progress import Progress
    from transformers import AutoTokenizer

    from megarl.metrics.sink import MetricsFile
    from megarl.models.bridge import ModelSettings, save_hf_checkpoint
    from megarl.trainer.model_setup import build_trainable
    from megarl.trainer.sft_step import supervised_step

    tokenizer = AutoTokenizer.from_pretrained(job.hf_path)
    trainable = build_trainable(job.hf_path, layout, job.optimizer,
                                ModelSettings(transformer_impl=job.transformer_impl, dispatcher=job.dispatcher))
    rng = random.Random(job.seed)  # the same global batch on every rank; each takes its DP share
    reporter = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0)
    metrics = MetricsFile(job.run_dir) if reporter else None
    losses = []
    with Progress(disable=not reporter) as progress:
        task = progress.add_task("warm-up", total=job.steps)
        for step in range(1, job.steps + 1):
            problems = arithmetic.sample_problems(job.batch_size, rng, job.max_operand)
            if job.tool_calling:
                batch = chat_episode_batch(tokenizer, problems, [rng.random() < job.tool_fraction for _ in problems])
            elif job.env == "calculator":
                batch = episode_batch(tokenizer, problems, [rng.random() < job.tool_fraction for _ in problems])
            else:
                batch = answer_batch(tokenizer, problems)
            result = supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch,
                                     job.max_tokens_per_microbatch)
            losses.append(result.loss)
            if metrics:
                metrics.log(step, {"warmup/loss": result.loss, "warmup/grad_norm": result.grad_norm})
                progress.update(task, advance=1, description=f"warm-up loss {result.loss:.3f}")
                if step % job.log_interval == 0 or step == 1:
                    log.info("warm-up step %d/%d: loss %.4f, grad norm %.3f", step, job.steps, result.loss,
                             result.grad_norm)
    save_hf_checkpoint(trainable.model, job.save_hf_path)
    if metrics:
        metrics.close()
        log.info("saved the warmed-up HF checkpoint to %s", job.save_hf_path)
    return losses
