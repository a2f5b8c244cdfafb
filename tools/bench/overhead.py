"""megarl's RL step, sync and async, against a bare torch + transformers loop doing the same work, in one run.

The work of a step (the demo's): ``--prompts`` addition problems x ``--samples`` answers of at most
``--max-new-tokens`` tokens sampled at temperature 1 with top-k 20 from the warmed-up tiny MoE, the
exact-answer reward, group-normalised (GRPO) advantages, a clipped policy-gradient loss over the
response tokens and one Adam step on every weight. megarl does it through its whole system (Ray
actors, the SGLang engine, the trainer rank, the weight sync into the engine, metrics); the bare loop
does it in this process with ``transformers``' ``generate`` and ``torch.optim.Adam``, nothing else.

  megarl step s          median seconds between consecutive steps' metrics rows (``time``), start-up
                         and the first ``--skip`` steps excluded; ``mode=sync`` and ``mode=async``
  bare step s            median seconds of a bare step over both bare runs of a repeat, each without
                         its first ``--skip`` steps
  overhead_ratio         sync step s / bare step s
  async_overhead_ratio   async step s / bare step s
  cpu_s_per_step         CPU seconds a step by process role (:mod:`process_cpu`), over the counted steps
                         (null when they span under two of its samples)
  sync_step_parts        medians of the sync run's rollout wait (``time/wait_s``), training (``time/train_s``)
                         and weight sync (``sync/total_s``) seconds, and the rest of its step
  bare_step_parts        medians of the bare loop's generate and train (reward, loss, backward, Adam) seconds
                         (these three at the top level: the repeat of the median ``overhead_ratio``)
  engine_generate_s      median seconds of the step's batch (``--prompts`` x ``--samples`` prompts, the
                         recipe's sampling parameters, log-probs, routed experts and sampling masks asked
                         for as megarl asks) sent as one ``/generate`` straight to a SGLang server started
                         as megarl starts the recipe's policy engine: the engine's own cost, no megarl around it
  engine_over_bare_step  engine_generate_s / bare step s: how much of ``overhead_ratio`` the engine's
                         rollout alone accounts for

Each of ``--repeats`` repeats runs the bare loop, megarl sync, megarl async, the engine alone and the
bare loop again on the same warmed-up checkpoint, so a drift of the machine's speed during the run moves
both sides alike (``bare_step_s_before`` / ``bare_step_s_after`` show it); the top-level ratios are the medians over
the repeats. The bare loop uses every core (``torch.set_num_threads(os.cpu_count())``: with one
thread its step takes longer and the ratio flatters megarl), megarl its own placement (engine
and trainer one thread each).

Usage: python tools/bench/overhead.py --json FILE [--repeats R --steps N --prompts P --samples G ...]
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
from process_cpu import CpuSampler
from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


PARTS = {"rollout_wait_s": "time/wait_s", "train_s": "time/train_s", "sync_s": "sync/total_s"}  # metrics keys


def megarl_step_rows(run_dir: Path, skip: int) -> list[dict]:
    """The RL steps' metrics rows, the first ``skip`` steps left out."""
    from megarl.metrics.sink import read_metrics

    return [r for r in read_metrics(run_dir) if "reward/mean" in r][skip:]


def step_parts(rows: list[dict], step_s: float) -> dict[str, float]:
    """Medians of a run's :data:`PARTS` over ``rows``, and ``rest_s``: ``step_s`` minus their sum."""
    parts = {name: statistics.median(r[key] for r in rows) for name, key in PARTS.items()}
    return parts | {"rest_s": step_s - sum(parts.values())}


def bare_loop(checkpoint: Path, steps: int, prompts: int, samples: int, max_new_tokens: int, lr: float,
              clip: float, seed: int) -> tuple[list[float], list[float], list[float]]:
    """``steps`` GRPO steps with transformers + torch alone; returns (seconds, generate seconds, mean
    reward) per step."""
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
    seconds, generate_seconds, rewards = [], [], []
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
        generate_seconds.append(time.perf_counter() - t0)
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
    return seconds, generate_seconds, rewards


