"""megarl's sync-mode RL step against a bare torch + transformers loop doing the same work, in one run.

The work of a step (the demo's): ``--prompts`` addition problems x ``--samples`` answers of at most
``--max-new-tokens`` tokens sampled at temperature 1 with top-k 20 from the warmed-up tiny MoE, the
exact-answer reward, group-normalised (GRPO) advantages, a clipped policy-gradient loss over the
response tokens and one Adam step on every weight. megarl does it through its whole system (Ray
actors, the SGLang engine, the trainer rank, the weight sync into the engine, metrics); the bare loop
does it in this process with ``transformers``' ``generate`` and ``torch.optim.Adam``, nothing else.

  megarl step s     median seconds between consecutive steps' metrics rows (``time``), start-up and
                    the first ``--skip`` steps excluded
  bare step s       median seconds of a bare step over both bare runs, each without its first
                    ``--skip`` steps
  overhead_ratio    megarl step s / bare step s

Both run on the same warmed-up checkpoint; the bare loop runs ``--steps`` steps before megarl and
``--steps`` after it, so a drift of the machine's speed during the run (a third within an hour
here) moves both sides alike instead of deciding the ratio (``bare_step_s_before`` /
``bare_step_s_after`` show it). The bare loop uses every core
(``torch.set_num_threads(os.cpu_count())``, whatever ``OMP_NUM_THREADS`` says: with one thread its
step takes ~40% longer and the ratio flatters megarl), megarl its own placement (engine and trainer
one thread each).

Usage: python tools/bench/overhead.py --json FILE [--steps N --prompts P --samples G ...]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from demo_workload import add_workload_arguments, workload_overrides
from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def megarl_step_seconds(run_dir: Path, skip: int) -> list[float]:
    """Seconds between consecutive RL steps' metrics rows, the first ``skip`` steps left out."""
    from megarl.metrics.sink import read_metrics

    times = [r["time"] for r in read_metrics(run_dir) if "reward/mean" in r]
    return [b - a for a, b in zip(times[skip:], times[skip + 1:])]


def bare_loop(checkpoint: Path, steps: int, prompts: int, samples: int, max_new_tokens: int, lr: float,
              clip: float, seed: int) -> tuple[list[float], list[float]]:
    """``steps`` GRPO steps with transformers + torch alone; returns (seconds, mean reward) per step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.tasks.arithmetic import reward, sample_problems

    torch.manual_seed(seed)
    torch.set_num_threads(os.cpu_count())
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.99))
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    seconds, rewards = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        problems = sample_problems(prompts, rng)
        encoded = [tok.encode(p.prompt) for p in problems]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])  # left-padded
        attention = (torch.arange(width) >= torch.tensor([width - len(e) for e in encoded])[:, None]).long()
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0, top_k=20,
                                 max_new_tokens=max_new_tokens, num_return_sequences=samples, eos_token_id=eos,
                                 pad_token_id=pad)
        response = out[:, width:]
        ended = (response == eos).cumsum(1)
        mask = (ended - (response == eos).long()) == 0  # tokens up to and including the first EOS
        r = torch.tensor([reward(tok.decode(row[m & (row != eos)]), problems[i // samples].answer,
                                 bool((row[m] == eos).any()))
                          for i, (row, m) in enumerate(zip(response, mask))]).view(prompts, samples)
        advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        model.train()
        full_attention = torch.cat([attention.repeat_interleave(samples, 0), mask.long()], 1)
        logits = model(input_ids=out, attention_mask=full_attention).logits[:, width - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, response[..., None])[..., 0]
        ratio = torch.exp(logp - logp.detach())
        surrogate = torch.minimum(ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None])
        loss = -(surrogate * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seconds.append(time.perf_counter() - t0)
        rewards.append(float(r.mean()))
    return seconds, rewards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, steps=20, prompts=64, max_new_tokens=3)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    args = parser.parse_args()

    from megarl.config import load_config
    from megarl.log import setup_logging
    from megarl.train import main as train

    setup_logging()
    work = work_directory(args.work_dir, "megarl-bench-")
    common = workload_overrides(work, args)
    if train(["recipe=tiny_moe_cpu", "mode=warmup", f"logging.run_dir={work / 'warmup'}", *common]) != 0:
        return 1
    cfg = load_config(["recipe=tiny_moe_cpu", *common])

    def bare() -> tuple[list[float], list[float]]:
        return bare_loop(work / "warm", args.steps, args.prompts, args.samples, args.max_new_tokens, cfg.trainer.lr,
                         cfg.algorithm.clip_high, cfg.task.seed)

    bare_before, rewards_before = bare()
    if train(["recipe=tiny_moe_cpu", "mode=sync", f"logging.run_dir={work / 'sync'}", *common]) != 0:
        return 1
    bare_after, rewards_after = bare()
    megarl_seconds = megarl_step_seconds(work / "sync", args.skip)
    megarl_step = statistics.median(megarl_seconds)
    bare_step = statistics.median(bare_before[args.skip:] + bare_after[args.skip:])
    import torch

    result = {
        "overhead_ratio": megarl_step / bare_step,
        "megarl_step_s": megarl_step,
        "bare_step_s": bare_step,
        "bare_step_s_before": statistics.median(bare_before[args.skip:]),
        "bare_step_s_after": statistics.median(bare_after[args.skip:]),
        "megarl_step_seconds": megarl_seconds,
        "bare_step_seconds_before": bare_before,
        "bare_step_seconds_after": bare_after,
        "bare_reward_mean_before": rewards_before,
        "bare_reward_mean_after": rewards_after,
        "bare_torch_threads": torch.get_num_threads(),
        "workload": {"steps": args.steps, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                     "max_new_tokens": args.max_new_tokens, "skip": args.skip},
    }
    print(f"megarl sync step {megarl_step:.3f} s, bare loop {bare_step:.3f} s "
          f"(before {result['bare_step_s_before']:.3f}, after {result['bare_step_s_after']:.3f}): "
          f"overhead_ratio {result['overhead_ratio']:.2f} (medians over steps {args.skip + 1}-{args.steps})")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
