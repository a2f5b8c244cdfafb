"""The demo's warm-up: Megatron training through the real driver lowers the answer loss, and the
HF checkpoint it saves is better at the task than the one it started from (checked in HF)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.metrics.sink import read_metrics
from megarl.tasks import arithmetic
from megarl.train import main
from megarl.trainer.packing import model_input
from megarl.trainer.warmup import answer_batch

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


def hf_answer_loss(path: str) -> float:
    """Token-mean cross-entropy of every problem's answer + eos under the HF model at ``path``."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = answer_batch(tokenizer, arithmetic.all_problems())
    rows = model_input(batch.cu_seqlens, batch.tokens, tokenizer.pad_token_id, int(batch.lengths.max()), packed=False)
    with torch.no_grad():
        logits = rows.gather(model(rows.tokens).logits.flatten(0, 1))  # right-padded rows, causal: padding is unseen
    per_token = torch.nn.functional.cross_entropy(logits, batch.labels, reduction="none")
    return float((per_token * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_warmup_lowers_the_loss_and_saves_a_better_checkpoint(tmp_path):
    base, warm, run = tmp_path / "base", tmp_path / "warm", tmp_path / "run"
    assert main(["recipe=tiny_moe_cpu", "mode=warmup", f"model.hf_path={base}", "model.make_tiny_if_missing=true",
                 f"warmup.save_hf_path={warm}",
                 f"logging.run_dir={run}", "warmup.steps=30"]) == 0
    losses = [row["warmup/loss"] for row in read_metrics(run)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]
    assert (run / "config.yaml").is_file()
    assert hf_answer_loss(str(warm)) < 0.6 * hf_answer_loss(str(base))