def engine_alone(checkpoint: Path, cfg, steps: int, prompts: int, samples: int, max_new_tokens: int,
                 log_path: Path) -> list[float]:
    """Seconds of ``steps`` ``/generate`` calls, each one step's batch of fresh problems (every prompt
    ``samples`` times), to a SGLang server started with the settings megarl gives the run ``cfg``'s first
    policy engine (:func:`megarl.pipeline.startup.engines.plan_engines`), in megarl's request body
    (:func:`megarl.engines.client.generate_payload`); each time runs from sending the request to having the
    whole answer, without parsing it."""
    import dataclasses

    import httpx
    import orjson
    from transformers import AutoTokenizer

    from megarl.engines.client import generate_payload
    from megarl.engines.server import SGLangEngine
    from megarl.engines.types import SamplingParams
    from megarl.pipeline.startup.engines import plan_engines
    from megarl.platform.description import detect
    from megarl.tasks.arithmetic import sample_problems

    r = cfg.rollout
    policy = plan_engines(cfg, str(checkpoint), None, detect()).settings["policy"][0]
    settings = dataclasses.replace(policy, log_path=str(log_path))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    tok, rng, seconds = AutoTokenizer.from_pretrained(checkpoint), random.Random(cfg.task.seed), []
    with SGLangEngine(settings) as engine, httpx.Client(timeout=600.0) as http:
        for _ in range(steps):
            ids = [tok(p.prompt)["input_ids"] for p in sample_problems(prompts, rng)]
            body = orjson.dumps(generate_payload([p for p in ids for _ in range(samples)], params, r.keep_routing,
                                                 r.keep_sampling_mask))
            t0 = time.perf_counter()
            http.post(f"{engine.url}/generate", content=body,
                      headers={"content-type": "application/json"}).raise_for_status()
            seconds.append(time.perf_counter() - t0)
    return seconds


def megarl_run(mode: str, run_dir: Path, common: list[str], skip: int) -> dict:
    """One megarl run in ``mode`` (sync | async): its median step seconds and CPU seconds a step by role."""
    from megarl.train import main as train

    sampler = CpuSampler()
    sampler.start()
    try:
        if train(["recipe=tiny_moe_cpu", f"mode={mode}", f"logging.run_dir={run_dir}", *common]) != 0:
            raise RuntimeError(f"the {mode} run in {run_dir} failed")
    finally:
        sampler.stop()
    rows = megarl_step_rows(run_dir, skip)
    times = [r["time"] for r in rows]
    seconds = [b - a for a, b in zip(times, times[1:])]
    return {"step_s": statistics.median(seconds), "step_seconds": seconds,
            "step_parts": step_parts(rows[1:], statistics.median(seconds)),
            "cpu_s_per_step": sampler.per_step(times[0], times[-1], len(seconds))}


def one_repeat(work: Path, index: int, common: list[str], bare, engine, skip: int) -> dict:
    """Bare loop, megarl sync, megarl async, the engine alone, bare loop: the figures of one repeat."""
    bare_before, generate_before, rewards_before = bare()
    runs = {mode: megarl_run(mode, work / f"{mode}{index}", common, skip) for mode in ("sync", "async")}
    engine_seconds = engine(work / f"engine{index}.log")
    bare_after, generate_after, rewards_after = bare()
    bare_step = statistics.median(bare_before[skip:] + bare_after[skip:])
    bare_generate = statistics.median(generate_before[skip:] + generate_after[skip:])
    engine_generate = statistics.median(engine_seconds[skip:])
    return {"overhead_ratio": runs["sync"]["step_s"] / bare_step,
            "async_overhead_ratio": runs["async"]["step_s"] / bare_step,
            "engine_over_bare_step": engine_generate / bare_step,
            "megarl_step_s": runs["sync"]["step_s"], "megarl_async_step_s": runs["async"]["step_s"],
            "bare_step_s": bare_step, "engine_generate_s": engine_generate,
            "sync_step_parts": runs["sync"]["step_parts"],
            "bare_step_parts": {"generate_s": bare_generate, "train_s": bare_step - bare_generate},
            "bare_step_s_before": statistics.median(bare_before[skip:]),
            "bare_step_s_after": statistics.median(bare_after[skip:]), "megarl": runs,
            "bare_step_seconds_before": bare_before, "bare_step_seconds_after": bare_after,
            "engine_generate_seconds": engine_seconds,
            "bare_reward_mean_before": rewards_before, "bare_reward_mean_after": rewards_after}


