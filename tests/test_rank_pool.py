"""megarl/trainer/rank_pool.py: trainer-rank processes kept between groups (the test session keeps them,
tests/conftest.py ``ray_session``) join each new group as fresh ones would, and only healthy ones are kept."""
import time

import psutil
import pytest
import ray

from megarl.parallel import Layout
from megarl.trainer import rank_pool
from megarl.trainer.launch import RankFailed, run_ranks

pytestmark = pytest.mark.usefixtures("ray_local")


def rank_state(rank, layout):
    """What a rank of ``layout`` sees: its process, its groups, the first draws of its seeded RNG."""
    import os

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    return {"pid": os.getpid(), "world": dist.get_world_size(), "rank": dist.get_rank(),
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size(), "draws": torch.rand(3).tolist()}


def process_id(rank, layout):
    import os

    return os.getpid()


def fail_on_rank_one(rank, layout):
    if rank == 1:
        raise ValueError("rank one fails")
    return rank


def gone(pids, timeout_s=30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(psutil.pid_exists(p) for p in pids)


def test_kept_ranks_join_the_next_group_as_fresh_ones_would():
    assert rank_pool.current() is not None  # the session's
    tp2 = run_ranks(rank_state, Layout(world_size=2, tp=2), seed=7)
    ep2 = run_ranks(rank_state, Layout(world_size=2, ep=2), seed=7)
    assert {s["pid"] for s in ep2} == {s["pid"] for s in tp2}  # the same processes, now in another layout
    assert [(s["world"], s["rank"], s["tp"], s["ep"]) for s in tp2] == [(2, 0, 2, 1), (2, 1, 2, 1)]
    assert [(s["world"], s["rank"], s["tp"], s["ep"]) for s in ep2] == [(2, 0, 1, 2), (2, 1, 1, 2)]
    # seeded at join: a kept process draws what a new process of its own (env: never kept) draws
    fresh = run_ranks(rank_state, Layout(world_size=2, ep=2), seed=7, env={"MEGARL_TEST_FRESH": "1"})
    assert not {s["pid"] for s in fresh} & {s["pid"] for s in ep2}
    assert [s["draws"] for s in ep2] == [s["draws"] for s in fresh]
    assert gone([s["pid"] for s in fresh])  # not kept
    one = run_ranks(rank_state, Layout(), seed=7)
    assert one[0]["pid"] in {s["pid"] for s in ep2} and (one[0]["world"], one[0]["tp"]) == (1, 1)


def test_ranks_of_a_failed_group_are_not_kept():
    before = {s["pid"] for s in run_ranks(rank_state, Layout(world_size=2))}
    with pytest.raises(RankFailed, match="rank one fails"):
        run_ranks(fail_on_rank_one, Layout(world_size=2))
    assert gone(before)  # the failed group's ranks (the kept ones it took) were killed
    after = {s["pid"] for s in run_ranks(rank_state, Layout(world_size=2))}
    assert not after & before


def test_a_block_keeps_at_most_max_idle_and_kills_them_at_its_end(monkeypatch):
    monkeypatch.setattr(rank_pool, "_pool", None)  # a block of this test's own, in place of the session's
    with rank_pool.keep_ranks(max_idle=1) as pool:
        with pytest.raises(RuntimeError, match="already active"):
            with rank_pool.keep_ranks():
                pass
        pids = [s["pid"] for s in run_ranks(rank_state, Layout(world_size=2))]
        assert len(pool.idle) == 1
        kept = ray.get(pool.idle[0].run.remote(process_id))
        assert kept in pids and gone(set(pids) - {kept})
    assert pool.idle == [] and gone(pids)


def test_keep_ranks_needs_a_connected_ray(monkeypatch):
    monkeypatch.setattr(rank_pool, "_pool", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="connected Ray"):
        with rank_pool.keep_ranks():
            pass

