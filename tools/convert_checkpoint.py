"""Convert model weights between HF and Megatron torch_dist through megatron-bridge, and verify logits.

usage:
  python tools/convert_checkpoint.py to-megatron --hf HF_DIR --out CKPT_DIR [--tp 2 --ep 2 --etp 1 ...] [--verify]
  python tools/convert_checkpoint.py to-hf --megatron CKPT --hf HF_DIR --out HF_OUT [layout]
      [--max-shard-size 5GB] [--verify]
      [--config RUN_DIR/config.yaml | --lora-rank R --lora-alpha A --lora-targets linear_qkv,...] [--merge]
  python tools/convert_checkpoint.py verify --megatron CKPT --hf HF_DIR [layout] [--tolerance 1e-4]

CKPT is a torch_dist directory, or a trainer checkpoint root (its ``latest`` step is used). The
layout (--tp --pp --vpp --ep --etp --world-size) is the one the ranks shard the model under; one
process (a Ray actor) is started per rank. A LoRA run's trainer checkpoint holds its adapters only:
to-hf then needs their settings (the run's config.yaml, or --lora-rank/--lora-alpha/--lora-targets)
and, as --hf, the base model they were trained on, and writes an HF PEFT directory
(adapter_config.json + adapter_model.safetensors), or with --merge the base with the adapters
merged as an HF checkpoint. A quantized --hf checkpoint (a ``quantization_config`` in its config.json:
FP8 weights with their scales) is refused: megatron-bridge would read the FP8 tensors without their
scales. Exit status: 0 done (and verified), 1 verification above tolerance, 2 bad input. See
docs/recipes.md ("Bringing checkpoints in and out") and docs/troubleshooting.md.
"""
import argparse
import json
import re
import sys

from megarl.log import setup_logging
from megarl.models.hf_config import quantized_refusal
from megarl.trainer import convert

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def size_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size like 500MB, 5GB or 2GiB")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def target_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "to-megatron": sub.add_parser("to-megatron", help="HF checkpoint -> Megatron torch_dist"),
        "to-hf": sub.add_parser("to-hf", help="Megatron torch_dist (any layout) -> HF safetensors"),
        "verify": sub.add_parser("verify", help="Megatron logits vs HF transformers logits"),
    }
    for name, p in commands.items():
        p.add_argument("--hf", required=True, help="HF checkpoint directory (for to-hf/verify: the model's source; "
                       "for a LoRA checkpoint, the base model)")
        if name != "to-megatron":
            p.add_argument("--megatron", required=True, help="torch_dist checkpoint or trainer checkpoint root")
        if name != "verify":
            p.add_argument("--out", required=True, help="output directory (must be empty or absent)")
            p.add_argument("--verify", action="store_true", help="compare logits of both sides afterwards")
        for key in ("tp", "pp", "ep"):
            p.add_argument(f"--{key}", type=int, default=1)
        p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
        p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
        p.add_argument("--world-size", type=int, default=None, help="ranks (default: the fewest the layout needs)")
        p.add_argument("--dtype", default="auto", help="auto (the HF config's) | float32 | bfloat16 | float16")
        p.add_argument("--prompt", action="append", dest="prompts", help="a verification prompt (repeatable)")
        p.add_argument("--tolerance", type=float, default=None,
                       help=f"max |logit difference| (default by dtype: {convert.DEFAULT_TOLERANCE})")
        if name == "to-hf":
            p.add_argument("--max-shard-size", type=size_bytes, default=size_bytes("5GB"),
                           help="largest safetensors file (default 5GB); bounds rank 0's memory")
            p.add_argument("--merge", action="store_true",
                           help="a LoRA checkpoint: write the base with the adapters merged (an HF checkpoint) "
                                "instead of a PEFT directory")
            lora = p.add_argument_group("LoRA settings of an adapter checkpoint (a LoRA run's): --config or all three")
            lora.add_argument("--config", default=None, help="the run's config.yaml (its lora section)")
            lora.add_argument("--lora-rank", type=int, default=None)
            lora.add_argument("--lora-alpha", type=int, default=None)
            lora.add_argument("--lora-targets", type=target_list, default=None,
                              help="Megatron linear names, comma-separated (e.g. linear_qkv,linear_proj)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    if (why := quantized_refusal(args.hf, "a conversion's model")) is not None:
        print(f"error: --hf: {why}", file=sys.stderr)
        return 2
    layout = convert.conversion_layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp,
                                       world_size=args.world_size)
    prompts = list(args.prompts or convert.DEFAULT_PROMPTS)
    checked = args.command == "verify" or args.verify
    try:
        if args.command == "to-megatron":
            verified = convert.to_megatron(args.hf, args.out, layout, dtype=args.dtype,
                                           prompts=prompts if checked else None, tolerance=args.tolerance)
        elif args.command == "to-hf":
            lora = convert.lora_settings(args.config, args.lora_rank, args.lora_alpha, args.lora_targets)
            export = convert.HfExport(max_shard_bytes=args.max_shard_size, lora=lora, merge=args.merge)
            shards, verified = convert.to_hf(args.megatron, args.hf, args.out, layout, export, dtype=args.dtype,
                                             prompts=prompts if checked else None, tolerance=args.tolerance)
            print(json.dumps({"shards": convert.report_dict(shards)}))
        else:
            verified = convert.verify(args.megatron, args.hf, layout, dtype=args.dtype, prompts=prompts,
                                      tolerance=args.tolerance)
    except convert.ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not checked:
        return 0
    print(json.dumps({"verify": convert.report_dict(verified)}))
    if not verified.passed:
        print(f"error: logits differ by {verified.max_abs_diff:.3g} > tolerance {verified.tolerance:g}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