def _rounded(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in parts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, steps=20, prompts=64, max_new_tokens=3)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=3, help="repeats; the ratios are their medians")
    args = parser.parse_args()
    if args.steps < args.skip + 2:  # a step's time is between two counted metrics rows
        parser.error(f"--steps {args.steps} leaves under two steps after --skip {args.skip}: "
                     f"give at least {args.skip + 2}")

    import torch

    from megarl.config import load_config
    from megarl.log import setup_logging
    from megarl.train import main as train

    setup_logging()
    work = work_directory(args.work_dir, "megarl-bench-")
    common = workload_overrides(work, args)
    if train(["recipe=tiny_moe_cpu", "mode=warmup", f"logging.run_dir={work / 'warmup'}", *common]) != 0:
        return 1
    cfg = load_config(["recipe=tiny_moe_cpu", *common])

    def bare() -> tuple[list[float], list[float], list[float]]:
        return bare_loop(work / "warm", args.steps, args.prompts, args.samples, args.max_new_tokens, cfg.trainer.lr,
                         cfg.algorithm.clip_high, cfg.task.seed)

    def engine(log_path: Path) -> list[float]:
        return engine_alone(work / "warm", cfg, args.steps, args.prompts, args.samples, args.max_new_tokens, log_path)

    repeats = [one_repeat(work, i, common, bare, engine, args.skip) for i in range(args.repeats)]
    keys = ("overhead_ratio", "async_overhead_ratio", "engine_over_bare_step", "megarl_step_s", "megarl_async_step_s",
            "bare_step_s", "engine_generate_s")
    middle = sorted(repeats, key=lambda r: r["overhead_ratio"])[len(repeats) // 2]
    result = {**{k: statistics.median(r[k] for r in repeats) for k in keys},
              "sync_step_parts": middle["sync_step_parts"], "bare_step_parts": middle["bare_step_parts"],
              "cpu_s_per_step": {mode: middle["megarl"][mode]["cpu_s_per_step"] for mode in ("sync", "async")},
              "repeats": repeats, "bare_torch_threads": torch.get_num_threads(),
              "workload": {"steps": args.steps, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                           "max_new_tokens": args.max_new_tokens, "skip": args.skip, "repeats": args.repeats}}
    for r in repeats:
        print(f"sync step {r['megarl_step_s']:.3f} s, async {r['megarl_async_step_s']:.3f} s, bare loop "
              f"{r['bare_step_s']:.3f} s (before {r['bare_step_s_before']:.3f}, after {r['bare_step_s_after']:.3f}): "
              f"overhead_ratio {r['overhead_ratio']:.2f}, async_overhead_ratio {r['async_overhead_ratio']:.2f}; "
              f"engine alone {r['engine_generate_s']:.3f} s ({r['engine_over_bare_step']:.2f} bare steps)")
    cpu = result["cpu_s_per_step"]["sync"] or "not sampled (the counted steps span under two 1 s samples: more --steps)"
    print(f"medians of {args.repeats}: overhead_ratio {result['overhead_ratio']:.2f}, async_overhead_ratio "
          f"{result['async_overhead_ratio']:.2f}, engine_over_bare_step {result['engine_over_bare_step']:.2f}; "
          f"CPU s a sync step by role {cpu}")
    print(f"a sync step's parts (s) {_rounded(result['sync_step_parts'])}; "
          f"the bare loop's {_rounded(result['bare_step_parts'])}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
