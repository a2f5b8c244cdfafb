"""The planner's per-token metadata: its byte counts are those of the real samples and batches, and on the large
recipes the driver's seconds a step on megarl's path are at most a tenth of SGLang's JSON answers' (at the rates
in megarl/planner/metadata_rates.json, which docs/status.md's command measures)."""
import numpy as np
import pytest
from test_compact_metadata import MODEL, engine_answer

from megarl.config import load_config
from megarl.engines.client import compact_metadata
from megarl.planner.layout import plan_layout
from megarl.planner.metadata import Width, bytes_per_sample
from megarl.sample import FinishReason, RolloutSample
from megarl.trainer.rl_batch import build_rl_batch
from megarl.wire.metadata import expert_dtype, pack_answer, unpack_answer

pytestmark = pytest.mark.unit


def test_the_planners_bytes_are_those_of_the_samples_and_the_batch():
    prompt, response, top_k = 7, 30, 12
    answer = engine_answer(prompt, response, top_k=top_k, support=False)
    rows = answer["meta_info"]["output_token_sampling_mask"]
    answer["meta_info"]["output_token_sampling_mask"] = [(r * top_k)[:top_k] for r in rows]  # every row top_k ids
    body = pack_answer([answer], expert_dtype(MODEL.num_experts))
    [out], section = unpack_answer(body)
    logprobs, mask, routes = compact_metadata(out["meta_info"], section, answer["output_ids"], prompt, MODEL,
                                              (True, True, False, False))
    sample = RolloutSample(prompt_ids=list(range(1, prompt + 1)), response_ids=answer["output_ids"],
                           loss_mask=np.ones(response, np.uint8), rollout_logprobs=logprobs,
                           model_version=np.zeros(response, np.int32), routed_experts=routes, sampling_mask=mask,
                           finish_reason=FinishReason.LENGTH, advantage=0.0)
    planned = bytes_per_sample("new", Width(MODEL.num_layers, MODEL.topk, MODEL.num_experts, MODEL.vocab_size),
                               prompt, response, top_k, True)
    held = (routes.nbytes + mask.ids.nbytes + mask.offsets.nbytes - 4 + logprobs.nbytes
            + sample.model_version.nbytes + sample.loss_mask.nbytes)  # offsets: one a token (the first is 0)
    assert planned["decode"] == held
    batch = build_rl_batch([sample])
    per_position = sum(t.nbytes for t in (batch.tokens, batch.targets, batch.loss_mask, batch.rollout_logprobs,
                                          batch.staleness, batch.sampling_mask.offsets[1:]))
    assert planned["batch"] == batch.routed_experts.nbytes + batch.sampling_mask.ids.nbytes + per_position + 36
    assert abs(planned["response"] - len(body)) / len(body) < 0.1


@pytest.mark.parametrize("recipe", ["qwen3_235b_a22b", "deepseek_v3_671b"])
def test_the_driver_spends_at_most_a_tenth_of_the_json_paths_seconds(recipe):
    metadata = plan_layout(load_config([f"recipe={recipe}"])).metadata
    assert metadata.new.bytes["batch"] < 0.55 * metadata.old.bytes["batch"]  # uint8 routes, int32 mask ids
    assert metadata.driver_ratio <= 0.1, f"{recipe}: {metadata.new.driver_seconds:.1f} s against " \
                                         f"{metadata.old.driver_seconds:.1f} s of the driver a step"
