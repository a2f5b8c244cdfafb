"""Context parallelism: each CP rank's part of a micro-batch (BSHD and THD, against hand-made cases,
transformer-engine's partition kernel transcribed loop by loop, and megatron-core's own BSHD split),
per-token fields following their tokens, the differentiable gather back, and the loss scaling that
makes the DP×CP-reduced gradient the cp=1 one (two gloo processes as the CP ranks of one replica, a
per-position toy model standing for Megatron's, whose CP attention needs transformer-engine on CUDA)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from megarl.algos.objective import LossInputs, rl_loss
from megarl.algos.settings import AlgorithmConfig
from megarl.config.errors import ConfigError
from megarl.config.platform_rules import check_context_parallel
from megarl.parallel.network import free_port
from megarl.platform.description import GPU_MODULES, Platform
from megarl.trainer.context_parallel import (
    ContextParallelRank,
    bshd_partitioned_indices,
    bshd_split,
    row_length_multiple,
    thd_partitioned_indices,
    thd_split,
    token_count_share,
)
from megarl.trainer.packing import model_input, plan_micro_batches, to_grid
from megarl.trainer.routing_replay import local_replay_indices

CP = 2


@pytest.mark.unit
def test_bshd_indices_are_chunks_r_and_2cp_minus_1_minus_r():
    assert [bshd_partitioned_indices(8, 2, r).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [bshd_partitioned_indices(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert bshd_partitioned_indices(6, 1, 0).tolist() == list(range(6))
    with pytest.raises(ValueError, match="does not cut into 4 chunks"):
        bshd_partitioned_indices(6, 2, 0)


@pytest.mark.unit
def test_thd_indices_take_both_chunks_of_every_sequence_in_turn():
    # sequences of 4 and 8 (chunks of 1 and 2 at cp=2)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert thd_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert thd_partitioned_indices(cu, 12, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    # sequences of 6 and 12 at cp=3 (chunks of 1 and 2)
    cu = torch.tensor([0, 6, 18], dtype=torch.int32)
    assert [thd_partitioned_indices(cu, 18, 3, r).tolist() for r in range(3)] == [
        [0, 5, 6, 7, 16, 17], [1, 4, 8, 9, 14, 15], [2, 3, 10, 11, 12, 13]]
    with pytest.raises(ValueError, match="not all multiples of 2·cp = 4"):
        thd_partitioned_indices(torch.tensor([0, 6, 12]), 12, 2, 0)
    with pytest.raises(ValueError, match="from 0 to the row's 16 positions"):
        thd_partitioned_indices(cu, 16, 3, 0)


def _te_kernel(cu_seqlens, total_tokens, world_size, rank):
    """transformer-engine's thd_partition_indices_kernel, one thread per output token, as written."""
    cu_s = [int(c) // world_size for c in cu_seqlens]
    batch = len(cu_s) - 1

    def binary_search(target, array, length):
        left, right = 1, length - 1
        while left < right:
            mid = (left + right) // 2
            if array[mid] <= target:
                left = mid + 1
            else:
                right = mid
        return left - 1

    out = []
    for token_id in range(total_tokens // world_size):
        seq_id = binary_search(token_id, cu_s, batch + 1)
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        out.append(index + cu_s[seq_id] * world_size + seq_len // 2 * offset)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_thd_indices_equal_transformer_engines_kernel(cp):
    gen = torch.Generator().manual_seed(cp)
    for _ in range(5):
        lengths = torch.randint(1, 5, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen) * 2 * cp
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).int()
        total = int(cu[-1])
        for r in range(cp):
            assert thd_partitioned_indices(cu, total, cp, r).tolist() == _te_kernel(cu.tolist(), total, cp, r)


@pytest.mark.unit
@pytest.mark.parametrize("cp", [2, 4])
def test_every_position_is_held_by_exactly_one_rank(cp):
    for split in (bshd_split(3, 16, ContextParallelRank(cp, 0)),
                  thd_split(torch.tensor([0, 8, 24, 32]), 32, ContextParallelRank(cp, 0))):
        assert torch.equal(split.positions.reshape(-1).sort().values, torch.arange(split.positions.numel()))


@pytest.mark.unit
def test_token_count_shares_add_up_to_the_count():
    for size in (1, 2, 3, 8):
        for count in (0, 1, 5, 17):
            shares = [int(token_count_share(torch.tensor(count, dtype=torch.int), ContextParallelRank(size, r)))
                      for r in range(size)]
            assert sum(shares) == count and max(shares) - min(shares) <= 1


@pytest.mark.unit
def test_row_length_multiple():
    assert [row_length_multiple(1, 4, False), row_length_multiple(1, 4, True)] == [1, 4]  # as without CP
    assert [row_length_multiple(2, 4, False), row_length_multiple(2, 4, True), row_length_multiple(4, 2, True)] == [
        4, 8, 8]


@pytest.mark.unit
def test_packed_input_of_each_cp_rank():
    """[11 12 13] and [21 22] at cp=2: padded to 4 each, a tail of 4 to the row's 12."""
    cu, tokens = torch.tensor([0, 3, 5]), torch.tensor([11, 12, 13, 21, 22])
    ranks = [model_input(cu, tokens, pad_id=0, length=12, packed=True, cp=ContextParallelRank(2, r)) for r in range(2)]
    assert ranks[0].tokens.tolist() == [[11, 0, 21, 0, 0, 0]] and ranks[1].tokens.tolist() == [[12, 13, 22, 0, 0, 0]]
    assert ranks[0].position_ids.tolist() == [[0, 3, 0, 3, 0, 3]]
    assert ranks[1].position_ids.tolist() == [[1, 2, 1, 2, 1, 2]]
    params = ranks[0].packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 9] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 12]
    assert params.cu_seqlens_kv_padded.dtype == torch.int32 and params.max_seqlen_q == 4
    assert ranks[0].flat_index.tolist() == [0, 1, 2, 4, 5]
    assert ranks[0].local_index.tolist() == [0, -1, -1, 2, -1] and ranks[1].local_index.tolist() == [-1, 0, 1, -1, 2]
    with pytest.raises(ValueError, match=r"5 tokens \(8 with their padding\) do not fit a packed row of 6"):
        model_input(cu, tokens, pad_id=0, length=6, packed=True, cp=ContextParallelRank(2, 0))


