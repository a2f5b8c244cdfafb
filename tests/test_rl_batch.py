"""Samples -> RL batch: positions, padding, CSR masks; bad samples get a clear error."""
import numpy as np
import pytest
import torch

from megarl.sample import FinishReason, RolloutSample, SamplingMask
from megarl.trainer.logprobs import vocab_parallel_logprobs
from megarl.trainer.rl_batch import build_rl_batch, check_routing

pytestmark = pytest.mark.unit


def sample(prompt, response, routed=True, mask_rows=None, advantage=1.0, L=2, k=2, versions=None):
    T = len(prompt) + len(response)
    return RolloutSample(
        prompt_ids=prompt, response_ids=response, loss_mask=np.ones(len(response), np.uint8),
        rollout_logprobs=np.full(len(response), -0.5, np.float32),
        model_version=np.zeros(len(response), np.int32) if versions is None else np.asarray(versions, np.int32),
        routed_experts=np.tile(np.array([[2, 3]], np.int16), (T - 1, L, 1)).reshape(T - 1, L, k) if routed else None,
        sampling_mask=None if mask_rows is None else SamplingMask.from_rows(mask_rows),
        finish_reason=FinishReason.STOP, advantage=advantage,
    )


def test_response_tokens_land_on_the_positions_that_predict_them():
    batch = build_rl_batch([sample([1, 5, 6], [7, 2], mask_rows=[[7, 9], [2]]), sample([1, 4], [8])])
    assert batch.cu_seqlens.tolist() == [0, 4, 6] and batch.lengths.tolist() == [4, 2]
    assert batch.tokens.tolist() == [1, 5, 6, 7, 1, 4]
    assert batch.targets.tolist() == [5, 6, 7, 2, 4, 8]
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert batch.rollout_logprobs.tolist() == [0, 0, -0.5, -0.5, 0, -0.5]
    assert batch.staleness.dtype == torch.int32 and batch.staleness.tolist() == [0] * 6  # no trainer version: fresh
    assert batch.routed_experts.dtype == torch.int16 and batch.routed_experts[5, 0].tolist() == [2, 3]
    # CSR over the 6 positions: rows 2 and 3 of sample 0 hold its mask; all others are empty (full vocab)
    offsets = batch.sampling_mask.offsets.tolist()
    assert [batch.sampling_mask.ids[offsets[i]:offsets[i + 1]].tolist() for i in range(6)] == \
        [[], [], [7, 9], [2], [], []]
    second = batch.select([1])
    assert second.tokens.tolist() == [1, 4] and second.sampling_mask.offsets.tolist() == [0, 0, 0]
    swapped = batch.select([1, 0])
    assert swapped.cu_seqlens.tolist() == [0, 2, 6] and swapped.advantages.tolist() == [1.0, 1.0]
    offsets = swapped.sampling_mask.offsets.tolist()
    assert [swapped.sampling_mask.ids[offsets[i]:offsets[i + 1]].tolist() for i in range(6)] == \
        [[], [], [], [], [7, 9], [2]]


def test_staleness_per_token_from_the_version_that_generated_it():
    # sample 0 is a partial rollout: its first response token from version 3, the next two from 4
    samples = [sample([1, 5, 6], [7, 2, 3], versions=[3, 4, 4]), sample([1, 4], [8], versions=[5])]
    batch = build_rl_batch(samples, trainer_version=5)
    assert batch.staleness.dtype == torch.int32
    assert batch.staleness.tolist() == [0, 0, 2, 1, 1, 0, 0]
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1]  # prompt positions stay 0 in both
    swapped = batch.select([1, 0])
    assert swapped.staleness.dtype == torch.int32 and swapped.staleness.tolist() == [0, 0, 0, 0, 2, 1, 1]
    assert swapped.select([1, 0]).staleness.tolist() == batch.staleness.tolist()
    assert build_rl_batch(samples).staleness.tolist() == [0] * 7
    with pytest.raises(ValueError, match="version 5, newer than the trainer's 4"):
        build_rl_batch(samples, trainer_version=4)


def test_masked_logprob_of_a_batch_equals_log_softmax_over_the_kept_ids():
    batch = build_rl_batch([sample([1, 5, 6], [7, 2], mask_rows=[[7, 9], [2]])])
    logits = torch.randn(4, 12, dtype=torch.float64)
    out = vocab_parallel_logprobs(logits, 0, batch.targets, batch.sampling_mask)
    assert out.logprobs[2].item() == pytest.approx(torch.log_softmax(logits[2, [7, 9]], -1)[0].item())
    assert out.logprobs[3].item() == pytest.approx(0.0)  # a mask that keeps only the sampled token
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[5].item())  # no mask
    assert out.outside_mask.item() == 0


