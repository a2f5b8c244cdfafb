"""The engines' GPU paths, evaluated on a CUDA description of the machine (``Platform.cuda``) here:
the dtype and attention backend a GPU engine is launched with (against SGLang's own chooser), one
CUDA-IPC payload per engine rank, the tensor transport only where IPC handles open, each colocated
engine on its own GPUs with its memory saver, the trainer's release before the engines resume, and
an engine placement Ray cannot satisfy failing in bounded time with what is missing."""
import argparse
import asyncio
import dataclasses
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.config.platform_rules import refuse_on_platform
from megarl.config.topology import RunTopology, pool_engine_settings
from megarl.engines.launch_plan import attention_backend
from megarl.engines.server import EngineSettings, EngineStartError, SGLangEngine
from megarl.pipeline.colocate import Colocation
from megarl.platform.description import GPU_MODULES, Platform

HOPPER = Platform.cuda((9, 0))
WITHOUT_MEMORY_SAVER = Platform.cuda((9, 0), importable=tuple(m for m in GPU_MODULES if m != "torch_memory_saver"))


def tiny(*overrides: str):
    return load_config(["recipe=tiny_moe_cpu", "model.hf_path=/nonexistent", *overrides])


def policy_settings(cfg, checkpoint: str, platform: Platform) -> list[EngineSettings]:
    """The policy pool's engine settings of ``cfg`` on ``platform``, serving ``checkpoint``."""
    topology = RunTopology.from_config(cfg)
    return pool_engine_settings(cfg, topology, topology.policy, platform, "key", checkpoint)


def command_of(settings: EngineSettings) -> list[str]:
    return SGLangEngine(dataclasses.replace(settings, host="127.0.0.1", port=30000)).command()


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


# --- dtype and attention backend -------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("flashinfer", [True, False])
def test_attention_backend_is_the_one_sglang_picks(capability, mla, flashinfer):
    from sglang.srt.arg_groups.model_override_base import get_default_attn_backend
    from sglang.srt.runtime_context import override_platform

    importable = tuple(m for m in GPU_MODULES if flashinfer or m != "flashinfer")
    server_args = SimpleNamespace(speculative_algorithm=None, speculative_eagle_topk=None, page_size=None, tp_size=1)
    model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
                                   has_asymmetric_kv=False, has_attention_sinks=False)
    with override_platform(is_hopper_with_cuda_12_3=capability[0] == 9, is_sm100=capability[0] == 10,
                           is_hip=False, has_flashinfer=flashinfer):
        expected = get_default_attn_backend(server_args, mla, model_config)
    assert attention_backend(Platform.cuda(capability, importable=importable), mla) == expected


@pytest.mark.unit
def test_gpu_engine_is_launched_in_bfloat16_with_an_explicit_attention_backend(tiny_checkpoint):
    cfg = tiny("model.dtype=bfloat16")
    cmd = command_of(policy_settings(cfg, tiny_checkpoint, HOPPER)[0])
    assert (flag(cmd, "--device"), flag(cmd, "--dtype"), flag(cmd, "--attention-backend")) == \
        ("cuda", "bfloat16", "fa3")
    cpu = command_of(policy_settings(tiny(), tiny_checkpoint, Platform.cpu())[0])
    assert (flag(cpu, "--device"), flag(cpu, "--dtype"), flag(cpu, "--attention-backend")) == \
        ("cpu", "float32", "torch_native")
    assert cpu.count("--attention-backend") == 1
    with pytest.raises(ValueError, match="model.dtype=bfloat16"):
        policy_settings(tiny(), tiny_checkpoint, HOPPER)[0]  # float32 on CUDA


@pytest.mark.unit
def test_schedulers_wait_on_their_sockets_when_idle_or_paused_on_gpu_and_cpu(tiny_checkpoint):
    """``--sleep-on-idle`` on both platforms: without it SGLang's scheduler polls in a busy loop while
    idle, and the paused loop's wait (:mod:`megarl.engine_process.paused_wait`) has no sleeper to use."""
    from sglang.srt.server_args import ServerArgs

    gpu = command_of(policy_settings(tiny("model.dtype=bfloat16"), tiny_checkpoint, HOPPER)[0])
    cpu = command_of(policy_settings(tiny(), tiny_checkpoint, Platform.cpu())[0])
    assert gpu.count("--sleep-on-idle") == cpu.count("--sleep-on-idle") == 1
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(gpu[3:]).sleep_on_idle is True  # SGLang's own parser, the whole GPU command line


