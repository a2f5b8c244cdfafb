"""Shared fixtures: the tiny demo checkpoint and its warm-up, made once per test session."""
import asyncio
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Ray the tests start or join (the session's cluster, the drivers and fake nodes they start, whose
# environment is this one) runs without token authentication, whatever the machine holds
# (~/.ray/auth_token): the tests set it here rather than depend on launch/test.sh setting it.
os.environ["RAY_AUTH_MODE"] = "disabled"
# Drivers this test process starts (directly or through a shell) end with it, killed or not (megarl.lifetime).
os.environ["MEGARL_END_WITH_PID"] = str(os.getpid())

# tests/tiers.py: every test is marked unit or known to start processes (`pytest -m unit` runs the unit tier).
# pytester: for tests/test_tiers.py.
pytest_plugins = ("tiers", "pytester")

# The files that take longest (by per-file worker seconds of a full run: weight sync, the end-to-end
# runs, the platform scenarios; test_gpu_lock.py reads pip's cached reports and
# the TP2+EP2 engine is one per worker, tp2_ep2_engine), longest first. launch/test.sh hands out whole
# files to two workers in collection order (pytest-xdist --dist loadfile --no-loadscope-reorder); these go
# first, so that the run ends on short files that fill both workers, not on one worker's long file while
# the other idles. Files not listed follow in their own order. A scheduling hint only: a stale list costs
# time, never a test.
LONGEST_FIRST = (
    "test_multinode_faults.py", "test_weight_sync.py", "test_multinode.py", "test_rl_episodes.py",
    "test_rl_resume.py", "test_rl_resume_in_flight.py", "test_weight_update_mid_request.py", "test_rehearsal.py",
    "test_multinode_sharded.py", "test_platform_cpu.py", "test_slurm.py", "test_critic_run.py", "test_no_orphans.py",
    "test_sync_never_hangs.py", "test_rl_resume_lora.py", "test_weight_sync_sharded_engine.py",
    "test_sglang_cpu_fork.py", "test_tensor_route.py", "test_rank_pool.py", "test_sglang_engine.py",
    "test_engine_parallel.py",
    "test_rollout_pool.py", "test_rl_sync.py", "test_config.py", "test_layouts.py", "test_weight_sync_sharded.py",
    "test_weight_sync_sharded_dp_attention.py",
    "test_sglang_cpu_compat.py", "test_lora.py", "test_config_keys.py", "test_critic.py",
    "test_distillation_bench.py", "test_weight_sync_delta.py", "test_colocated.py", "test_checkpoint.py",
    "test_config_errors.py", "test_rollout_manager.py", "test_convert.py",
)


def pytest_collection_modifyitems(config, items):
    """Put the files of LONGEST_FIRST first, in its order (a stable sort: tests keep their order in a file)."""
    position = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.path.name, len(position)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The demo's tiny Qwen3-MoE (random init) as an HF checkpoint directory."""
    from megarl.models.tiny_moe import make_tiny_moe

    return str(make_tiny_moe(tmp_path_factory.mktemp("tiny_moe")))


@pytest.fixture(scope="session")
def tied_checkpoint(tmp_path_factory):
    """The tiny MoE with tied embeddings (the output projection is the embedding table, stored once) and
    four layers (two pipeline stages of two virtual stages each), random init. For the trainer only: SGLang's
    Qwen3-MoE model does not tie them, and a run refuses to serve it (``megarl/config/inputs.py``)."""
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

    spec = TinyMoeSpec(num_layers=4, tie_word_embeddings=True)
    return str(make_tiny_moe(tmp_path_factory.mktemp("tiny_moe_tied"), spec))


@pytest.fixture(scope="session")
def warmed_up(tmp_path_factory, worker_id, ray_session):
    """The demo's supervised warm-up (30 steps through the real driver), run once per test run: the first
    pytest-xdist worker to ask makes it (under a file lock in the run's temporary directory), the others
    wait for it and read it. Its ``overrides`` name the base and warmed-up checkpoints; the runs only read
    them."""
    from types import SimpleNamespace

    from filelock import FileLock

    from megarl.train import main

    # a directory of this run that every worker sees: the workers' base directories' parent
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    root = shared / "warmed_up"
    base, warm, run = root / "base", root / "warm", root / "warmup"
    overrides = [f"model.hf_path={base}", "model.make_tiny_if_missing=true", f"warmup.save_hf_path={warm}"]
    with FileLock(str(shared / "warmed_up.lock")):
        if not (root / "done").is_file():
            assert main(["recipe=tiny_moe_cpu", "mode=warmup", "warmup.steps=30", f"logging.run_dir={run}",
                         *overrides]) == 0
            (root / "done").touch()
    return SimpleNamespace(base=base, warm=warm, run=run, overrides=overrides)


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    """The tiny checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_engine_started(tiny_checkpoint, tmp_path_factory):
    """(engine, its :class:`engine_start_cpu.StartUpCpu`) of :func:`tiny_engine`: the start-up CPU is
    read when it turned healthy, before any test used it (tests/test_sglang_cpu_fork.py compares it)."""
    from engine_start_cpu import start_up_cpu

    from megarl.engines.server import EngineSettings, SGLangEngine

    settings = EngineSettings(model_path=tiny_checkpoint, dtype="float32", max_total_tokens=4096,
                              log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"))
    with SGLangEngine(settings) as eng:
        yield eng, start_up_cpu(eng.pid)


@pytest.fixture(scope="session")
def tiny_engine(tiny_engine_started):
    """One SGLang CPU engine serving the tiny checkpoint (4096 KV tokens), shared by the
    modules of a session (per pytest-xdist worker). A module that loads other weights into it puts the
    tiny checkpoint back, as version 0, when it is done."""
    return tiny_engine_started[0]


@pytest.fixture(scope="session")
def sharp_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with its lm_head scaled by 25 (tests/hf_oracle.py): greedy has no near-ties."""
    from hf_oracle import sharpened_checkpoint

    return str(sharpened_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("tiny_moe_sharp"), 25.0))


