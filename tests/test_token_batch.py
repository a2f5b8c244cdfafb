"""Supervised token batches: shifted labels, the loss on the answer, selection, bad input."""
import pytest

from megarl.trainer.packing import model_input, plan_micro_batches
from megarl.trainer.token_batch import token_batch

pytestmark = pytest.mark.unit


def test_batch_shifts_labels_and_masks_only_the_answer():
    batch = token_batch([[1, 5, 6, 7, 2], [1, 8, 2]], loss_starts=[3, 2])
    assert batch.tokens.tolist() == [1, 5, 6, 7, 1, 8]
    assert batch.labels.tolist() == [5, 6, 7, 2, 8, 2]
    # predictions of seq[3:] = [7, 2] and of seq[2:] = [2]
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert batch.cu_seqlens.tolist() == [0, 4, 6]
    assert batch.select([1, 0]).tokens.tolist() == [1, 8, 1, 5, 6, 7]


def test_padded_rows_round_up_for_sequence_parallel():
    batch = token_batch([[1, 2, 3, 4]], [1])
    plan = plan_micro_batches(batch.lengths, 1, 64, pack=False, length_multiple=4)
    assert model_input(batch.cu_seqlens, batch.tokens, 0, plan.length, plan.packed).tokens.shape == (1, 4)


def test_batch_rejects_a_loss_start_outside_the_sequence():
    with pytest.raises(ValueError, match="loss start 5"):
        token_batch([[1, 2, 3]], [5])