@pytest.mark.unit
def test_float32_engines_on_cuda_are_refused_at_load(tmp_path, monkeypatch, capsys):
    from megarl.train import main

    monkeypatch.setattr("megarl.config.platform_rules.detect", lambda: HOPPER)
    t0 = time.monotonic()
    code = main(["recipe=tiny_moe_cpu", f"model.hf_path={tmp_path / 'base'}", f"warmup.save_hf_path={tmp_path / 'sft'}",
                 f"logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - t0 < 10
    assert len(err.splitlines()) == 1 and err.startswith("megarl: config error: model.dtype: float32 on cuda: "), err
    assert "model.dtype=bfloat16" in err
    assert not (tmp_path / "run").exists()
    refuse_on_platform(tiny(), Platform.cpu())  # the CPU demo's float32 stays
    refuse_on_platform(tiny("model.dtype=bfloat16"), HOPPER)


# --- CUDA IPC payloads and where they can be opened -------------------------------------------------

@pytest.mark.unit
def test_a_bucket_payload_rebuilds_its_tensors():
    """What a feeding rank serialises for its engine rank (megarl/sync/transports/tensor.py; one serialisation
    per engine rank: tests/test_tensor_route.py) is SGLang's flattened bucket of the buffer's tensors."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megarl.sync.buckets import pack
    from megarl.sync.transports.tensor import new_buffer, serialise

    named = [("a.weight", torch.randn(4, 3)), ("b.bias", torch.arange(5, dtype=torch.float32))]
    bucket = pack(named, allocate=lambda n: new_buffer(n + 16, cuda=False))  # a buffer larger than the bucket
    data = MultiprocessingSerializer.deserialize(serialise(bucket.buffer, bucket.index))
    rebuilt = dict(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                         metadata=data["metadata"]).reconstruct_tensors())
    assert rebuilt.keys() == dict(named).keys()
    for name, tensor in named:
        assert torch.equal(rebuilt[name], tensor)


@pytest.mark.unit
def test_tensor_transport_into_disaggregated_engines_is_refused_on_cuda_only():
    cfg = tiny("model.dtype=bfloat16", "sync.transport=tensor")  # the tiny recipe is disaggregated
    with pytest.raises(ConfigError, match=r"^sync\.transport: tensor with placement=disaggregated: .*CUDA IPC"):
        refuse_on_platform(cfg, HOPPER)
    refuse_on_platform(cfg, Platform.cpu())  # shared memory: every process of the machine maps it
    refuse_on_platform(tiny("model.dtype=bfloat16", "placement=colocated"), HOPPER)


# --- colocated engines: their own GPUs, their memory saver -------------------------------------------

@pytest.mark.unit
def test_colocated_engines_each_take_their_own_gpus_of_the_trainers(tiny_checkpoint):
    """4 x TP2 engines beside 8 trainer ranks on one node, whose GPUs Ray handed out in another order than the
    ranks': each engine's server sees its trainer ranks' GPUs alone, in rank order (CUDA_VISIBLE_DEVICES),
    from --base-gpu-id 0, with its memory saver; the CPU engine gets neither."""
    from megarl.engines.pinning import colocated_seats
    from megarl.parallel.places import Place

    cfg = load_config(["recipe=qwen3_30b_a3b"])
    settings = policy_settings(cfg, tiny_checkpoint, HOPPER)
    ray_gpus = ["3", "0", "6", "1", "7", "2", "4", "5"]  # trainer rank i holds GPU ray_gpus[i]
    places = [Place("node-a", "10.0.0.1", (g,)) for g in ray_gpus]
    taken = []
    for e, s in enumerate(settings):
        [seat] = colocated_seats(places, e, s.tp, s.nnodes)
        pinned = SGLangEngine(dataclasses.replace(s, host="127.0.0.1", port=30000, visible_gpus=seat.gpus))
        cmd, visible = pinned.command(), pinned.environment()["CUDA_VISIBLE_DEVICES"].split(",")
        base = int(flag(cmd, "--base-gpu-id"))
        under = [visible[base + k] for k in range(int(flag(cmd, "--tp-size")))]  # SGLang: base + tp_rank
        assert under == ray_gpus[e * s.tp:(e + 1) * s.tp] and seat.node_id == "node-a"
        assert "--enable-memory-saver" in cmd
        taken += under
    assert sorted(taken) == sorted(ray_gpus)  # 4 x TP2 on the node's 8 GPUs, none shared
    cpu = policy_settings(tiny("placement=colocated", "sync.transport=tensor"), tiny_checkpoint, Platform.cpu())
    assert (cpu[0].base_gpu_id, cpu[0].memory_saver) == (None, False)  # on the CPU: host memory, nothing to release
    assert "--base-gpu-id" not in command_of(cpu[0]) and "--enable-memory-saver" not in command_of(cpu[0])


@pytest.mark.unit
@pytest.mark.parametrize("inherited", [None, "1"])
def test_trainer_ranks_and_engines_set_nccl_alike(tiny_checkpoint, monkeypatch, inherited):
    """NCCL_CUMEM_ENABLE: a trainer rank (what init_rank sets before its first communicator) and an engine
    server started from the same environment get the same value: 0, SGLang's own default, unless the
    environment sets one, which both keep."""
    from megarl.parallel.nccl import pin_nccl_environment

    if inherited is None:
        monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_CUMEM_ENABLE", inherited)
    rank_env = dict(os.environ)
    pin_nccl_environment(rank_env)
    settings = EngineSettings(model_path=tiny_checkpoint, device="cuda", host="127.0.0.1", port=30000)
    engine_env = SGLangEngine(settings).environment()
    assert rank_env["NCCL_CUMEM_ENABLE"] == engine_env["NCCL_CUMEM_ENABLE"] == (inherited or "0")


@pytest.mark.unit
def test_colocated_on_cuda_without_the_memory_saver_is_refused(tiny_checkpoint):
    cfg = tiny("model.dtype=bfloat16", "placement=colocated")
    with pytest.raises(ConfigError, match=r"^placement: .*torch_memory_saver \(not installed\)"):
        refuse_on_platform(cfg, WITHOUT_MEMORY_SAVER)
    refuse_on_platform(cfg, HOPPER)
    refuse_on_platform(tiny("model.dtype=bfloat16"), WITHOUT_MEMORY_SAVER)  # disaggregated keeps its memory
    with pytest.raises(ValueError, match="torch_memory_saver"):
        policy_settings(cfg, tiny_checkpoint, WITHOUT_MEMORY_SAVER)


class RecordingPool:
    def __init__(self, calls: list[str], can_release: bool = True):
        self.calls, self.can_release = calls, can_release

    async def hold(self, *, abort):
        self.calls.append("engines hold")

    async def unhold(self):
        self.calls.append("engines continue")

    async def memory_release_available(self):
        return self.can_release

    async def release_memory(self, tags):
        self.calls.append(f"engines release {sorted(tags)}")

    async def resume_memory(self, tags):
        self.calls.append(f"engines resume {sorted(tags)}")


def _colocated_step(colocation: Colocation, calls: list[str]) -> None:
    async def sync():
        calls.append("sync")

    async def body():
        await colocation.before_training()
        calls.append("trainer trains")
        await colocation.after_training(sync)

    asyncio.run(body())


@pytest.mark.unit
def test_on_cuda_the_engines_release_before_training_and_the_trainer_before_they_resume():
    calls = []

    async def release_trainer():
        calls.append("trainer releases")
        return [{"allocated": 1.0, "reserved": 3.0}, {"allocated": 1.0, "reserved": 5.0}]

    colocation = Colocation(RecordingPool(calls), abort=False, platform=HOPPER, release_trainer=release_trainer)
    _colocated_step(colocation, calls)
    assert calls == ["engines hold", "engines release ['kv_cache', 'weights']", "trainer trains", "trainer releases",
                     "engines resume ['weights']", "sync", "engines resume ['kv_cache']", "engines continue"]
    assert colocation.metrics()["colocate/trainer_reserved_gb"] == 5.0
    with pytest.raises(ValueError, match="release_trainer"):
        Colocation(RecordingPool([]), abort=False, platform=HOPPER)
    with pytest.raises(RuntimeError, match="--enable-memory-saver"):
        _colocated_step(Colocation(RecordingPool([], can_release=False), abort=False, platform=HOPPER,
                                   release_trainer=release_trainer), [])


@pytest.mark.unit
def test_on_the_cpu_there_is_nothing_to_release_and_it_says_so(caplog):
    calls = []

    async def release_trainer():
        raise AssertionError("a CPU trainer has no device cache to release")

    with caplog.at_level(logging.INFO, logger="megarl.pipeline.colocate"):
        colocation = Colocation(RecordingPool(calls, can_release=False), abort=False, platform=Platform.cpu(),
                                release_trainer=release_trainer)
    assert "nothing" in caplog.text or "no device cache" in caplog.text
    _colocated_step(colocation, calls)
    assert calls == ["engines hold", "trainer trains", "sync", "engines continue"]


@pytest.mark.unit
def test_trainer_release_asks_every_rank_in_order():
    from megarl.pipeline.colocate import empty_trainer_cache, trainer_release

    class Ranks:
        def run(self, fn):
            assert fn is empty_trainer_cache

            async def report(rank):
                return {"allocated": rank, "reserved": 2.0 * rank}

            return [report(rank) for rank in range(3)]

    assert asyncio.run(trainer_release(Ranks())) == [{"allocated": r, "reserved": 2.0 * r} for r in range(3)]


# --- engines Ray cannot place --------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_local")
def test_engines_ray_cannot_place_fail_in_their_startup_timeout_naming_the_gpus(tiny_checkpoint):
    from megarl.engines.pool import EnginePool

    settings = EngineSettings(model_path=tiny_checkpoint, startup_timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match=r"need 4 GPUs \(2 x 2\) .*Ray has 0 GPUs free of 0"):
        asyncio.run(EnginePool.launch([settings, settings], num_gpus=2))  # this Ray has CPUs only
    assert time.monotonic() - t0 < 30


@pytest.mark.unit
def test_a_driver_without_a_gpu_sets_the_run_up_for_the_clusters_gpu_nodes(monkeypatch):
    """A driver on a CPU-only head: the platform the ranks and engines are set up for is detected by a task on a
    GPU node, and the run is checked against it (a float32 recipe is refused for CUDA engines); on a cluster
    without GPUs it is the driver's own."""
    import ray

    from megarl.pipeline.startup import placement

    asked = []

    class RemoteDetect:
        def remote(self):
            asked.append("detect on a GPU node")
            future = asyncio.get_running_loop().create_future()
            future.set_result(HOPPER)
            return future

    monkeypatch.setattr(placement, "detect", Platform.cpu)
    gpu_task = lambda **options: lambda fn: RemoteDetect() if options["num_gpus"] == 1 else None  # noqa: E731
    monkeypatch.setattr(ray, "remote", gpu_task)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert asyncio.run(placement.work_platform(tiny())) == Platform.cpu() and not asked
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 16.0})
    assert asyncio.run(placement.work_platform(tiny("model.dtype=bfloat16"))) == HOPPER and len(asked) == 1
    with pytest.raises(ConfigError, match=r"^model.dtype: float32 on cuda"):
        asyncio.run(placement.work_platform(tiny()))


