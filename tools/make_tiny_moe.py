"""Create the demo's tiny Qwen3-MoE HF checkpoint (random init) and its byte-level BPE tokenizer.

usage: python tools/make_tiny_moe.py OUT_DIR [--seed N]
"""
import argparse
import logging

from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_tiny_moe(args.out_dir, TinyMoeSpec(seed=args.seed))