@pytest.fixture(scope="session")
def tp2_ep2_engine(sharp_checkpoint, tmp_path_factory):
    """One SGLang engine of two ranks, TP2 with the experts split EP2, serving ``sharp_checkpoint``
    (float32, 2048 KV tokens, ``mem_fraction_static`` 0.75), shared by the modules of a session as
    ``tiny_engine`` is: a module that loads other weights puts the checkpoint back, as version 0."""
    from megarl.engines.server import EngineSettings, SGLangEngine

    settings = EngineSettings(model_path=sharp_checkpoint, dtype="float32", max_total_tokens=2048, tp=2, ep=2,
                              mem_fraction_static=0.75,
                              log_path=str(tmp_path_factory.mktemp("sglang_tp2_ep2") / "server.log"))
    with SGLangEngine(settings) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine(tiny_engine):
    """The engine a module's ``client`` talks to: the shared tiny one, unless the module brings its own."""
    return tiny_engine


@pytest.fixture(scope="module")
def client(engine, loop):
    """A client of the module's ``engine`` on the module's event loop."""
    from megarl.engines.client import SGLangClient

    client = SGLangClient(engine.url, engine.model)
    yield client
    loop.run_until_complete(client.aclose())


@pytest.fixture(scope="module")
def loop():
    """One event loop per module: an HTTP client's connections belong to the loop that made them."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster per test process (each pytest-xdist worker), started by the first module
    that asks for it (:func:`ray_local`) and kept to the end. 8 logical CPUs: the largest layout's
    ranks and a run's engines. The ranks' environment is this process's when it starts
    (``run_ranks(env=...)`` for more, in processes of their own). Trainer-rank processes are kept
    between the runs (:func:`megarl.trainer.rank_pool.keep_ranks`; ~4-5 CPU-s of imports each)."""
    import ray

    from megarl.trainer.rank_pool import keep_ranks

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    with keep_ranks():
        yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(ray_session):
    """The test process's Ray for a module's runs (``run_ranks``, ``megarl.train.main``): they use a
    connected Ray and leave it connected (:func:`megarl.trainer.launch.ray_for_run`) where each would
    start and stop a cluster (~4 CPU-s). By the module's end its runs and fixtures must have released
    what they reserved: a leaked actor or placement group would starve the next module's runs."""
    from ray_held import held_resources

    yield
    held = held_resources()
    if held:
        pytest.fail(f"the module left resources reserved on the shared Ray: {held}")


@pytest.fixture(scope="module")
def fake_nodes(request):
    """Fake nodes (megarl/rehearsal/fake_nodes.py): ``FAKE_NODE_COUNT`` (a module global, default 3) network
    namespaces on one bridge, shared by the module and removed after it, failed tests included.
    Without root or iproute2 the module's tests fail, naming what is missing (the project's machines
    and CI have both)."""
    from megarl.rehearsal import fake_nodes as netns

    missing = netns.missing_prerequisite()
    if missing is not None:
        pytest.fail(f"multi-node tests need root and iproute2: {missing}")
    nodes = netns.FakeNodes(getattr(request.module, "FAKE_NODE_COUNT", 3))
    with nodes:
        yield nodes
    assert not nodes.leftovers(), f"fake nodes left behind: {nodes.leftovers()}"
