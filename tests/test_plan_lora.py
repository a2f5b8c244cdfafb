"""The planner's LoRA numbers: adapter parameters against a real megatron-bridge LoRA model of the
tiny Qwen3-MoE (its trainable parameters, the PEFT tensors it exports), and the 30B-A3B LoRA
recipe's plan (adapter bytes per sync against the full model, the trainer's frozen base).

Run as a script (``python tests/test_plan_lora.py HF_PATH``) it builds the tiny model with each
of :data:`TARGETS`' adapters on one rank and prints their counts as JSON: the test runs it in a
process of its own, so megatron's global state does not outlive it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import fresh_python
import pytest

from megarl.config import ConfigError, load_config
from megarl.models.lora import ENGINE_ADAPTER_SLOTS
from megarl.plan import EXIT_DOES_NOT_FIT, main
from megarl.planner.arch import resolve_arch
from megarl.planner.layout import plan_layout
from megarl.planner.lora import lora_plan
from megarl.planner.trainer_memory import trainer_memory

# The tiny LoRA recipe's adapters, and every target the tiny model has (routed experts, router).
TARGETS = {
    "recipe": ["linear_qkv", "linear_proj"],
    "all": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router"],
}


def tiny_lora_config(ckpt: str, name: str):
    targets = f"lora.target_modules=[{','.join(TARGETS[name])}]"
    sync = [] if name == "recipe" else ["lora.sync=merged"]  # an adapter sync serves no router adapter
    return load_config(["recipe=tiny_moe_lora_cpu", f"model.hf_path={ckpt}", targets, *sync])


@pytest.fixture(scope="module")
def bridge_counts(tiny_checkpoint) -> dict:
    """What megatron-bridge builds and exports for each target set (run in a process of its own)."""
    done = fresh_python.run([sys.executable, __file__, tiny_checkpoint], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.processes
@pytest.mark.parametrize("name", list(TARGETS))
def test_tiny_adapter_count_equals_the_bridge_model(name, bridge_counts, tiny_checkpoint):
    """Trainable parameters of the bridge's LoRA model (per target and in all), and the PEFT tensors
    it exports (count and bytes), equal the planner's; the full model's bytes are the checkpoint's."""
    from safetensors import safe_open

    cfg = tiny_lora_config(tiny_checkpoint, name)
    plan = lora_plan(resolve_arch(cfg), cfg)
    real = bridge_counts[name]
    assert plan.trainer_params_by_target == real["trainable_by_target"]
    assert plan.trainer_params == real["trainable"]
    assert plan.adapted_linears == real["adapted_linears"]
    assert plan.synced_tensors == real["peft_tensors"]
    assert plan.synced_bytes == real["peft_bytes"]
    assert plan.largest_tensor_bytes == real["peft_largest_bytes"]
    with safe_open(str(Path(tiny_checkpoint) / "model.safetensors"), "pt") as f:
        checkpoint_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert plan.model_bytes == checkpoint_bytes
    print(f"\n[tiny {name}] {plan.trainer_params:,} trained, {plan.synced_bytes:,} bytes per sync "
          f"of {plan.model_bytes:,}: ratio {plan.ratio:.4f}")


@pytest.mark.unit
def test_tiny_lora_recipe_syncs_the_adapter_and_trains_it_alone(tiny_checkpoint):
    cfg = tiny_lora_config(tiny_checkpoint, "recipe")
    plan = plan_layout(cfg)
    assert plan.sync.payload == "adapter" and plan.sync.bytes_per_sync == plan.lora.synced_bytes == 7168 * 4
    assert plan.sync.buckets == 1
    stage = plan.trainer[0]
    full = trainer_memory(plan.arch, load_config(["recipe=tiny_moe_cpu", f"model.hf_path={tiny_checkpoint}"]))[0]
    assert stage.adapter_params == plan.lora.trainer_params == 5120  # one rank holds every adapter
    assert stage.params == full.params and stage.weights == 4 * (full.params + 5120)  # float32
    assert stage.grads == 4 * 5120 and stage.optimizer == 8 * 5120  # fp32 weights: two Adam moments, no master
    assert stage.activations == full.activations


