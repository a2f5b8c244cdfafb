"""Vocab-parallel log-probs with Keep Sampling Mask against a dense single-process reference.

The reference takes the other route: the full [N, V] logits, non-kept ids set to -inf by a Python
loop over the CSR rows, ``torch.log_softmax`` and autograd. The TP=2 run uses two gloo processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.parallel import free_port
from megarl.trainer.logprobs import CsrMask, vocab_parallel_logprobs

N, V, TP = 12, 10, 2


def _case():
    """Logits [N, V] float64, targets [N], a CSR mask covering the awkward rows, loss weights."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (N,), generator=gen)
    rows = []
    for i in range(N):
        if i in (2, 7):  # no mask at these positions: full vocabulary
            rows.append([])
        elif i == 4:  # only the target, kept on a single shard
            rows.append([int(targets[i])])
        elif i == 5:  # everything kept lies in the target's shard; the other shard is all -inf
            lo = int(targets[i]) // (V // TP) * (V // TP)
            rows.append(sorted({int(targets[i]), lo, lo + 1}))
        else:
            others = torch.randperm(V, generator=gen)[:4].tolist()
            rows.append(sorted(set(others) | {int(targets[i])}))
    w_logp = torch.randn(N, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return logits, targets, _csr(rows), rows, w_logp, w_ent


def _csr(rows: list[list[int]]) -> CsrMask:
    ids = torch.tensor([v for r in rows for v in r], dtype=torch.int32)
    offsets = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
    return CsrMask(ids, offsets)


def _dense_reference(logits, targets, rows, w_logp, w_ent):
    """(masked logp [N], unmasked entropy [N], grad [N, V]) by dense log_softmax and autograd."""
    logits = logits.clone().requires_grad_()
    masked = logits.clone()
    for i, kept in enumerate(rows):
        if kept:
            drop = [v for v in range(V) if v not in kept]
            masked[i, drop] = float("-inf")
    logp = torch.log_softmax(masked, dim=-1)[torch.arange(N), targets]
    full = torch.log_softmax(logits, dim=-1)
    entropy = -(full.exp() * full).sum(dim=-1)
    ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), logits.grad


def _sharded(logits, targets, mask, w_logp, w_ent, start, size, group):
    shard = logits[:, start : start + size].clone().requires_grad_()
    out = vocab_parallel_logprobs(shard, start, targets, mask, group)
    ((w_logp * out.logprobs).sum() + (w_ent * out.entropy).sum()).backward()
    return out.logprobs.detach(), out.entropy.detach(), shard.grad