@pytest.mark.unit
def test_padded_rows_of_the_cp_ranks_put_together_are_the_whole_rows():
    cu, tokens = torch.tensor([0, 3, 5]), torch.tensor([11, 12, 13, 21, 22])
    whole = model_input(cu, tokens, pad_id=0, length=8, packed=False)
    ranks = [model_input(cu, tokens, pad_id=0, length=8, packed=False, cp=ContextParallelRank(2, r)) for r in range(2)]
    assert ranks[0].tokens.tolist() == [[11, 12, 0, 0], [21, 22, 0, 0]]
    assert ranks[1].position_ids.tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]
    joined = torch.zeros(16, dtype=torch.long)
    for mi in ranks:
        joined[mi.split.mine] = mi.tokens.reshape(-1)
    assert torch.equal(joined.view(2, 8), whole.tokens)


def _ragged_case(seed=0, lengths=(5, 3, 6), layers=2, k=2):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.tensor(lengths), 0)])
    n = int(cu[-1])
    return cu, torch.randint(1, 50, (n,), generator=gen), torch.randint(0, 8, (n, layers, k), generator=gen)


@pytest.mark.unit
@pytest.mark.parametrize("packed", [True, False])
def test_replay_ids_and_per_token_fields_follow_their_tokens(packed):
    """Each rank's replay ids are those of the tokens it feeds the model, in megatron's
    sequence-major order [s_local * b]; padding replays 0..k-1."""
    cu, tokens, routed = _ragged_case()
    for r in range(CP):
        mi = model_input(cu, tokens, pad_id=0, length=12 if not packed else 24, packed=packed,
                         cp=ContextParallelRank(CP, r))
        b, s = mi.shape
        grid = mi.scatter(routed, torch.arange(2))  # [b, s, L, k]
        by_position = {int(p): i for i, p in enumerate(mi.flat_index)}
        for row in range(b):
            for col in range(s):
                whole = int(mi.split.mine[row * s + col])
                if whole in by_position:
                    assert int(mi.tokens[row, col]) == int(tokens[by_position[whole]])
                    assert torch.equal(grid[row, col], routed[by_position[whole]])
                else:
                    assert int(mi.tokens[row, col]) == 0 and grid[row, col].tolist() == [[0, 1], [0, 1]]
        replay = local_replay_indices(grid, 2, sequence_parallel=False)
        assert torch.equal(replay.view(s, b, 2), grid[:, :, 1].transpose(0, 1))


