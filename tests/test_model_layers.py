"""The trainer's layer choice and megatron settings on a CUDA platform, evaluated here and held against
the megatron-core and megatron-bridge sources each decision comes from."""
import sys
import types

import pytest
import torch

from megarl.models import packed_attention
from megarl.models.layers import APEX_WGRAD_MODULE, TE_MODULE, choose_layers, layer_settings
from megarl.platform import megatron_cpu
from megarl.platform.description import GPU_MODULES, Platform

pytestmark = pytest.mark.unit

megatron_cpu.apply()  # before megatron-bridge is imported, as every megarl process does

TE_NO_APEX = Platform.cuda(importable=tuple(m for m in GPU_MODULES if m != APEX_WGRAD_MODULE))
NO_TE = Platform.cuda(importable=("torch_memory_saver",))


def test_auto_is_transformer_engine_on_cuda_and_local_on_the_cpu():
    assert choose_layers("auto", Platform.cuda()) == "transformer_engine"
    assert choose_layers("auto", Platform.cpu()) == "local"
    assert choose_layers("local", Platform.cuda()) == "local"


def test_auto_on_cuda_without_transformer_engine_is_an_error_not_a_fall_back():
    broken = Platform("cuda", (9, 0), 8, frozenset(), {TE_MODULE: "RuntimeError: cuDNN not found"})
    with pytest.raises(ValueError, match=r"model.transformer_impl=auto: CUDA is available but .* cuDNN not found"):
        choose_layers("auto", broken)
    with pytest.raises(ValueError, match="model.transformer_impl=transformer_engine: .* no usable GPU"):
        choose_layers("transformer_engine", Platform.cpu())
    with pytest.raises(ValueError, match="one of auto, local, transformer_engine"):
        choose_layers("fast", Platform.cpu())


def test_bridge_turns_gradient_accumulation_fusion_on_whenever_te_imports(monkeypatch):
    """megatron-bridge's default (GPTModelProvider.gradient_accumulation_fusion) with a TE that imports."""
    from megatron.bridge.utils import fusions

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    assert fusions.can_enable_gradient_accumulation_fusion()


def test_the_output_layer_needs_apex_for_the_fusion_so_te_without_apex_turns_it_off():
    """megatron's ColumnParallelLinear (the GPT output layer, whatever the layer spec) refuses the fusion
    without APEX's kernel; with TE but without APEX megarl turns the fusion off, with both it leaves it on."""
    from megatron.core.tensor_parallel import layers as megatron_layers

    assert not megatron_layers._grad_accum_fusion_available  # no APEX here: the RuntimeError below is real
    config = types.SimpleNamespace(gradient_accumulation_fusion=True)
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda module is not found"):
        _column_parallel_linear(config)
    assert layer_settings("transformer_engine", TE_NO_APEX)["gradient_accumulation_fusion"] is False
    assert layer_settings("transformer_engine", Platform.cuda())["gradient_accumulation_fusion"] is True


def _column_parallel_linear(config):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    full = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False,
                               gradient_accumulation_fusion=config.gradient_accumulation_fusion)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
        mp.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
        mp.setattr(parallel_state, "get_tensor_model_parallel_group", lambda **kw: None)
        return ColumnParallelLinear(4, 4, config=full, init_method=torch.nn.init.zeros_, bias=False,
                                    tp_group=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))


def test_local_layers_on_cuda_initialise_on_the_gpu_with_every_fused_kernel_off():
    on_gpu, on_cpu = layer_settings("local", NO_TE), layer_settings("local", Platform.cpu())
    assert on_gpu["use_cpu_initialization"] is False and on_cpu["use_cpu_initialization"] is True
    fused = [k for k, v in on_gpu.items() if "fusion" in k or k in ("moe_grouped_gemm", "persist_layer_norm")]
    assert fused and not any(on_gpu[k] for k in fused)


def test_megatron_local_attention_refuses_packed_sequences_and_megarls_takes_them():
    """megatron's own DotProductAttention.forward asserts on THD input on every device; the one
    :func:`packed_attention.enable` installs answers it with per-sequence causal attention."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 4, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    attention = DotProductAttention.__new__(DotProductAttention)
    torch.nn.Module.__init__(attention)
    attention.softmax_scale, attention.attention_dropout = 0.5, torch.nn.Dropout(0.0)
    with pytest.raises(AssertionError, match="Packed sequence is not supported"):
        packed_attention.megatron_forward()(attention, q, k, v, None, packed_seq_params=thd)
    packed_attention.enable()
    out = DotProductAttention.forward(attention, q, k, v, None, packed_seq_params=thd)
    assert torch.equal(out, packed_attention.varlen_causal_attention(q, k, v, cu, 0.5))


def test_auto_layers_on_a_gpu_without_transformer_engine_exit_2_at_load(tmp_path, monkeypatch, capsys):
    import time

    from megarl.train import main

    monkeypatch.setattr("megarl.config.platform_rules.detect", lambda: NO_TE)
    t0 = time.monotonic()
    code = main(["recipe=tiny_moe_cpu", "model.transformer_impl=auto", "model.dtype=bfloat16",
                 f"model.hf_path={tmp_path / 'base'}", f"warmup.save_hf_path={tmp_path / 'sft'}",
                 f"logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - t0 < 10
    assert len(err.splitlines()) == 1 and err.startswith("megarl: config error: model.transformer_impl=auto: CUDA is "
                                                         "available but transformer_engine.pytorch"), err