@pytest.mark.unit
def test_evaluation_requests_go_before_the_streams_queued_ones(tiny_checkpoint, monkeypatch):
    """The engines run SGLang's priority scheduling (checked by its own parser on both platforms): in its
    scheduler's queue order (SchedulePolicy with the command line's settings), the held-out evaluation's
    requests, sent at ``EVAL_PRIORITY``, come before the training stream's queued ones, which carry none (the
    engine's default, 0) and keep their arrival order; none preempts a running request."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.server_args import ServerArgs

    from megarl.engines.client import generate_payload
    from megarl.engines.types import SamplingParams
    from megarl.pipeline.evaluation import EVAL_PRIORITY

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for platform in (HOPPER, Platform.cpu()):
        dtype = ["model.dtype=bfloat16"] if platform is HOPPER else []
        args = parser.parse_args(command_of(policy_settings(tiny(*dtype), tiny_checkpoint, platform)[0])[3:])
        assert args.enable_priority_scheduling and args.disable_priority_preemption
        assert args.schedule_policy in ("fcfs", "lof") and args.default_priority_value == 0  # SGLang's condition
    stream = generate_payload([[1, 2]], SamplingParams(max_new_tokens=3), True, True)
    evaluation = generate_payload([[1, 2]], SamplingParams(max_new_tokens=3, priority=EVAL_PRIORITY), False, False)
    assert "priority" not in stream and evaluation["priority"] == EVAL_PRIORITY > args.default_priority_value
    assert "priority" not in evaluation["sampling_params"]
    arrivals = [("stream", 0), ("stream", 1), ("eval", 2), ("stream", 3), ("eval", 4)]
    queue = [SimpleNamespace(name=f"{who}{t}", priority=evaluation["priority"] if who == "eval" else 0,
                             time_stats=SimpleNamespace(wait_queue_entry_time=float(t))) for who, t in arrivals]
    cache = SimpleNamespace(disable=True, supports_fast_match_prefix=lambda: False)  # --disable-radix-cache's
    monkeypatch.setenv("SGLANG_ENABLE_WAITING_PREFIX_REFRESH", "false")  # the cache's upkeep after the sort
    SchedulePolicy(args.schedule_policy, cache, False, args.enable_priority_scheduling,
                   args.schedule_low_priority_values_first).calc_priority(queue)
    assert [r.name for r in queue] == ["eval2", "eval4", "stream0", "stream1", "stream3"]
