"""The demo recipe's workload as bench arguments: steps, prompts x samples, response length, warm-up.

Shared by the benches that run ``recipe=tiny_moe_cpu`` end to end (``overhead.py``,
``async_vs_sync.py``): the same flags, and the overrides that put one run's checkpoints and the
workload in ``work``.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def add_workload_arguments(parser: argparse.ArgumentParser, *, steps: int, prompts: int, max_new_tokens: int) -> None:
    """``--json --steps --prompts --samples --max-new-tokens --warmup-steps --work-dir`` with these defaults."""
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                        help="the tiny model's context is 64 tokens")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")


def workload_overrides(work: Path, args: argparse.Namespace) -> list[str]:
    """Config overrides for every run of a bench: checkpoints under ``work``, the parsed workload, no resume."""
    return [f"model.hf_path={work / 'base'}", "model.make_tiny_if_missing=true",
            f"warmup.save_hf_path={work / 'warm'}", f"steps={args.steps}",
            f"warmup.steps={args.warmup_steps}", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.max_new_tokens}",
            "trainer.resume=false"]
