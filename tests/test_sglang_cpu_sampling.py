"""Sampling masks from the top-k columns (megarl/platform/sglang_cpu_sampling.py) against SGLang's own
full-vocabulary sort on the same probabilities: the same support and weights per row, a sampled token
inside it with its weight, the same sampling distribution, and SGLang's function where it does not apply."""
import pytest
import torch

from megarl.platform import sglang_cpu, sglang_cpu_sampling

pytestmark = pytest.mark.unit

VOCAB, MAX_TOP_K = 384, 20


@pytest.fixture(scope="module")
def sglang_sample():
    """SGLang's own function (the CPU work-arounds applied, megarl's sampler installed)."""
    sglang_cpu.apply()
    sglang_cpu_sampling.install()
    from sglang.srt.layers import sampler

    assert sampler.top_k_top_p_min_p_sampling_from_probs_torch is sglang_cpu_sampling.sample
    return sglang_cpu_sampling._original


def batch(rows: int, seed: int):
    """Distinct probabilities (no ties) with per-row top-k <= MAX_TOP_K, top-p and min-p."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=g) * 3, dim=-1)
    top_ks = torch.randint(1, MAX_TOP_K + 1, (rows,), generator=g, dtype=torch.int32)
    top_ps = torch.rand(rows, generator=g) * 0.6 + 0.4
    min_ps = torch.rand(rows, generator=g) * 0.05
    return probs, top_ks, top_ps, min_ps


def support(weights: torch.Tensor, ids: torch.Tensor, row: int) -> dict[int, float]:
    keep = weights[row] > 0
    return dict(zip(ids[row][keep].tolist(), weights[row][keep].tolist()))


@pytest.mark.parametrize("min_p", [False, True])
def test_support_weights_and_sampled_token_equal_sglangs(sglang_sample, min_p):
    probs, top_ks, top_ps, min_ps = batch(64, seed=1)
    args = (probs, top_ks, top_ps, min_ps, min_p, None, None)
    _, ref_weights, ref_ids, _ = sglang_sample(*args, return_filtered_probs=True, max_top_k=MAX_TOP_K)
    sampled, weights, ids, selected = sglang_cpu_sampling.sample(*args, return_filtered_probs=True,
                                                                 max_top_k=MAX_TOP_K)
    assert weights.shape == ids.shape == (64, MAX_TOP_K) and sampled.dtype == ids.dtype == torch.int32
    assert ref_weights.shape == (64, VOCAB)  # SGLang sorted the whole vocabulary
    for row in range(64):
        expected = support(ref_weights, ref_ids, row)
        assert 1 <= len(expected) <= top_ks[row]
        assert support(weights, ids, row) == expected
        assert selected[row].item() == expected[sampled[row].item()]
    assert torch.equal(ids[:, 0].long(), probs.argmax(dim=-1))


def test_sampling_distribution_equals_the_filtered_probabilities(sglang_sample):
    """20000 draws from one row: the token frequencies of both functions against the row's filtered,
    renormalised probabilities (a chi-square bound far above its expectation, far below a wrong support)."""
    probs, top_ks, top_ps, min_ps = batch(1, seed=2)
    top_ks[:] = 8
    top_ps[:] = 0.95
    rows = 20000
    _, weights, ids, _ = sglang_sample(probs, top_ks, top_ps, min_ps, False, None, None,
                                       return_filtered_probs=True, max_top_k=MAX_TOP_K)
    args = (probs.expand(rows, VOCAB).contiguous(), top_ks.expand(rows), top_ps.expand(rows), min_ps.expand(rows),
            False, None, None)
    target = support(weights, ids, 0)
    total = sum(target.values())
    torch.manual_seed(3)
    for sample in (sglang_sample, sglang_cpu_sampling.sample):
        drawn = sample(*args, return_filtered_probs=True, max_top_k=MAX_TOP_K)[0]
        counts = torch.bincount(drawn.long(), minlength=VOCAB)
        assert set(torch.nonzero(counts).view(-1).tolist()) <= set(target)
        chi2 = sum((counts[t].item() - rows * w / total) ** 2 / (rows * w / total) for t, w in target.items())
        assert chi2 < 40, (sample, chi2, len(target))  # df = len(target) - 1 <= 7: 40 is p < 1e-5


def test_without_masks_or_a_top_k_bound_it_is_sglangs(sglang_sample):
    """No filtered probabilities asked for, or max_top_k = the vocabulary: SGLang's own path and results.
    (Seeded sampling also keeps SGLang's path; SGLang runs it only with sgl-kernel, absent on CPU.)"""
    probs, top_ks, top_ps, min_ps = batch(16, seed=4)
    for filtered, max_top_k in ((True, VOCAB), (False, MAX_TOP_K)):
        args = (probs, top_ks, top_ps, min_ps, False, None, None)
        torch.manual_seed(5)
        ours = sglang_cpu_sampling.sample(*args, return_filtered_probs=filtered, max_top_k=max_top_k)
        torch.manual_seed(5)
        theirs = sglang_sample(*args, return_filtered_probs=filtered, max_top_k=max_top_k)
        if filtered:
            assert ours[1].shape == (16, VOCAB)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        else:
            assert torch.equal(ours, theirs)
