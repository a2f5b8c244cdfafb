"""Padding, data-parallel slices and token-budget micro-batches."""
import pytest
import torch

from megarl.trainer.token_batch import data_parallel_slice, micro_batches, pack_sequences


def test_pack_shifts_labels_and_masks_only_the_answer():
    batch = pack_sequences([[1, 5, 6, 7, 2], [1, 8, 2]], loss_starts=[3, 2], pad_id=0, length_multiple=2)
    assert batch.tokens.tolist() == [[1, 5, 6, 7], [1, 8, 0, 0]]
    assert batch.labels.tolist() == [[5, 6, 7, 2], [8, 2, 0, 0]]
    # predictions of seq[3:] = [7, 2] and of seq[2:] = [2]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_pack_rounds_length_up_for_sequence_parallel():
    assert pack_sequences([[1, 2, 3, 4]], [1], pad_id=0, length_multiple=4).tokens.shape == (1, 4)


def test_pack_rejects_a_loss_start_outside_the_sequence():
    with pytest.raises(ValueError, match="loss start 5"):
        pack_sequences([[1, 2, 3]], [5], pad_id=0)


def test_data_parallel_slices_cover_the_batch_once():
    batch = pack_sequences([[i, i + 1, i + 2] for i in range(6)], [1] * 6, pad_id=0)
    parts = [data_parallel_slice(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch.tokens)
    with pytest.raises(ValueError, match="does not split over 4"):
        data_parallel_slice(batch, 0, 4)


def test_micro_batches_are_equal_and_within_the_token_budget():
    batch = pack_sequences([[1, 2, 3, 4, 5]] * 6, [1] * 6, pad_id=0)  # S = 4
    mbs = micro_batches(batch, max_tokens=10)  # 2 rows fit; 6 rows -> 3 x 2
    assert [len(m) for m in mbs] == [2, 2, 2]
    assert [len(m) for m in micro_batches(batch, max_tokens=16)] == [3, 3]  # 4 fit, but equal sizes
    assert [len(m) for m in micro_batches(batch, max_tokens=1)] == [1] * 6
