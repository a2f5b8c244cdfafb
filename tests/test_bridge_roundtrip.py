"""HF -> megatron-bridge -> Megatron -> HF: bit-exact weights, and logits equal to an HF forward."""
import pytest
import torch
from safetensors.torch import load_file

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


def roundtrip(rank, layout, hf_path, out_dir):
    """(export equal to the checkpoint, max |Megatron - HF| logits, saved file equal) on this rank."""
    from transformers import AutoModelForCausalLM

    from megarl.models.bridge import build_megatron_model, export_hf_state, save_hf_checkpoint

    model = build_megatron_model(hf_path, layout, transformer_impl="local")
    original = load_file(f"{hf_path}/model.safetensors")
    exported = export_hf_state(model)
    exact = set(exported) == set(original) and all(torch.equal(original[k], exported[k]) for k in original)

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
