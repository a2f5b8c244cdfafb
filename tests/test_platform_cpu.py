"""Each CPU work-around is needed: turned off alone, its scenario fails with the error it names."""
import os
import subprocess
import sys
from pathlib import Path

import fresh_python
import pytest
from platform_scenarios import LAYOUTS, scenario

from megarl.platform import megatron_cpu
from megarl.trainer.launch import RankFailed, run_ranks

SCENARIOS = Path(__file__).with_name("platform_scenarios.py")

# work-around -> the smallest scenario that needs it
NEEDED_BY = {
    "bridge_imports_transformer_engine": "import_bridge",
    "bridge_save_imports_modelopt": "save_hf",
    "lora_takes_mocked_te_for_present": "train_lora",
    "cuda_rng_tracker_needs_cuda": "train",
    "cuda_streams_and_current_device": "train",
    "hardcoded_cuda_devices": "train",
    megatron_cpu.OPTIMIZER_TYPE_SCOPE: "train",
    "torch_norm_rejects_sequence_parallel": "train_tp2_sp",
    "gloo_all_to_all_needs_int_splits": "train_ep2",
    "gloo_uneven_all_gather": "train_tp2_ep2",
    "torch_adam_step_breaks_optimizer_load": "checkpoint",
}
PREVENTS = {w.name: w.prevents for w in megatron_cpu.WORKAROUNDS}
PREVENTS[megatron_cpu.OPTIMIZER_TYPE_SCOPE] = "Wrapped parameters must be one of torch.cuda.FloatTensor"


def run_scenario(name, hf_path, out_dir, off="") -> subprocess.CompletedProcess:
    """Scenario ``name`` with the work-around ``off`` turned off. One rank: tests/platform_scenarios.py in
    a fresh interpreter (:mod:`fresh_python`); several: their ranks on the test process's Ray, in rank
    processes of their own started with that environment (a failed rank's traceback in ``stderr``)."""
    env = {megatron_cpu.OFF_ENV: off, "MEGARL_LOG_LEVEL": "WARNING"}
    layout = LAYOUTS.get(name)
    if layout is None or layout.world_size == 1:
        return fresh_python.run([sys.executable, str(SCENARIOS), name, hf_path, str(out_dir)],
                                env=dict(os.environ, **env), timeout=400)
    try:
        losses = run_ranks(scenario, layout, name, hf_path, str(out_dir), env=env, timeout_s=300)
    except RankFailed as e:
        return subprocess.CompletedProcess(name, 1, "", str(e))
    return subprocess.CompletedProcess(name, 0, repr(losses), "")


@pytest.mark.unit
def test_every_workaround_has_a_scenario():
    assert set(NEEDED_BY) == set(PREVENTS)


@pytest.mark.parametrize("workaround", sorted(NEEDED_BY))
def test_scenario_fails_without_workaround(workaround, tiny_checkpoint, tmp_path, ray_local):
    result = run_scenario(NEEDED_BY[workaround], tiny_checkpoint, tmp_path, off=workaround)
    assert result.returncode != 0, f"{workaround} off, yet {NEEDED_BY[workaround]} passed:\n{result.stdout}"
    assert PREVENTS[workaround] in result.stderr + result.stdout, result.stderr[-3000:]


@pytest.mark.processes
def test_the_speedups_keep_the_loss_and_keep_inductor_and_wandb_out(tiny_checkpoint, tmp_path):
    """The speed-ups ``torch_compile_imports_inductor`` and ``megatron_timers_import_wandb``: the same training
    step, bit for bit, without TorchInductor or wandb imported; with each off, megatron's import brings its
    package in."""
    runs = {off: run_scenario("train", tiny_checkpoint, tmp_path / (off or "on"), off=off)
            for off in ("", "torch_compile_imports_inductor", "megatron_timers_import_wandb")}
    for result in runs.values():
        assert result.returncode == 0, result.stderr[-3000:]
    loss, inductor, wandb = zip(*(result.stdout.splitlines()[-3:] for result in runs.values()))
    assert loss[0] == loss[1] == loss[2]
    assert inductor == ("inductor imported: False", "inductor imported: True", "inductor imported: False")
    assert wandb == ("wandb imported: False", "wandb imported: False", "wandb imported: True")


@pytest.mark.unit
def test_unknown_workaround_name_is_rejected(monkeypatch):
    monkeypatch.setenv(megatron_cpu.OFF_ENV, "no_such_workaround")
    monkeypatch.setattr(megatron_cpu, "_applied", [])
    with pytest.raises(ValueError, match="no_such_workaround"):
        megatron_cpu.apply()


@pytest.mark.processes
def test_only_missing_packages_are_worked_around_when_cuda_is_available():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "current_device, tensor_type = torch.cuda.current_device, torch.Tensor.type\n"
        "from megarl.platform import megatron_cpu\n"
        "assert megatron_cpu.apply() == list(megatron_cpu.FOR_MISSING_PACKAGE), megatron_cpu.apply()\n"
        "with megatron_cpu.cuda_tensor_type_scope():\n"
        "    assert torch.Tensor.type is tensor_type\n"
        "assert torch.cuda.current_device is current_device\n"
        "import sys\n"
        "patched = {f.module for f in sys.meta_path if type(f).__module__ == megatron_cpu.__name__}\n"
        "assert patched == {'megatron.bridge.peft.lora_layers', 'megatron.bridge.peft.utils',\n"
        "                   'megatron.bridge.models.conversion.auto_bridge'}, patched\n"
        "print('untouched')\n"
    )
    result = fresh_python.run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0 and "untouched" in result.stdout, result.stderr[-2000:]
