"""Checkpoint conversion (tools/convert_checkpoint.py, megarl/trainer/convert.py).

HF -> torch_dist under TP2 x EP2 (2 processes) -> HF in one process is bit-exact and written in
size-bounded shards; --verify matches HF transformers' logits and fails on a checkpoint whose
experts are swapped; bad inputs fail with one line naming them.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.parallel import Layout
from megarl.trainer import convert

ROOT = Path(__file__).resolve().parents[1]
SHARD = 300_000  # bytes; the tiny model's 1.9 MB go into several files


def cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)


def printed(result: subprocess.CompletedProcess, key: str) -> dict:
    return next(json.loads(line)[key] for line in result.stdout.splitlines() if line.startswith(f'{{"{key}"'))


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def swapped_experts(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with experts 0 and 5 of layer 1 swapped (an expert-order conversion bug)."""
    out = tmp_path_factory.mktemp("swapped") / "hf"
    shutil.copytree(tiny_checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.1.mlp.experts.{e}.{proj}.weight" for e in (0, 5))
        tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def megatron_checkpoint(tiny_checkpoint, tmp_path_factory):
    """(torch_dist directory written under TP2 x EP2 with ETP1 on 2 ranks, its --verify report)."""
    out = tmp_path_factory.mktemp("megatron") / "tp2_ep2"
    result = cli("to-megatron", "--hf", tiny_checkpoint, "--out", out, "--tp", 2, "--ep", 2, "--etp", 1, "--verify")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, printed(result, "verify")


def test_to_megatron_tp2_ep2_matches_hf_logits(megatron_checkpoint):
    out, report = megatron_checkpoint
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert report["passed"] and report["max_abs_diff"] < 1e-5 and report["top1_agreement"] == 1.0
    assert len(report["per_prompt"]) == len(convert.DEFAULT_PROMPTS)


def test_back_to_hf_in_one_process_is_bit_exact_in_bounded_shards(megatron_checkpoint, tiny_checkpoint,
                                                                   swapped_experts, tmp_path):
    # The reference HF directory is the swapped copy: the output can only equal the original if
    # every weight came from the torch_dist checkpoint (resharded from TP2 x EP2 to one rank).
    out = tmp_path / "hf"
    result = cli("to-hf", "--megatron", megatron_checkpoint[0], "--hf", swapped_experts, "--out", out,
                 "--max-shard-size", f"{SHARD}B", "--verify")
    assert result.returncode == 0, result.stderr[-4000:]
    original, written = load_file(Path(tiny_checkpoint) / "model.safetensors"), hf_tensors(out)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
    assert printed(result, "verify")["max_abs_diff"] < 1e-5  # transformers loads the sharded output

    shards = printed(result, "shards")
    total = sum(t.numel() * t.element_size() for t in original.values())
    assert shards["total_bytes"] == total and shards["tensors"] == len(original)
    assert len(shards["files"]) >= total // SHARD  # streamed: never more than one file's tensors held
    assert shards["peak_buffered_bytes"] <= SHARD < total
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and set(index["weight_map"].values()) == set(shards["files"])
    assert all(sum(t.numel() * t.element_size() for t in load_file(out / f).values()) <= SHARD for f in shards["files"])
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_verify_fails_on_swapped_experts(megatron_checkpoint, swapped_experts):
    result = cli("verify", "--megatron", megatron_checkpoint[0], "--hf", swapped_experts)
    assert result.returncode == 1, result.stderr[-4000:]
    report = printed(result, "verify")
    assert not report["passed"] and report["max_abs_diff"] > 100 * report["tolerance"]
    assert "logits differ by" in result.stderr.strip().splitlines()[-1]


def test_experts_not_divisible_by_ep_fail_before_any_rank_starts(tiny_checkpoint, tmp_path):
    result = cli("to-megatron", "--hf", tiny_checkpoint, "--out", tmp_path / "out", "--ep", 3)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: layout world_size=3 tp=1 pp=1 vpp=None ep=3 etp=1 does not fit the model: "
        "8 experts are not divisible by ep=3")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, vocab_size=384)
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(tmp_path / "mixtral")
    with pytest.raises(convert.ConversionError, match="no bridge for architecture MixtralForCausalLM") as error:
        convert.to_megatron(tmp_path / "mixtral", tmp_path / "out", Layout())
    assert "\n" not in str(error.value)


def test_checkpoint_of_another_model(megatron_checkpoint, tmp_path):
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

    three_layers = make_tiny_moe(tmp_path / "three_layers", TinyMoeSpec(num_layers=3))
    with pytest.raises(convert.ConversionError, match="num_layers: checkpoint 2 vs HF 3") as error:
        convert.verify(megatron_checkpoint[0], three_layers, Layout())
    assert "\n" not in str(error.value)
