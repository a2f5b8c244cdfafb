"""Checkpoint conversion (tools/convert_checkpoint.py, megarl/trainer/convert.py).

HF -> torch_dist under TP2 x EP2 (2 processes) -> HF in one process is bit-exact and written in
size-bounded shards; --verify matches HF transformers' logits and fails on a checkpoint whose
experts are swapped; bad inputs fail with one line naming them. A LoRA run's trainer checkpoint
(adapters only) converts to a PEFT directory equal to the one the trainer writes, and with --merge
to the base with the adapters merged, as computed by hand from that PEFT directory.
"""
import asyncio
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.models.lora import LoraConfig
from megarl.parallel import Layout
from megarl.trainer import convert

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

ROOT = Path(__file__).resolve().parents[1]
SHARD = 300_000  # bytes; the tiny model's 1.9 MB go into several files


def cli(*args) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py as a command (its own process and Ray)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)


def main(argv: list[str]) -> int:
    """tools/convert_checkpoint.py's main in this process (its ranks join the module's Ray cluster)."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def run_main(*args) -> subprocess.CompletedProcess:
    """:func:`main` with what it prints captured, as :func:`cli` returns it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(map(str, args)))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


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
def megatron_checkpoint(ray_local, tiny_checkpoint, tmp_path_factory):
    """(torch_dist directory written under TP2 x EP2 with ETP1 on 2 ranks, its --verify report)."""
    out = tmp_path_factory.mktemp("megatron") / "tp2_ep2"
    result = run_main("to-megatron", "--hf", tiny_checkpoint, "--out", out, "--tp", 2, "--ep", 2, "--etp", 1,
                      "--verify")
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
    result = run_main("to-hf", "--megatron", megatron_checkpoint[0], "--hf", swapped_experts, "--out", out,
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
    result = run_main("verify", "--megatron", megatron_checkpoint[0], "--hf", swapped_experts)
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


# ---------------------------------------------------------------- LoRA: a trainer checkpoint holding adapters only

@pytest.fixture(scope="module")
def lora_run(ray_local, tiny_checkpoint, tmp_path_factory) -> Path:
    """A LoRA run's directory: its trainer checkpoint (``checkpoints``, after an RL step at lr 2e-2 that
    moves rank-8 adapters on the attention projections), its ``config.yaml`` (the tiny LoRA recipe's, as
    megarl.train writes it) and, the reference, the PEFT directory the trainer itself wrote (``adapter``)."""
    from lora_runs import ATTENTION, trained_group
    from omegaconf import OmegaConf

    from megarl.config import load_config

    root = tmp_path_factory.mktemp("lora_run")
    group = trained_group(Layout(), tiny_checkpoint, ATTENTION, steps=1)
    try:
        asyncio.run(group.save_checkpoint(str(root / "checkpoints"), 1, {}))
        asyncio.run(group.save_hf_adapter(str(root / "adapter")))
    finally:
        group.shutdown()
    cfg = load_config(["recipe=tiny_moe_lora_cpu", f"model.hf_path={tiny_checkpoint}"])
    assert LoraConfig.when_enabled(cfg.lora) == ATTENTION
    (root / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return root


def test_lora_checkpoint_to_peft_equals_the_trainers_adapter(lora_run, tiny_checkpoint, tmp_path, capsys):
    from lora_runs import read_adapter

    out = tmp_path / "peft"
    assert main(["to-hf", "--megatron", str(lora_run / "checkpoints"), "--hf", tiny_checkpoint, "--out", str(out),
                 "--config", str(lora_run / "config.yaml")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config, written = read_adapter(out)
    reference_config, reference = read_adapter(lora_run / "adapter")
    assert config == reference_config and sorted(written) == sorted(reference)
    assert all(torch.equal(written[k], reference[k]) for k in reference)
    assert any(reference[k].abs().sum() > 0 for k in reference if ".lora_B." in k), "the adapters never moved"
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shards"]
    assert report["files"] == ["adapter_model.safetensors"] and report["tensors"] == len(reference)


def test_lora_checkpoint_merged_equals_base_plus_scaled_adapter(lora_run, tiny_checkpoint, tmp_path, capsys):
    from lora_runs import merged_by_hand
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["to-hf", "--megatron", str(lora_run / "checkpoints"), "--hf", tiny_checkpoint, "--out", str(out),
                 "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "linear_qkv,linear_proj",
                 "--merge", "--verify"]) == 0
    expected, base = merged_by_hand(tiny_checkpoint, lora_run / "adapter"), hf_tensors(Path(tiny_checkpoint))
    written = hf_tensors(out)
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(written[key], tensor, atol=1e-6, rtol=0, msg=key)
    assert not torch.equal(written["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"]), "nothing was merged"
    assert all(torch.equal(written[k], base[k]) for k in base if "self_attn" not in k or "norm" in k)
    verified = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verify"]
    assert verified["passed"] and verified["max_abs_diff"] < 1e-4  # transformers' logits = the Megatron model's
    _, loading = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading  # every tensor used, none missing


@pytest.mark.parametrize("settings, message", [
    ([], "holds LoRA adapters only (rank 8, alpha 16, ['linear_qkv', 'linear_proj']): give their settings, "
         "--config RUN_DIR/config.yaml or --lora-rank/--lora-alpha/--lora-targets, and as --hf the base model "
         "they were trained on"),
    (["--merge"], "holds LoRA adapters only (rank 8, alpha 16"),
    (["--lora-rank", "8"], "--lora-alpha, --lora-targets missing: the LoRA settings need all of --lora-rank, "
                           "--lora-alpha, --lora-targets"),
    (["--lora-rank", "8", "--lora-alpha", "32", "--lora-targets", "linear_qkv,linear_proj"],
     "holds adapters of rank 8, alpha 16, ['linear_qkv', 'linear_proj'], the LoRA settings given are rank 8, "
     "alpha 32, ['linear_qkv', 'linear_proj']"),
    (["--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "linear_q"], "not Megatron linear names"),
    (["--config", "RUN/config.yaml", "--verify"], "verify the adapters with --merge"),
])
def test_lora_checkpoint_with_missing_or_wrong_settings_fails_before_any_rank_starts(
        lora_run, tiny_checkpoint, tmp_path, capsys, settings, message):
    settings = [a.replace("RUN", str(lora_run)) for a in settings]
    out = tmp_path / "out"
    assert main(["to-hf", "--megatron", str(lora_run / "checkpoints"), "--hf", tiny_checkpoint, "--out", str(out),
                 *settings]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and message in line, line
    assert not out.exists()


def test_lora_options_on_a_full_checkpoint_and_verify_of_adapters_are_refused(megatron_checkpoint, lora_run,
                                                                               tiny_checkpoint, tmp_path):
    from lora_runs import ATTENTION

    with pytest.raises(convert.ConversionError, match="holds a full model, no LoRA adapters to merge"):
        convert.to_hf(megatron_checkpoint[0], tiny_checkpoint, tmp_path / "out", Layout(), convert.HfExport(merge=True))
    with pytest.raises(convert.ConversionError, match="holds a full model, not LoRA adapters: drop the LoRA settings"):
        convert.to_hf(megatron_checkpoint[0], tiny_checkpoint, tmp_path / "out", Layout(),
                      convert.HfExport(lora=ATTENTION))
    with pytest.raises(convert.ConversionError, match="holds LoRA adapters only: verify them with to-hf --merge"):
        convert.verify(lora_run / "checkpoints", tiny_checkpoint, Layout())
