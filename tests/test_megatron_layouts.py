"""The tiny MoE built through megatron-bridge trains identically under every parallel layout.

Two steps of forward + backward + DistributedOptimizer update on one fixed global batch: the loss
(before and after the first update) and the gradient norm of each layout equal the single-process
run within 1e-5.
"""
import pytest
import torch

from megarl.trainer.distributed import Layout
from megarl.trainer.launch import run_ranks

LAYOUTS = {
    "tp2_sp": Layout(world_size=2, tp=2, sequence_parallel=True),
    "ep2": Layout(world_size=2, ep=2),
    "pp2": Layout(world_size=2, pp=2),
    "dp2": Layout(world_size=2),
    "tp2_ep2": Layout(world_size=4, tp=2, ep=2, sequence_parallel=True),
}


def two_steps(rank, layout, hf_path):
    """[(loss, grad_norm)] of two steps; loss is None on ranks off the last pipeline stage."""
    from megatron.core import parallel_state

    from megarl.trainer.model_setup import build_trainable
    from megarl.trainer.optimizer import OptimizerSettings
    from megarl.trainer.step import supervised_step
    from megarl.trainer.token_batch import pack_sequences

    trainable = build_trainable(hf_path, layout, OptimizerSettings(lr=1e-3, adam_beta2=0.99), transformer_impl="local")
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 12, (8,), generator=gen).tolist()
    sequences = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    batch = pack_sequences(sequences, [2] * 8, pad_id=0, length_multiple=2)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    out = []
    for _ in range(2):  # 8 sequences x 12 tokens over a 40-token budget: several micro-batches
        result = supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, 40)
        out.append((result.loss if last else None, result.grad_norm))
    return out


@pytest.fixture(scope="module")
def single_process(tiny_checkpoint):
    return run_ranks(two_steps, Layout(), tiny_checkpoint)[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_equals_single_process(name, single_process, tiny_checkpoint):
    per_rank = run_ranks(two_steps, LAYOUTS[name], tiny_checkpoint)
    reported = [steps for steps in per_rank if steps[0][0] is not None]
    assert reported, "no rank reported a loss"
    for steps in per_rank:
        for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(steps, single_process):
            assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-5)
            if loss is not None:
                assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert single_process[1][0] < single_process[0][0]  # the update lowered the loss
