"""megarl/trainer/rank_pool.py: trainer-rank processes kept between groups (the test session keeps them,
tests/conftest.py ``ray_session``) join each new group as fresh ones would, and only healthy ones are kept."""
import asyncio
import time
from pathlib import Path

import psutil
import pytest
import ray

from megarl.parallel import Layout
from megarl.trainer import rank_pool
from megarl.trainer.actor import TrainerGroup
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


def gloo_threads() -> int:
    import os

    return sum(open(f"/proc/self/task/{t}/comm").read().startswith("gloo") for t in os.listdir("/proc/self/task"))


def train_step(rank, layout, hf_path):
    """Build the tiny MoE under ``layout`` and train one step, as a run() function of a test or tool would."""
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.sft_step import supervised_step
    from megarl.trainer.token_batch import token_batch

    trainable = build_trainable(hf_path, layout, optimizer_settings(default_config(), lr=1e-3),
                                ModelSettings(transformer_impl="local"))
    batch = token_batch([[1, 5 + i, 7, 9, 11 + i, 2] for i in range(4)], [3] * 4)
    return supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, 64).loss


def leftovers(rank, layout):
    """This process's pid, its megatron DDP models alive and its gloo threads (a process group each few)."""
    import gc
    import os

    from megatron.core.distributed import DistributedDataParallel

    gc.collect()
    return os.getpid(), sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()), gloo_threads()


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


def test_a_kept_rank_keeps_nothing_of_the_model_it_trained(tiny_checkpoint):
    """The MoE dispatcher's last activations (an autograd graph back to the DDP's hooks) and the rotary
    embedding's cached calls held the model, and its process groups' gloo threads (which poll), past
    the group: ~19 threads more each run, 8% of a core per idle rank after a dozen."""
    layout = Layout(world_size=2, tp=2, sequence_parallel=True)
    before = {pid: threads for pid, _, threads in run_ranks(leftovers, layout)}
    for _ in range(2):
        run_ranks(train_step, layout, tiny_checkpoint)
    after = run_ranks(leftovers, layout)
    assert {pid for pid, _, _ in after} == set(before)
    assert [models for _, models, _ in after] == [0, 0]
    assert {pid: threads for pid, _, threads in after} == before


def test_a_group_made_without_waiting_returns_before_its_ranks_joined():
    """``wait=False`` (a run's trainer: its engines launch meanwhile): the constructor returns while the
    ranks' processes (of their own: ``env``) still start; ``joined()`` waits for them, and the group then
    works as one made waiting."""
    group = TrainerGroup(Layout(), seed=7, import_paths=[str(Path(__file__).parent)],
                         env={"MEGARL_TEST_FRESH": "1"}, wait=False)
    try:
        ready, _ = ray.wait(group._joins, timeout=0)
        assert ready == []
        asyncio.run(group.joined())
        states = ray.get(group.run(rank_state))
    finally:
        group.shutdown(keep=False)
    assert [(s["world"], s["rank"]) for s in states] == [(1, 0)]
    assert gone([s["pid"] for s in states])


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


HELD = []  # what a rank's weight-sync link keeps between syncs, in the rank's process


def shared_bucket(rank, layout) -> str:
    """A colocated-sync bucket buffer (/dev/shm) that this rank's process keeps; its segment's name."""
    from megarl.sync.transports.tensor import TensorSender

    HELD.append(TensorSender().new_buffer(1 << 16))
    return HELD[-1].untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/")


def test_closing_the_pool_removes_the_shared_memory_its_killed_ranks_held(monkeypatch):
    """A SIGKILLed process never frees its segments; the pool's close waits for its ranks to go and
    removes them, and their senders' manifests."""
    from megarl.sync.transports.tensor import MANIFEST_PREFIX, SHARED_MEMORY

    monkeypatch.setattr(rank_pool, "_pool", None)
    with rank_pool.keep_ranks(max_idle=1):
        [segment] = run_ranks(shared_bucket, Layout())
        [pid] = [s["pid"] for s in run_ranks(rank_state, Layout())]
        assert (SHARED_MEMORY / segment).exists()  # kept with its rank
    assert gone([pid])
    assert not (SHARED_MEMORY / segment).exists() and not (SHARED_MEMORY / f"{MANIFEST_PREFIX}{pid}").exists()


def test_keep_ranks_needs_a_connected_ray(monkeypatch):
    monkeypatch.setattr(rank_pool, "_pool", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="connected Ray"):
        with rank_pool.keep_ranks():
            pass