def test_sampled_token_outside_its_mask_is_kept_and_counted():
    batch = build_rl_batch([sample([1, 5], [7, 2], mask_rows=[[8, 9], [2, 3]])])  # 7 not among [8, 9]
    logits = torch.randn(3, 12, dtype=torch.float64)
    out = vocab_parallel_logprobs(logits, 0, batch.targets, batch.sampling_mask)
    assert out.outside_mask.item() == 1
    assert out.logprobs[1].item() == pytest.approx(torch.log_softmax(logits[1, [7, 8, 9]], -1)[0].item())
    assert out.logprobs[2].item() == pytest.approx(torch.log_softmax(logits[2, [2, 3]], -1)[0].item())
    assert batch.loss_mask.tolist() == [0, 1, 1]


def test_bad_samples_are_rejected():
    with pytest.raises(ValueError, match="has no advantage"):
        build_rl_batch([sample([1, 5], [7], advantage=None)])
    with pytest.raises(ValueError, match="loss_mask must be uint8"):  # lengths that disagree
        RolloutSample(prompt_ids=[1], response_ids=[2, 3], loss_mask=np.ones(1, np.uint8),
                      rollout_logprobs=np.zeros(2, np.float32), model_version=np.zeros(2, np.int32),
                      routed_experts=None, sampling_mask=None, finish_reason=FinishReason.STOP)


def test_bad_routing_is_rejected():
    routed = build_rl_batch([sample([1, 5], [7, 2])]).routed_experts
    check_routing(routed, num_layers=2, num_experts=8)
    with pytest.raises(ValueError, match="has 2 layers, the model has 3"):
        check_routing(routed, num_layers=3, num_experts=8)
    with pytest.raises(ValueError, match="expert id 3, outside 0..2"):
        check_routing(routed, num_layers=2, num_experts=3)
    repeated = routed.clone()
    repeated[0, 0] = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="repeats an expert"):
        check_routing(repeated, num_layers=2, num_experts=8)


def test_every_sample_of_a_mixed_batch_reads_back_as_built_on_its_own():
    """Random samples (lengths, masks, mixed-version flags, token advantages, int16/int32 routes, some
    without a mask or flags): each sample's slice of the batch holds its own tokens and fields at the
    positions that predict its response, and nothing else."""
    rng = np.random.default_rng(0)
    samples = []
    for b in range(40):
        P, R = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        samples.append(RolloutSample(
            prompt_ids=rng.integers(0, 384, P).tolist(), response_ids=rng.integers(0, 384, R).tolist(),
            loss_mask=(rng.random(R) < 0.8).astype(np.uint8), rollout_logprobs=-rng.random(R).astype(np.float32),
            model_version=rng.integers(3, 8, R).astype(np.int32),
            routed_experts=rng.integers(0, 8, (P + R - 1, 2, 2)).astype(np.int16 if b % 2 else np.int32),
            sampling_mask=SamplingMask.from_rows([sorted(rng.choice(384, 3, replace=False).tolist()) for _ in range(R)])
            if b % 3 else None, finish_reason=FinishReason.STOP, advantage=float(b),
            mixed_versions=rng.random(R) < 0.4 if b % 4 == 1 else None,
            token_advantages=rng.random(R).astype(np.float32) if b % 5 == 2 else None))
    batch = build_rl_batch(samples, trainer_version=8)
    offsets = batch.sampling_mask.offsets.tolist()
    for b, s in enumerate(samples):
        lo, hi = batch.cu_seqlens[b].item(), batch.cu_seqlens[b + 1].item()
        pad, seq = [0] * (len(s.prompt_ids) - 1), s.prompt_ids + s.response_ids
        mixed = s.mixed_versions if s.mixed_versions is not None else np.zeros(len(s.response_ids), bool)
        kept = [0.0 if m else float(x) for x, m in zip(s.loss_mask, mixed & (s.loss_mask != 0))]
        assert batch.tokens[lo:hi].tolist() == seq[:-1] and batch.targets[lo:hi].tolist() == seq[1:]
        assert batch.loss_mask[lo:hi].tolist() == pad + kept
        assert batch.mixed_versions[lo:hi].tolist() == [False] * len(pad) + (mixed & (s.loss_mask != 0)).tolist()
        assert batch.rollout_logprobs[lo:hi].tolist() == pad + s.rollout_logprobs.tolist()
        assert batch.staleness[lo:hi].tolist() == pad + (8 - s.model_version).tolist()
        extra = s.token_advantages.tolist() if s.token_advantages is not None else [0.0] * len(s.response_ids)
        assert batch.token_advantages[lo:hi].tolist() == pad + extra
        assert batch.routed_experts[lo:hi].tolist() == s.routed_experts.tolist()
        rows = [batch.sampling_mask.ids[offsets[i]:offsets[i + 1]].tolist() for i in range(lo, hi)]
        own = [s.sampling_mask.row(r).tolist() for r in range(len(s.response_ids))] if s.sampling_mask else \
            [[]] * len(s.response_ids)
        assert rows == [[]] * len(pad) + own
    assert batch.advantages.tolist() == [float(b) for b in range(40)]
    assert batch.routed_experts.dtype == torch.int16 and batch.sampling_mask.ids.dtype == torch.int32