@pytest.mark.unit
@pytest.mark.parametrize("packed", [True, False])
def test_a_cp_input_moves_to_the_model_device_with_its_split(packed):
    cu, tokens, routed = _ragged_case()
    mi = model_input(cu, tokens, 0, 24 if packed else 12, packed, ContextParallelRank(CP, 1)).to(torch.device("meta"))
    assert mi.split.positions.is_meta and mi.local_index.is_meta
    assert mi.scatter(routed.to("meta"), torch.arange(2, device="meta")).is_meta
    if packed:
        assert mi.packed_seq_params.cu_seqlens_q_padded.is_meta


@pytest.mark.unit
def test_packed_plan_counts_each_sequence_at_its_padded_length():
    lengths = torch.tensor([5, 3, 6, 1])
    plan = plan_micro_batches(lengths, 1, 16, pack=True, cp=2, length_multiple=row_length_multiple(2, 1, False))
    assert plan.length % 4 == 0
    for mb in plan.per_rank[0]:
        assert sum(-(-int(lengths[i]) // 4) * 4 for i in mb) <= plan.length


# ---- two gloo processes: the CP ranks of one data-parallel replica -------------------------------------------

V, D = 11, 6
ALGO = AlgorithmConfig(policy_loss="gspo", loss_agg="seq_mean_token_mean", entropy_coef=0.01)


def _rl_case():
    """3 samples: tokens, targets, loss mask (response part), per-sample advantages, old log-probs."""
    cu, tokens, _ = _ragged_case(seed=1)
    gen = torch.Generator().manual_seed(2)
    n = int(cu[-1])
    targets = torch.randint(0, V, (n,), generator=gen)
    lengths = (cu[1:] - cu[:-1]).tolist()
    loss_mask = torch.cat([(torch.arange(n_i) >= n_i // 2).float() for n_i in lengths])  # the second half trained
    return cu, tokens % V, targets, loss_mask, torch.tensor([1.0, -0.5, 2.0]), -torch.rand(n, generator=gen) - 1


def _toy_params():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(V, D, generator=gen, dtype=torch.float64).requires_grad_(),
            torch.randn(32, D, generator=gen, dtype=torch.float64).requires_grad_(),
            torch.randn(D, V, generator=gen, dtype=torch.float64).requires_grad_()]


def _toy_loss(mi, params):
    """The RL step's loss path on a per-position toy model: this rank's tokens' log-probs and
    entropy, put back on whole rows (gathered under CP), the configured loss. (loss_sum, num_tokens)."""
    cu, _, targets, loss_mask, advantages, old = _rl_case()
    emb, pos, head = params
    b, s = mi.shape
    logits = (torch.tanh(emb[mi.tokens.reshape(-1)] + pos[mi.position_ids.reshape(-1)]) @ head)
    local = mi.local_index
    rows = (loss_mask > 0).nonzero().squeeze(1)
    rows = rows[local[rows] >= 0]
    logp = torch.log_softmax(logits[local[rows]], -1)
    entropy = -(logp.exp() * logp).sum(-1)
    flat_lp, flat_ent = mi.to_ragged(logp[torch.arange(len(rows)), targets[rows]], rows), mi.to_ragged(entropy, rows)
    out = rl_loss(LossInputs(logprobs=to_grid(flat_lp, cu), old_logprobs=to_grid(old, cu),
                             loss_mask=to_grid(loss_mask, cu), advantages=advantages,
                             entropy=to_grid(flat_ent, cu)), ALGO)
    num_tokens = out.denominator_share.round().to(torch.int)
    if mi.split is not None:
        num_tokens = token_count_share(num_tokens, mi.split.cp)
    return out.loss_sum, num_tokens


def _reduced_gradient(mi, group):
    """Megatron's calculate_per_token_loss reduction over the DP×CP group: gradients summed, divided
    by the summed num_tokens."""
    params = _toy_params()
    loss_sum, num_tokens = _toy_loss(mi, params)
    loss_sum.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    count = num_tokens.to(torch.float64)
    if group is not None:
        dist.all_reduce(grads, group=group)
        dist.all_reduce(count, group=group)
    return grads / count


def _worker(rank, port, results):
    from megatron.core.utils import _get_batch_on_this_cp_rank_per_sequence_balancing

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CP)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(CP)))
    cp = ContextParallelRank(CP, rank, group)
    cu, tokens = _rl_case()[:2]
    out = {}
    for packed, length in ((True, 24), (False, 8)):
        mi = model_input(cu, tokens, 0, length, packed, cp)
        whole = torch.randn(mi.split.positions.numel(), 3, generator=torch.Generator().manual_seed(4))
        local = mi.split.local(whole).requires_grad_()
        weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(5))
        gathered = mi.split.gather(local)
        (gathered * weights).sum().backward()
        out[packed] = {"gathered": gathered.detach(), "whole": whole, "grad": local.grad,
                       "own_weights": mi.split.local(weights), "gradient": _reduced_gradient(mi, group)}
    padded = model_input(cu, tokens, 0, 8, False)
    batch = {"tokens": padded.tokens.clone(), "position_ids": padded.position_ids.clone(), "cu_seqlens": None}
    split = _get_batch_on_this_cp_rank_per_sequence_balancing(batch, cp_group=group)
    local = model_input(cu, tokens, 0, 8, False, cp)
    out["megatron_bshd"] = (torch.equal(split["tokens"], local.tokens), torch.equal(split["position_ids"],
                                                                                     local.position_ids))
    torch.save(out, f"{results}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    results = tmp_path_factory.mktemp("cp2")
    mp.spawn(_worker, args=(free_port(), str(results)), nprocs=CP, join=True)
    return [torch.load(results / f"rank{r}.pt") for r in range(CP)]


@pytest.mark.processes
@pytest.mark.parametrize("packed", [True, False])
def test_gather_returns_the_whole_input_and_each_rank_its_own_gradient(cp2, packed):
    for out in cp2:
        case = out[packed]
        assert torch.equal(case["gathered"], case["whole"])
        assert torch.equal(case["grad"], case["own_weights"])


@pytest.mark.processes
def test_the_bshd_split_is_megatrons(cp2):
    assert all(out["megatron_bshd"] == (True, True) for out in cp2)


@pytest.mark.processes
@pytest.mark.parametrize("packed", [True, False])
def test_dp_cp_reduced_gradient_equals_the_cp1_gradient(cp2, packed):
    """Whole loss on every CP rank, unscaled, and the token count split over the ranks: megatron's
    DP×CP reduction then gives the gradient the same replica computes without CP."""
    cu, tokens = _rl_case()[:2]
    reference = _reduced_gradient(model_input(cu, tokens, 0, 24 if packed else 8, packed), None)
    for out in cp2:
        assert torch.allclose(out[packed]["gradient"], reference, rtol=1e-10, atol=1e-12)
    assert reference.abs().max() > 1e-3


# ---- the config rule ---------------------------------------------------------------------------------------------

def _cfg(cp, impl):
    return OmegaConf.create({"parallel": {"cp": cp}, "model": {"transformer_impl": impl}})


@pytest.mark.unit
def test_cp_needs_transformer_engines_attention():
    no_te = Platform.cuda(importable=tuple(m for m in GPU_MODULES if m != "transformer_engine.pytorch"))
    for cfg, platform, key, why in [
        (_cfg(2, "auto"), Platform.cpu(), "parallel.cp: ", "local attention on CPU has no context-parallel path"),
        (_cfg(2, "local"), Platform.cuda(), "parallel.cp: ", "model.transformer_impl=local builds megatron's local"),
        (_cfg(2, "auto"), no_te, "model.transformer_impl=auto: ", "pytorch does not import (not installed)"),
    ]:
        with pytest.raises(ConfigError) as err:
            check_context_parallel(cfg, platform)
        assert str(err.value).startswith(key) and why in str(err.value), str(err.value)
    check_context_parallel(_cfg(2, "auto"), Platform.cuda())
    check_context_parallel(_cfg(2, "transformer_engine"), Platform.cuda())
    check_context_parallel(_cfg(1, "local"), Platform.cpu())
