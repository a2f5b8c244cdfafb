"""Micro-batch planning (token-balanced DP, packed rows), model inputs and the CPU varlen attention."""
import math
import random

import pytest
import torch

from megarl.models.packed_attention import varlen_causal_attention
from megarl.trainer.packing import balanced_partition, model_input, plan_micro_batches, to_grid

pytestmark = pytest.mark.unit


def long_tailed_lengths(n: int = 512, longest: int = 1024, seed: int = 0) -> torch.Tensor:
    """Most sequences short (prompt + a short answer), a tenth at the maximum length."""
    rng = random.Random(seed)
    return torch.tensor([longest if rng.random() < 0.1 else rng.randint(16, 64) for _ in range(n)])


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_packed_plan_balances_tokens_and_covers_every_sample_once(dp):
    lengths = long_tailed_lengths()
    plan = plan_micro_batches(lengths, dp, 4096, pack=True, length_multiple=2)
    seen = sorted(i for rank in plan.per_rank for mb in rank for i in mb)
    assert seen == list(range(len(lengths)))
    assert len({len(rank) for rank in plan.per_rank}) == 1  # every rank runs as many micro-batches
    assert plan.length % 2 == 0
    assert all(sum(int(lengths[i]) for i in mb) <= plan.length for rank in plan.per_rank for mb in rank)
    assert plan.imbalance(lengths) <= 1.1, plan.rank_tokens(lengths)
    assert plan.padding_frac(lengths) < 0.1


def test_padded_plan_is_equal_contiguous_shares_of_padded_rows():
    lengths = long_tailed_lengths(64)
    plan = plan_micro_batches(lengths, 2, 4096, pack=False, length_multiple=4)
    assert plan.length == 1024 and plan.per_rank[0][0][0] == 0 and plan.per_rank[1][0][0] == 32
    assert all(len(mb) == 4 for rank in plan.per_rank for mb in rank)  # 4 rows x 1024 = the budget
    real = int(lengths.sum())
    assert plan.padding_frac(lengths) == pytest.approx(1 - real / (64 * 1024))
    with pytest.raises(ValueError, match="do not split over 3"):
        plan_micro_batches(lengths, 3, 4096, pack=False)


def test_balanced_partition_is_the_greedy_longest_first_rule():
    assert balanced_partition([5, 1, 4, 3, 3], 2) == [[0, 4], [1, 2, 3]]  # 5, 4, 3 -> the 4, 3 -> the 5, 1 -> the 7


def test_a_rank_with_fewer_samples_than_micro_batches_gets_padding_only_ones():
    plan = plan_micro_batches(torch.tensor([100, 100, 100, 10]), 2, 100, pack=True)
    assert [len(rank) for rank in plan.per_rank] == [2, 2]
    assert sorted(len(mb) for mb in plan.per_rank[1]) in ([1, 1], [1, 2])
    plan = plan_micro_batches(torch.tensor([1000, 10, 10, 10, 10]), 2, 20, pack=True)
    assert plan.per_rank[0] == [[0], []]  # the long one alone; the other rank needs two micro-batches
    assert [len(mb) for mb in plan.per_rank[1]] == [2, 2]  # 20 tokens each


def test_packed_input_has_one_row_restarting_positions_and_a_padding_segment():
    cu = torch.tensor([0, 3, 5])
    mi = model_input(cu, torch.tensor([11, 12, 13, 21, 22]), pad_id=0, length=8, packed=True)
    assert mi.tokens.tolist() == [[11, 12, 13, 21, 22, 0, 0, 0]]
    assert mi.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    params = mi.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 5, 8] and params.max_seqlen_q == 3
    assert mi.flat_index.tolist() == [0, 1, 2, 3, 4]


def test_padded_input_round_trips_per_token_values():
    cu = torch.tensor([0, 3, 5])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mi = model_input(cu, torch.tensor([11, 12, 13, 21, 22]), pad_id=0, length=4, packed=False)
    assert mi.tokens.tolist() == [[11, 12, 13, 0], [21, 22, 0, 0]] and mi.packed_seq_params is None
    grid = mi.scatter(values, -1.0)
    assert grid.tolist() == [[1, 2, 3, -1], [4, 5, -1, -1]]
    assert torch.equal(mi.gather(grid.reshape(-1)), values)
    assert to_grid(values, cu).tolist() == [[1, 2, 3], [4, 5, 0]]


def test_varlen_attention_equals_causal_attention_per_sequence():
    """Against a plain softmax(q k^T / sqrt(d) + causal mask) v of each sequence on its own."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 5, 1, 6]
    t, heads, groups, dim = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(t, h, dim, generator=gen, dtype=torch.float64) for h in (heads, groups, groups))
    cu = torch.tensor([0] + lengths).cumsum(0)
    out = varlen_causal_attention(q, k, v, cu, scale=1 / math.sqrt(dim))
    for start, n in zip(cu[:-1].tolist(), lengths):
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks, vs = ks.repeat_interleave(heads // groups, 1), vs.repeat_interleave(heads // groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(dim)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).reshape(n, heads * dim)
        assert torch.allclose(out[start:start + n], expected, atol=1e-12)
    with pytest.raises(ValueError, match="cu_seqlens ends at 20, the packed batch has 19"):
        varlen_causal_attention(q[:-1], k[:-1], v[:-1], cu, scale=1.0)


def test_vectorised_thd_rope_equals_rotating_each_sequence_on_its_own():
    """The CPU speed-up ``thd_rope_loops_over_sequences`` against megatron's rotation of every
    packed sequence from position 0 (``_apply_rotary_pos_emb_bshd`` per sequence)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.platform import megatron_cpu

    megatron_cpu.apply()

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    gen = torch.Generator().manual_seed(0)
    lengths = [4, 1, 7, 3]
    t = torch.randn(sum(lengths), 2, 8, generator=gen, dtype=torch.float64)
    freqs = torch.randn(max(lengths), 1, 1, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    out = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=OneRank())
    for start, n in zip(cu[:-1].tolist(), lengths):
        expected = rope_utils._apply_rotary_pos_emb_bshd(t[start:start + n].unsqueeze(1), freqs[:n]).squeeze(1)
        assert torch.allclose(out[start:start + n], expected, atol=1e-12)
