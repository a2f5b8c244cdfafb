"""RL step throughput with packed (THD) against padded micro-batches, on a long-tailed batch.

usage: python tools/bench/packing.py [--json FILE] [--samples N] [--tail-frac F] [--repeats R]
                                     [--max-tokens N]

The tiny model (built into a temporary directory) trains one RL step with Keep Routing and Keep
Sampling Mask on a batch whose responses are mostly short (1-8 tokens) and, for ``--tail-frac`` of
the samples, fill the model's whole context. The two modes alternate ``--repeats`` times on the
same samples, in one process; the figures are medians. JSON keys: ``packed_over_padded_tokens_per_s``
(real tokens per second packed / padded), ``padding_frac_packed``, ``padding_frac_padded``, and per
mode ``tokens_per_s`` and ``seconds_per_step``.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time

from megarl.trainer.micro_batching import MicroBatching

log = logging.getLogger("bench.packing")


def long_tailed_samples(n: int, context: int, tail_frac: float, vocab: int, layers: int, experts: int, topk: int,
                        seed: int = 0) -> list:
    """Samples of 8-16 prompt tokens; responses of 1-8 tokens, a ``tail_frac`` share up to the context."""
    import numpy as np

    from megarl.sample import FinishReason, RolloutSample, SamplingMask

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(8, 16)
        response = context - prompt if rng.random() < tail_frac else rng.randint(1, 8)
        ids = [rng.randrange(3, vocab) for _ in range(prompt + response)]
        routed = np.stack([np.stack([np.array(rng.sample(range(experts), topk)) for _ in range(layers)])
                           for _ in range(prompt + response - 1)]).astype(np.int16)
        rows = [sorted({ids[prompt + r], *rng.sample(range(3, vocab), 7)}) for r in range(response)]
        out.append(RolloutSample(
            prompt_ids=ids[:prompt], response_ids=ids[prompt:], loss_mask=np.ones(response, np.uint8),
            rollout_logprobs=np.full(response, -2.0, np.float32), model_version=np.zeros(response, np.int32),
            routed_experts=routed, sampling_mask=SamplingMask.from_rows(rows), finish_reason=FinishReason.STOP,
            advantage=rng.gauss(0, 1), group_id=str(i // 8)))
    return out


def run(samples: int, tail_frac: float, repeats: int, max_tokens: int) -> dict:
    import torch

    from megarl.algos.settings import AlgorithmConfig
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.models.tiny_moe import make_tiny_moe
    from megarl.parallel import Layout, free_port
    from megarl.trainer.distributed import init_rank
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.packing import plan_micro_batches
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        hf_path = str(make_tiny_moe(tmp))
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(hf_path)
        init_rank(0, Layout(), "127.0.0.1", free_port(), backend="gloo")
        trainable = build_trainable(hf_path, Layout(), optimizer_settings(default_config(), lr=1e-5),
                                    ModelSettings(transformer_impl="local", routing_replay=True))
        batch = build_rl_batch(long_tailed_samples(samples, hf.max_position_embeddings, tail_frac, hf.vocab_size,
                                                   hf.num_hidden_layers, hf.num_local_experts, hf.num_experts_per_tok))
        real = int(batch.lengths.sum())
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(repeats + 1):  # the first round warms up
            for pack in (False, True):
                t0 = time.perf_counter()
                rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                        batching=MicroBatching(max_tokens=max_tokens, vocab_size=hf.vocab_size, keep_routing=True,
                                               sequence_parallel=False, pack=pack))
                if r:
                    times[pack].append(time.perf_counter() - t0)
        result = {"samples": samples, "real_tokens": real, "tail_frac": tail_frac,
                  "max_tokens_per_microbatch": max_tokens,
                  "context": hf.max_position_embeddings, "repeats": repeats, "machine": platform.machine(),
                  "torch_threads": torch.get_num_threads()}
        for pack, name in ((True, "packed"), (False, "padded")):
            seconds = statistics.median(times[pack])
            plan = plan_micro_batches(batch.lengths, 1, max_tokens, pack=pack)
            result[name] = {"seconds_per_step": seconds, "tokens_per_s": real / seconds,
                            "micro_batches": plan.num_micro_batches}
            result[f"padding_frac_{name}"] = plan.padding_frac(batch.lengths)
        result["packed_over_padded_tokens_per_s"] = result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tail-frac", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    from megarl.log import setup_logging

    setup_logging()
    result = run(args.samples, args.tail_frac, args.repeats, args.max_tokens)
    print(f"packed {result['packed']['tokens_per_s']:.0f} tokens/s (padding {result['padding_frac_packed']:.3f}), "
          f"padded {result['padded']['tokens_per_s']:.0f} tokens/s (padding {result['padding_frac_padded']:.3f}): "
          f"packed/padded = {result['packed_over_padded_tokens_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
