"""The engine's compact per-token metadata: the same routes, masks and log-probs as SGLang's JSON fields, bit
for bit, in the smallest expert-id dtype; malformed answers get a clear error."""
import numpy as np
import orjson
import pybase64
import pytest
import torch

from megarl.engines.client import compact_metadata, json_metadata
from megarl.engines.types import EngineError, ServedModel
from megarl.trainer.rl_batch import build_rl_batch
from megarl.wire.metadata import (
    COMPACT,
    compact_arrays,
    expert_dtype,
    metadata_arrays,
    pack_answer,
    unpack_answer,
)

pytestmark = pytest.mark.unit

MODEL = ServedModel(vocab_size=1000, num_layers=94, topk=8, num_experts=128, context_length=512)


def engine_answer(prompt_len: int, response: int, top_k: int, support: bool, seed: int = 0) -> dict:
    """An SGLang ``/generate`` answer as JSON would carry it: random routes, masks of up to ``top_k`` kept ids
    (each holding its sampled token), float32 log-probs widened to JSON numbers."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, MODEL.vocab_size, response).tolist()
    routes = np.stack([rng.permutation(MODEL.num_experts)[:MODEL.topk]
                       for _ in range((prompt_len + response - 1) * MODEL.num_layers)]).astype(np.int32)
    rows = [sorted({token, *rng.integers(0, MODEL.vocab_size, rng.integers(0, top_k)).tolist()})
            for token in ids]
    floats = lambda n: rng.normal(-2, 1, n).astype(np.float32).tolist()  # noqa: E731
    meta = {"id": "r", "finish_reason": {"type": "length"}, "cached_tokens": 0,
            "weight_versions": [{"version": "3", "start": 0, "end": response}],
            "output_token_logprobs": [[v, t, None] for v, t in zip(floats(response), ids)],
            "routed_experts": pybase64.b64encode(routes.tobytes()).decode(),
            "output_token_sampling_mask": rows,
            "output_token_sampling_logprobs": [floats(len(r)) for r in rows] if support else floats(response)}
    return {"output_ids": ids, "meta_info": meta}


@pytest.mark.parametrize("support", [False, True])
def test_the_compact_answer_decodes_to_the_json_answers_values_bit_for_bit(support):
    prompt_len, answer = 5, engine_answer(5, 40, top_k=100, support=support)
    asked = (True, True, False, support)
    old = json_metadata(answer["meta_info"], answer["output_ids"], prompt_len, MODEL, asked)
    body = pack_answer(orjson.loads(orjson.dumps([answer])), expert_dtype(MODEL.num_experts))  # the engine's
    [out], section = unpack_answer(body)
    assert "routed_experts" not in out["meta_info"] and "output_token_sampling_mask" not in out["meta_info"]
    new = compact_metadata(out["meta_info"], section, answer["output_ids"], prompt_len, MODEL, asked)
    (old_logprobs, old_mask, old_routes), (new_logprobs, new_mask, new_routes) = old, new
    assert new_routes.dtype == np.uint8 and old_routes.dtype == np.int16 and new_routes.shape == (44, 94, 8)
    assert np.array_equal(new_routes, old_routes)
    assert new_logprobs.dtype == np.float32 and new_logprobs.tobytes() == old_logprobs.tobytes()
    assert new_mask.ids.tobytes() == old_mask.ids.tobytes() and new_mask.offsets.tobytes() == old_mask.offsets.tobytes()
    assert (new_mask.logprobs is None) == (not support)
    if support:
        assert new_mask.logprobs.tobytes() == old_mask.logprobs.tobytes()
    wire = len(body) / len(orjson.dumps([answer]))
    assert wire < 0.3, f"the binary answer is {wire:.2f} of the JSON one"
    assert unpack_answer(orjson.dumps([answer]))[1] is None  # a JSON answer reads as one


def test_batches_of_compact_and_json_samples_hold_the_same_routes():
    from megarl.sample import FinishReason, RolloutSample

    def sample(routes):
        return RolloutSample(prompt_ids=[1, 2], response_ids=[3], loss_mask=np.ones(1, np.uint8),
                             rollout_logprobs=np.zeros(1, np.float32), model_version=np.zeros(1, np.int32),
                             routed_experts=routes, sampling_mask=None, finish_reason=FinishReason.STOP, advantage=0.0)

    routes = np.random.default_rng(0).integers(0, 128, (2, 94, 8))
    compact = build_rl_batch([sample(routes.astype(np.uint8))] * 2).routed_experts
    wide = build_rl_batch([sample(routes.astype(np.int16))] * 2).routed_experts
    mixed = build_rl_batch([sample(routes.astype(np.uint8)), sample(routes.astype(np.int16))]).routed_experts
    assert compact.dtype == torch.uint8 and wide.dtype == torch.int16 == mixed.dtype
    assert torch.equal(compact.long(), wide.long()) and torch.equal(mixed.long(), wide.long())


def test_expert_ids_take_the_smallest_dtype_that_holds_them():
    assert [expert_dtype(n).name for n in (8, 256, 257, 32768, 32769)] == \
        ["uint8", "uint8", "int16", "int16", "int32"]


def test_malformed_compact_answers_are_refused_with_their_reason():
    answer = engine_answer(3, 6, top_k=4, support=True)
    meta = answer["meta_info"]
    too_big = pybase64.b64encode(np.array([300], np.int32).tobytes()).decode()
    with pytest.raises(ValueError, match="do not fit uint8"):
        metadata_arrays(dict(meta, routed_experts=too_big), answer["output_ids"], np.dtype("uint8"))
    with pytest.raises(ValueError, match="disagree with output_ids"):
        metadata_arrays(dict(meta), answer["output_ids"][::-1], np.dtype("uint8"))
    [out], section = unpack_answer(pack_answer([answer], np.dtype("uint8")))
    meta, asked = out["meta_info"], (True, True, False, True)
    with pytest.raises(EngineError, match="malformed"):
        compact_metadata({COMPACT: {**meta[COMPACT], "mask_ids": ["<i4", 0, 10**6]}}, section, answer["output_ids"], 3,
                         MODEL, asked)
    with pytest.raises(EngineError, match="expected uint8"):
        compact_metadata({COMPACT: {**meta[COMPACT], "routed_experts": ["<i2", 0, 8]}}, section, answer["output_ids"],
                         3, MODEL, asked)
    with pytest.raises(EngineError, match="routed_experts holds"):
        compact_metadata(meta, section, answer["output_ids"], 4, MODEL, asked)
    with pytest.raises(EngineError, match="not in its recorded sampling support"):
        compact_metadata(meta, section, [MODEL.vocab_size - 1 - t for t in answer["output_ids"]], 3, MODEL, asked)
    assert not compact_arrays(meta[COMPACT], section)["mask_ids"].flags.writeable  # views of the answer's bytes