@pytest.mark.unit
def test_30b_lora_recipe_plans_adapter_bytes_far_below_the_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["recipe=qwen3_30b_a3b_lora", "--json", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    lora, sync = written["lora"], written["sync"]
    assert "LoRA adapters: rank 32, alpha 64" in printed
    assert f"{lora['ratio']:.4f} (1/{1 / lora['ratio']:.0f})" in printed
    assert sync["payload"] == "adapter" and sync["bytes_per_sync"] == lora["synced_bytes"]
    assert lora["synced_bytes"] * 10 < lora["model_bytes"] and lora["ratio"] == pytest.approx(0.0553, abs=1e-4)

    # By hand: every layer's q/k/v and o adapters and one fc1 and fc2 adapter per routed expert.
    h, q, kv, f, experts, r = 2048, 32 * 128, 4 * 128, 768, 128, 32
    per_layer = r * (h + q + 2 * kv) + r * (q + h) + experts * (r * (h + 2 * f) + r * (f + h))
    peft_per_layer = per_layer + r * 2 * h + experts * r * h  # A repeated for q/k/v (x3) and gate/up (x2)
    assert lora["trainer_params"] == 48 * per_layer == 1_278_738_432
    assert lora["synced_params"] == 48 * peft_per_layer and lora["synced_bytes"] == 2 * lora["synced_params"]
    assert lora["model_bytes"] == 2 * written["params"]["total"]
    stage = written["trainer"][0]  # TP2, EP2: every adapter split in two
    assert stage["adapter_params"] == lora["trainer_params"] // 2 and stage["grads"] == 4 * stage["adapter_params"]
    assert stage["optimizer"] == 12 * stage["adapter_params"]  # bf16: fp32 master + two moments, DP 1
    assert written["engine"]["lora_slots"] == ENGINE_ADAPTER_SLOTS == 3 and written["engine"]["lora_buffers"] > 0


@pytest.mark.unit
def test_30b_lora_layout_does_not_fit_full_fine_tuning(capsys):
    """The recipe's 2 GPUs hold the frozen base and the adapters' state, not every weight's gradients."""
    assert main(["recipe=qwen3_30b_a3b_lora", "lora.enabled=false", "trainer.optimizer_cpu_offload=true"]) == \
        EXIT_DOES_NOT_FIT
    assert "trainer.gpu_memory_gb: a trainer GPU of pipeline stage 0 needs 100.2 GB" in capsys.readouterr().err


@pytest.mark.unit
def test_merged_sync_moves_the_model_and_serves_no_adapters():
    cfg = load_config(["recipe=qwen3_30b_a3b_lora", "lora.sync=merged"])
    plan = plan_layout(cfg)
    assert plan.sync.payload == "merged" and plan.sync.bytes_per_sync == plan.lora.model_bytes
    assert plan.engine.lora_buffers == 0 and plan.lora.synced_bytes < plan.lora.model_bytes


@pytest.mark.unit
def test_layer_patterns_target_the_layers_they_name():
    cfg = load_config(["recipe=qwen3_30b_a3b_lora", "lora.target_modules=[*.layers.0.*.linear_qkv]"])
    one = lora_plan(resolve_arch(cfg), cfg)
    assert one.adapted_linears == 1 and one.trainer_params == 32 * (2048 + 32 * 128 + 2 * 4 * 128)


@pytest.mark.unit
def test_targets_the_architecture_lacks_are_an_error_naming_the_key():
    """As the trainer refuses them (megarl.models.lora.apply_lora): Qwen3 has no latent attention."""
    cfg = load_config(["recipe=qwen3_30b_a3b_lora", "lora.target_modules=[linear_qkv,linear_kv_up_proj]"])
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['linear_kv_up_proj'\] match no linear"):
        plan_layout(cfg)


def _bridge_counts(hf_path: str) -> dict:
    """Build the tiny model with each target set's adapters (one rank, CPU) and count them."""
    import torch

    from megarl.models.bridge import ModelSettings, build_megatron_model, export_adapter_state
    from megarl.models.lora import LoraConfig
    from megarl.parallel import Layout, free_port
    from megarl.trainer.distributed import init_rank

    torch.set_num_threads(1)
    init_rank(0, Layout(), "127.0.0.1", free_port())
    out = {}
    for name, targets in TARGETS.items():
        lora = LoraConfig(True, 8, 16, 0.0, tuple(targets), "merged")
        model = build_megatron_model(hf_path, Layout(), ModelSettings(transformer_impl="local", lora=lora))
        trainable = {n: p.numel() for c in model.chunks for n, p in c.named_parameters() if p.requires_grad}
        by_target: dict[str, int] = {}
        for n, count in trainable.items():
            base = n.split(".adapter.")[0]
            by_target[base.rsplit(".", 1)[-1]] = by_target.get(base.rsplit(".", 1)[-1], 0) + count
        peft = export_adapter_state(model)
        out[name] = dict(trainable=sum(trainable.values()), trainable_by_target=by_target,
                         adapted_linears=len({n.split(".adapter.")[0] for n in trainable}),
                         peft_tensors=len(peft), peft_bytes=sum(t.numel() * t.element_size() for t in peft.values()),
                         peft_largest_bytes=max(t.numel() * t.element_size() for t in peft.values()))
    return out


if __name__ == "__main__":
    print(json.dumps(_bridge_counts(sys.argv[1])))