def _support_weights(rows: list[list[int]]) -> torch.Tensor:
    return torch.randn(sum(map(len, rows)), generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _sharded_support(logits, targets, mask, rows, start, size, group):
    """The log-probs of every kept id of ``rows`` over its row's kept set, and the shard's gradient of their
    weighted sum (score centering's ``log pi(b)``)."""
    shard = logits[:, start : start + size].clone().requires_grad_()
    out = vocab_parallel_logprobs(shard, start, targets, mask, group, support=mask)
    (_support_weights(rows) * out.support_logprobs).sum().backward()
    return out.support_logprobs.detach(), shard.grad


def _dense_support(logits, targets, rows):
    """The same by dense log_softmax of the masked logits (rows without a mask: none asked) and autograd."""
    logits = logits.clone().requires_grad_()
    masked = logits.clone()
    for i, kept in enumerate(rows):
        if kept:
            masked[i, [v for v in range(V) if v not in kept]] = float("-inf")
    full = torch.log_softmax(masked, dim=-1)
    found = torch.stack([full[i, v] for i, kept in enumerate(rows) for v in kept])
    (_support_weights(rows) * found).sum().backward()
    return found.detach(), logits.grad


def _worker(rank, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    torch.set_num_threads(1)
    logits, targets, mask, rows, w_logp, w_ent = _case()
    size = V // TP
    group = dist.new_group(list(range(TP)))
    out = {
        "masked": _sharded(logits, targets, mask, w_logp, w_ent, rank * size, size, group),
        "unmasked": _sharded(logits, targets, None, w_logp, w_ent, rank * size, size, group),
    }
    out["support"] = _sharded_support(logits, targets, mask, rows, rank * size, size, group)
    outside = _csr(_outside_rows(targets, rows))
    out["outside_mask"] = _sharded(logits, targets, outside, w_logp, w_ent, rank * size, size, group)
    out["outside_count"] = vocab_parallel_logprobs(logits[:, rank * size : (rank + 1) * size], rank * size, targets,
                                                   outside, group).outside_mask.item()
    try:
        vocab_parallel_logprobs(logits[:, rank * size : (rank + 1) * size], rank * size, torch.full((N,), V), None,
                                group)
        out["outside_vocab"] = None
    except ValueError as err:
        out["outside_vocab"] = str(err)
    torch.save(out, f"{results}/rank{rank}.pt")
    dist.destroy_process_group()


def _outside_rows(targets, rows):
    """``rows`` with the target taken out of rows 0 (its mask then lies on the other shard) and 3."""
    out = [list(r) for r in rows]
    out[0] = [v for v in range(V) if v != int(targets[0]) and v // (V // TP) != int(targets[0]) // (V // TP)][:3]
    out[3] = [v for v in rows[3] if v != int(targets[3])]
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    results = tmp_path_factory.mktemp("tp2")
    mp.spawn(_worker, args=(free_port(), str(results)), nprocs=TP, join=True)
    return [torch.load(results / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.processes
def test_masked_logprobs_and_grad_match_dense_reference_under_tp2(tp2):
    logits, targets, _, rows, w_logp, w_ent = _case()
    ref_logp, ref_ent, ref_grad = _dense_reference(logits, targets, rows, w_logp, w_ent)
    for rank_out in tp2:
        logp, ent, _ = rank_out["masked"]
        assert (logp - ref_logp).abs().max() < 1e-6
        assert (ent - ref_ent).abs().max() < 1e-6
    grad = torch.cat([rank_out["masked"][2] for rank_out in tp2], dim=1)
    assert (grad - ref_grad).abs().max() < 1e-6
    # the mask matters: rows with a mask differ from the unmasked log-prob
    plain = torch.log_softmax(logits, dim=-1)[torch.arange(N), targets]
    assert (tp2[0]["masked"][0] - plain)[[i for i, r in enumerate(rows) if r]].abs().min() > 1e-3


@pytest.mark.processes
def test_support_logprobs_and_grad_match_dense_reference_under_tp2(tp2):
    logits, targets, _, rows, _, _ = _case()
    ref, ref_grad = _dense_support(logits, targets, rows)
    for rank_out in tp2:
        assert (rank_out["support"][0] - ref).abs().max() < 1e-6
    grad = torch.cat([rank_out["support"][1] for rank_out in tp2], dim=1)
    assert (grad - ref_grad).abs().max() < 1e-6


@pytest.mark.processes
def test_entropy_is_unmasked_and_no_mask_is_plain_log_softmax_under_tp2(tp2):
    logits, targets, _, _, w_logp, w_ent = _case()
    ref_logp, ref_ent, ref_grad = _dense_reference(logits, targets, [[]] * N, w_logp, w_ent)
    masked_ent = tp2[0]["masked"][1]
    for rank_out in tp2:
        logp, ent, _ = rank_out["unmasked"]
        assert (logp - ref_logp).abs().max() < 1e-6
        assert (ent - ref_ent).abs().max() < 1e-6
    assert (masked_ent - ref_ent).abs().max() < 1e-6
    grad = torch.cat([rank_out["unmasked"][2] for rank_out in tp2], dim=1)
    assert (grad - ref_grad).abs().max() < 1e-6


@pytest.mark.processes
def test_target_outside_its_mask_is_kept_and_counted_on_every_rank_under_tp2(tp2):
    """The log-prob (and gradient) is that over the mask plus the target, computed densely."""
    logits, targets, _, rows, w_logp, w_ent = _case()
    outside = _outside_rows(targets, rows)
    assert all(int(targets[i]) not in outside[i] and outside[i] for i in (0, 3))
    union = [sorted(set(r) | {int(targets[i])}) if r else r for i, r in enumerate(outside)]
    ref_logp, _, ref_grad = _dense_reference(logits, targets, union, w_logp, w_ent)
    for i in (0, 3):  # independently: log-softmax over the union's logits, at the target's place in it
        assert ref_logp[i].item() == pytest.approx(
            torch.log_softmax(logits[i, union[i]], -1)[union[i].index(int(targets[i]))].item())
    for rank_out in tp2:
        assert rank_out["outside_count"] == 2
        assert (rank_out["outside_mask"][0] - ref_logp).abs().max() < 1e-6
    grad = torch.cat([rank_out["outside_mask"][2] for rank_out in tp2], dim=1)
    assert (grad - ref_grad).abs().max() < 1e-6


@pytest.mark.processes
def test_target_outside_the_vocabulary_raises_on_every_rank_under_tp2(tp2):
    for rank_out in tp2:
        assert "outside the vocabulary" in rank_out["outside_vocab"]


@pytest.mark.unit
def test_single_shard_without_group_matches_reference():
    logits, targets, mask, rows, w_logp, w_ent = _case()
    ref_logp, ref_ent, ref_grad = _dense_reference(logits, targets, rows, w_logp, w_ent)
    logp, ent, grad = _sharded(logits, targets, mask, w_logp, w_ent, 0, V, None)
    assert (logp - ref_logp).abs().max() < 1e-6
    assert (ent - ref_ent).abs().max() < 1e-6
    assert (grad - ref_grad).abs().max() < 1e-6


@pytest.mark.unit
def test_float32_close_to_float64_reference():
    logits, targets, mask, rows, w_logp, w_ent = _case()
    ref_logp, ref_ent, _ = _dense_reference(logits, targets, rows, w_logp, w_ent)
    out = vocab_parallel_logprobs(logits.float(), 0, targets, mask)
    assert out.logprobs.dtype == torch.float32
    assert (out.logprobs.double() - ref_logp).abs().max() < 1e-5
    assert (out.entropy.double() - ref_ent).abs().max() < 1e-5
    assert out.outside_mask.dtype == torch.long and out.outside_mask.item() == 0
    assert vocab_parallel_logprobs(logits, 0, targets).outside_mask.item() == 0


@pytest.mark.unit
@pytest.mark.parametrize(
    "ids, offsets, match",
    [
        ([1, 2], [0, 2], r"offsets \[N\+1\]"),  # 2 offsets for N = 2 positions
        ([1, 2, 1], [0, 4, 3], "rise"),  # a row of length -1
        ([-1, 2], [0, 1, 2], "negative"),
    ],
)
def test_malformed_mask_raises(ids, offsets, match):
    mask = CsrMask(torch.tensor(ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(torch.zeros(2, 4, dtype=torch.float64), 0, torch.tensor([1, 2]), mask)


@pytest.mark.unit
def test_csr_rows_takes_the_chosen_rows_in_their_order():
    from megarl.trainer.logprobs import csr_rows

    rows_as_lists = [[3, 1], [], [7], [2, 5, 9], []]
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows_as_lists]).cumsum(0).tolist()], dtype=torch.int32)
    mask = CsrMask(torch.tensor([i for r in rows_as_lists for i in r], dtype=torch.int32), offsets)
    chosen = torch.tensor([3, 0, 1, 2, 3])
    sub = csr_rows(mask, chosen)
    got = [sub.ids[int(a):int(b)].tolist() for a, b in zip(sub.offsets[:-1], sub.offsets[1:])]
    assert got == [rows_as_lists[i] for i in chosen.tolist()]
    empty = csr_rows(mask, torch.tensor([1, 4], dtype=torch.long))
    assert empty.ids.numel() == 0 and empty.offsets.tolist() == [0, 0, 0]
