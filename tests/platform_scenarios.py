"""Small megatron runs on CPU, one per failure the CPU work-arounds prevent.

usage: python tests/platform_scenarios.py SCENARIO HF_PATH OUT_DIR
With MEGARL_CPU_WORKAROUNDS_OFF naming one work-around, exits non-zero with megatron's error when that
work-around is needed by the scenario. A one-rank scenario runs in this process (what a trainer rank
does: ``init_rank``, then :func:`scenario`); several ranks run :func:`scenario` as Ray actors
(``run_ranks``). tests/test_platform_cpu.py runs the one-rank scenarios this way, in a fresh interpreter,
and the others' ranks on its own Ray, with the work-around turned off in their environment.
"""
import sys

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks

LAYOUTS = {
    "train": Layout(),
    "train_tp2_sp": Layout(world_size=2, tp=2, sequence_parallel=True),
    "train_ep2": Layout(world_size=2, ep=2),
    "train_tp2_ep2": Layout(world_size=4, tp=2, ep=2, sequence_parallel=True),
    "save_hf": Layout(),
    "checkpoint": Layout(),
    "train_lora": Layout(),
}


def scenario(rank, layout, name, hf_path, out_dir):
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.models.bridge import ModelSettings, build_megatron_model, save_hf_checkpoint
    from megarl.models.lora import LoraConfig
    from megarl.trainer.model_setup import build_trainable
    from megarl.trainer.sft_step import supervised_step
    from megarl.trainer.token_batch import token_batch

    if name == "save_hf":
        save_hf_checkpoint(build_megatron_model(hf_path, layout, ModelSettings(transformer_impl="local")), out_dir)
        return "saved"
    lora = LoraConfig(True, 4, 8, 0.0, ("linear_qkv",), "adapter") if name == "train_lora" else None
    trainable = build_trainable(hf_path, layout, optimizer_settings(default_config(), lr=1e-3),
                                ModelSettings(transformer_impl="local", lora=lora))
    sequences = [[1, 5 + i, 7, 9, 11 + i, 2] for i in range(4)]
    batch = token_batch(sequences, [3] * 4)
    loss = supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, 64).loss
    if name == "checkpoint":
        from megarl.trainer.checkpoint import load_checkpoint, save_checkpoint

        save_checkpoint(out_dir, 1, trainable, {})
        load_checkpoint(out_dir, trainable)
    return loss


if __name__ == "__main__":
    name, hf_path, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    if name == "import_bridge":
        from megarl.platform import megatron_cpu

        megatron_cpu.apply()
        import megatron.bridge  # noqa: F401
        print("imported")
    elif LAYOUTS[name].world_size == 1:  # this process is the rank (as a TrainerRank), no Ray cluster to start
        import torch

        from megarl.log import setup_logging
        from megarl.parallel import free_port
        from megarl.trainer.distributed import init_rank

        setup_logging()
        torch.set_num_threads(1)
        init_rank(0, LAYOUTS[name], "127.0.0.1", free_port())
        print([scenario(0, LAYOUTS[name], name, hf_path, out_dir)])
        print("inductor imported:", "torch._inductor.compile_fx" in sys.modules)
        print("wandb imported:", "wandb" in sys.modules)
    else:
        print(run_ranks(scenario, LAYOUTS[name], name, hf_path, out_dir, timeout_s=300))
