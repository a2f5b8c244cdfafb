"""HF -> megatron-bridge -> Megatron -> HF: bit-exact weights, and logits equal to an HF forward."""
import pytest
import torch
from safetensors.torch import load_file

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


def roundtrip(rank, layout, hf_path, out_dir):
    """(export and the weight sync's stream equal to the checkpoint, max |Megatron - HF| logits, saved
    file equal) on this rank."""
    from megatron.bridge.models.conversion.peft_bridge import MegatronPeftBridge
    from transformers import AutoModelForCausalLM

    from megarl.models.bridge import ModelSettings, build_megatron_model, export_hf_state, save_hf_checkpoint
    from megarl.sync.gather import stage_hf_stream

    model = build_megatron_model(hf_path, layout, ModelSettings(transformer_impl="local"))
    original = load_file(f"{hf_path}/model.safetensors")
    exported = export_hf_state(model)

    def no_adapter_search(*args, **kwargs):
        raise AssertionError("the sync's stream searched a model without LoRA adapters for them")

    search = MegatronPeftBridge.build_adapter_conversion_tasks
    MegatronPeftBridge.build_adapter_conversion_tasks = no_adapter_search
    try:
        streamed = {name: tensor.clone() for name, tensor in stage_hf_stream(model)}
    finally:
        MegatronPeftBridge.build_adapter_conversion_tasks = search
    exact = all(set(state) == set(original) and all(torch.equal(original[k], state[k]) for k in original)
                for state in (exported, streamed))

    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(ids).logits
        logits = model.chunks[0](input_ids=ids, position_ids=torch.arange(12).expand(2, 12), attention_mask=None)
    logit_diff = float((logits[..., : reference.shape[-1]] - reference).abs().max())

    save_hf_checkpoint(model, out_dir)
    saved = load_file(f"{out_dir}/model.safetensors") if rank == 0 else original
    saved_exact = set(saved) == set(original) and all(torch.equal(original[k], saved[k]) for k in original)
    return exact, logit_diff, saved_exact


@pytest.mark.parametrize("layout", [Layout(), Layout(world_size=2, ep=2)], ids=["tp1", "ep2"])
def test_roundtrip_is_bit_exact_and_logits_match_hf(layout, tiny_checkpoint, tmp_path):
    for exact, logit_diff, saved_exact in run_ranks(roundtrip, layout, tiny_checkpoint, str(tmp_path / "hf")):
        assert exact
        assert saved_exact
        assert logit_diff < 1e-5
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
