"""LoRA trainers and the PEFT oracle shared by the LoRA tests: a TrainerGroup with adapters after a
few RL steps, and a PEFT directory merged by hand into the base checkpoint (W + alpha / r * B @ A)."""
import asyncio
import json
from pathlib import Path

from hf_oracle import load_hf, make_samples

from megarl.config import default_config
from megarl.config.components import optimizer_settings
from megarl.models.lora import LoraConfig
from megarl.parallel import Layout
from megarl.trainer.micro_batching import MicroBatching

ATTENTION = LoraConfig(enabled=True, rank=8, alpha=16, dropout=0.0, target_modules=("linear_qkv", "linear_proj"),
                       sync="adapter")


def trained_group(layout: Layout, checkpoint: str, lora: LoraConfig = ATTENTION, steps: int = 2,
                  reference: bool = False):
    """A LoRA TrainerGroup under ``layout`` after ``steps`` RL steps at lr 2e-2 (the adapters move
    visibly); ``reference``: with the KL reference (the starting weights)."""
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.actor import TrainerGroup
    from megarl.trainer.model_setup import ModelSettings
    from megarl.trainer.rl_batch import build_rl_batch

    group = TrainerGroup(layout)
    model = ModelSettings("local", "alltoall", routing_replay=False, recompute="none", recompute_num_layers=None,
                          moe_aux_loss_coeff=0.0, reference=reference, lora=lora)
    asyncio.run(group.build(checkpoint, optimizer_settings(default_config(), lr=2e-2), model))
    hf = load_hf(checkpoint)
    for step in range(steps):
        batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=step))
        batching = MicroBatching(max_tokens=32, vocab_size=hf.config.vocab_size, keep_routing=False,
                                 sequence_parallel=layout.sequence_parallel)
        asyncio.run(group.rl_step(batch, AlgorithmConfig(), batching))
    return group


def read_adapter(path: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(path / "adapter_model.safetensors")


def merged_by_hand(checkpoint: str, adapter_dir: Path) -> dict:
    """The base checkpoint's tensors with each PEFT pair merged: W + alpha / r * B @ A."""
    from safetensors.torch import load_file

    config, tensors = read_adapter(adapter_dir)
    weights = load_file(Path(checkpoint) / "model.safetensors")
    scale = config["lora_alpha"] / config["r"]
    for name in [n for n in tensors if ".lora_A." in n]:
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + scale * tensors[name.replace("lora_A", "lora_B")] @ tensors[name]
    return weights