def test_a_run_of_consecutive_samples_selects_as_one_cut_of_its_own():
    """Samples taken in the batch's order (one contiguous run of positions and mask entries) and out of it read
    back the same values, each selection a copy of its own."""
    rng = np.random.default_rng(1)
    samples = [RolloutSample(
        prompt_ids=rng.integers(0, 384, 3).tolist(), response_ids=rng.integers(0, 384, R).tolist(),
        loss_mask=np.ones(R, np.uint8), rollout_logprobs=-rng.random(R).astype(np.float32),
        model_version=np.zeros(R, np.int32), routed_experts=rng.integers(0, 8, (2 + R, 2, 2)).astype(np.uint8),
        sampling_mask=SamplingMask.from_rows([rng.choice(384, 1 + r % 3, replace=False).tolist() for r in range(R)]),
        finish_reason=FinishReason.STOP, advantage=0.0) for R in (2, 4, 3, 5)]
    batch = build_rl_batch(samples)
    run, apart = batch.select([1, 2, 3]), batch.select([3, 1, 2])
    lo = batch.cu_seqlens[1].item()
    assert torch.equal(run.routed_experts, batch.routed_experts[lo:])
    assert torch.equal(run.sampling_mask.ids, batch.sampling_mask.ids[batch.sampling_mask.offsets[lo]:])
    assert torch.equal(run.sampling_mask.offsets, batch.sampling_mask.offsets[lo:] - batch.sampling_mask.offsets[lo])
    for name in ("tokens", "rollout_logprobs", "routed_experts"):
        n = len(samples[3].prompt_ids) + len(samples[3].response_ids) - 1
        assert torch.equal(getattr(apart, name), torch.cat([getattr(run, name)[-n:], getattr(run, name)[:-n]]))
    run.routed_experts.fill_(7)
    assert not torch.equal(batch.routed_experts[lo:], run.routed_experts)  # a copy, not a view of the batch


def test_a_batch_pickled_as_ray_hands_it_over_reads_back_equal_with_its_bulk_columns_in_place():
    """Pickled with protocol 5 and its buffers out of band, read back over read-only copies of those buffers
    (as a rank reads a Ray object): every column equal; the routes and the sampling mask over the buffers
    themselves (no copy), the other columns writable tensors of their own; micro-batches select from it."""
    import pickle
    import warnings

    rng = np.random.default_rng(2)
    samples = [RolloutSample(
        prompt_ids=rng.integers(0, 384, 3).tolist(), response_ids=rng.integers(0, 384, R).tolist(),
        loss_mask=np.ones(R, np.uint8), rollout_logprobs=-rng.random(R).astype(np.float32),
        model_version=np.zeros(R, np.int32), routed_experts=rng.integers(0, 8, (2 + R, 2, 2)).astype(np.uint8),
        sampling_mask=SamplingMask.from_rows([rng.choice(384, 2, replace=False).tolist() for _ in range(R)],
                                             [(-rng.random(2)).astype(np.float32).tolist() for _ in range(R)]),
        finish_reason=FinishReason.STOP, advantage=1.0) for R in (2, 4, 3)]
    batch = build_rl_batch(samples)
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    stored = [bytes(b.raw()) for b in buffers]  # the object store's copy; read-only views of it below
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning about read-only arrays stays silent
        received = pickle.loads(data, buffers=[memoryview(b) for b in stored])
    for name in ("tokens", "targets", "loss_mask", "rollout_logprobs", "staleness", "cu_seqlens", "advantages",
                 "routed_experts", "group_ids"):
        assert torch.equal(getattr(received, name), getattr(batch, name)), name
    for name in ("ids", "offsets", "logprobs"):
        assert torch.equal(getattr(received.sampling_mask, name), getattr(batch.sampling_mask, name)), name

    def inside_a_buffer(tensor: torch.Tensor) -> bool:
        addresses = [np.frombuffer(b, np.uint8).ctypes.data for b in stored]
        return any(a <= tensor.data_ptr() < a + len(b) for a, b in zip(addresses, stored))

    assert inside_a_buffer(received.routed_experts)
    assert all(inside_a_buffer(t) for t in (received.sampling_mask.ids, received.sampling_mask.offsets,
                                            received.sampling_mask.logprobs))
    assert not inside_a_buffer(received.tokens) and not inside_a_buffer(received.loss_mask)
    received.loss_mask.fill_(0.5)  # writable: its own memory
    part = received.select([2, 0])
    assert torch.equal(part.routed_experts, torch.cat([batch.routed_experts[batch.cu_seqlens[2]:],
                                                       batch.routed_experts[:batch.cu_seqlens[1]]]))
    assert not inside_a_buffer(part.routed_experts)  # a micro-batch is a copy of its own
