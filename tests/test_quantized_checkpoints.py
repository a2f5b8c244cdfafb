"""Quantized checkpoints (a ``quantization_config`` in config.json: FP8 weights with their scales, as the
official DeepSeek-V3 and the Qwen3 ``-FP8`` releases ship) are refused wherever megarl would load one:
the run's policy, teacher, judge, critic and frozen roles (exit 2 with one line naming the key), and the
checkpoint-conversion tool's ``--hf``. megarl has no FP8 path: a weight sync would cast bf16 tensors into
the engine's FP8 parameters beside their stale scales.
"""
import json
import shutil
import time
from pathlib import Path

import pytest

from megarl.models.hf_config import HfConfig, read_hf_config

ROOT = Path(__file__).resolve().parents[1]
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with a Qwen3-FP8-style ``quantization_config`` in its config.json."""
    out = tmp_path_factory.mktemp("fp8") / "tiny_fp8"
    shutil.copytree(tiny_checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}))
    return out


@pytest.mark.unit
def test_hf_config_reads_the_quantization_method(fp8_checkpoint, tiny_checkpoint):
    assert read_hf_config(fp8_checkpoint).quantization == "fp8"
    assert read_hf_config(tiny_checkpoint).quantization is None
    vl = HfConfig.from_dict({"text_config": {"num_hidden_layers": 2, "quantization_config": {"bits": 4}}})
    assert vl.quantization == "unknown"  # a quantization_config that names no method is still one


@pytest.mark.unit
@pytest.mark.parametrize("key, extra", [
    ("model.hf_path", []),
    ("model.hf_path", ["mode=warmup"]),  # the warm-up trains from it too
    ("teacher.hf_path", ["algorithm.advantage=opd", "algorithm.opd_coef=1.0"]),
    ("reward.judge.hf_path", []),
    ("critic.hf_path", ["critic.enabled=true", "algorithm.advantage=gae"]),
    ("task.role_engines[0].hf_path", ["task.agent=agent_examples:solver_and_verifier", "task.roles=[solver,verifier]",
                                      "warmup.steps=0"]),
], ids=["policy", "policy-warmup", "teacher", "judge", "critic", "frozen-role"])
def test_a_run_refuses_a_quantized_checkpoint_with_one_line_naming_the_key(key, extra, fp8_checkpoint,
                                                                            tiny_checkpoint, tmp_path, capsys):
    from megarl.train import main

    policy = fp8_checkpoint if key == "model.hf_path" else tiny_checkpoint
    setting = (f"task.role_engines=[{{role:verifier,hf_path:'{fp8_checkpoint}'}}]" if key.startswith("task.")
               else f"{key}={fp8_checkpoint}")
    args = ["recipe=tiny_moe_cpu", f"model.hf_path={policy}", f"warmup.save_hf_path={tmp_path / 'sft'}",
            f"logging.run_dir={tmp_path / 'run'}", *extra, setting]
    t0 = time.perf_counter()
    assert main(args) == 2
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"megarl: config error: {key}: {fp8_checkpoint}/config.json has a quantization_config "
                          "(fp8 weights with scales)"), err
    assert elapsed < 10, elapsed
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.unit
def test_the_conversion_tool_refuses_a_quantized_hf_checkpoint(fp8_checkpoint, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for args in (["to-megatron", "--hf", fp8_checkpoint, "--out", tmp_path / "out"],
                 ["verify", "--hf", fp8_checkpoint, "--megatron", tmp_path / "ckpt"],
                 ["to-hf", "--hf", fp8_checkpoint, "--megatron", tmp_path / "ckpt", "--out", tmp_path / "hf"]):
        assert tool.main(list(map(str, args))) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(
            f"error: --hf: {fp8_checkpoint}/config.json has a quantization_config (fp8 weights with scales)"), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()
