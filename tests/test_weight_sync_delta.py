"""Delta weight sync (``sync.delta``) into a real bf16 SGLang engine (CPU) from a bf16 trainer.

The tiny recipe's model in bf16 (``model.dtype=bfloat16``) takes RL steps at a small lr (``LR``: a few
per cent of the bf16 elements change per step, as in a real run's steps; the recipe's lr changes
most of the tiny model's, whose buckets then travel whole); after each
step a delta sync brings the engine to the new version, and the engine's parameters (SGLang's own
per-parameter hashes, ``/weights_checker``) must equal those it holds after a whole sync of the same
trainer weights (the trainer's export). Half the steps sync through the ``distributed`` transport (the
whole reference syncs through ``tensor``), half the other way round.
"""
import asyncio
import dataclasses

import httpx
import pytest
from hf_oracle import load_hf, make_samples

from megarl.config import load_config
from megarl.config.components import optimizer_settings
from megarl.engines.client import SGLangClient
from megarl.engines.server import EngineSettings, SGLangEngine
from megarl.engines.types import PauseMode
from megarl.parallel import Layout
from megarl.sync import SyncSettings, WeightSync
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 20  # RL steps, each followed by a delta sync and a whole one to compare with
LR = 1e-5
BUCKET_MB = 0.25  # the tiny model travels in several buckets
OVERRIDES = ["recipe=tiny_moe_cpu", "model.dtype=bfloat16"]


@pytest.fixture(scope="module")
def bf16_engine(tiny_checkpoint, tmp_path_factory):
    settings = EngineSettings(model_path=tiny_checkpoint, dtype="bfloat16", max_total_tokens=1024,
                              log_path=str(tmp_path_factory.mktemp("sglang_bf16") / "server.log"))
    with SGLangEngine(settings) as eng:
        yield eng


@pytest.fixture(scope="module")
def bf16_trainer(tiny_checkpoint):
    from megarl.trainer.actor import TrainerGroup
    from megarl.trainer.model_setup import ModelSettings

    cfg = load_config(OVERRIDES)
    group = TrainerGroup(Layout())
    model = ModelSettings("local", "alltoall", routing_replay=False, recompute="none", recompute_num_layers=None,
                          moe_aux_loss_coeff=0.0, reference=False)
    asyncio.run(group.build(tiny_checkpoint, optimizer_settings(cfg, lr=LR), model))
    yield group
    group.shutdown()


def rl_step(group, hf, seed: int) -> None:
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_batch import build_rl_batch

    batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=seed))
    asyncio.run(group.rl_step(batch, AlgorithmConfig(), batching=MicroBatching(max_tokens=32,
                                                                               vocab_size=hf.config.vocab_size,
                              keep_routing=False, sequence_parallel=False)))


def sync_settings(tmp_path, transport: str, delta: bool) -> SyncSettings:
    base = SyncSettings.from_config(load_config(OVERRIDES).sync)
    return dataclasses.replace(base, transport=transport, bucket_mb=BUCKET_MB, work_dir=str(tmp_path / "sync"),
                               delta=delta)


async def engine_hashes(client: SGLangClient) -> dict[str, str]:
    """SGLang's hash of every parameter the engine holds (``/weights_checker``, action ``checksum``)."""
    async with httpx.AsyncClient(base_url=client.base_url, timeout=120) as http:
        response = await http.post("/weights_checker", json={"action": "checksum"})
    response.raise_for_status()
    (rank,) = response.json()["ranks"]
    return rank["checksums"]


def test_delta_syncs_leave_the_engine_bit_identical_to_whole_syncs(bf16_trainer, bf16_engine, tiny_checkpoint,
                                                                    tmp_path):
    hf = load_hf(tiny_checkpoint)

    async def body():
        async with SGLangClient(bf16_engine.url, bf16_engine.model) as client:
            results = []
            halves = (("distributed", "tensor", range(1, STEPS // 2 + 1)),
                      ("tensor", "distributed", range(STEPS // 2 + 1, STEPS + 1)))
            for delta_transport, whole_transport, steps in halves:
                delta = WeightSync(sync_settings(tmp_path, delta_transport, True), bf16_trainer, [client])
                whole = WeightSync(sync_settings(tmp_path, whole_transport, False), bf16_trainer, [client])
                for step in steps:
                    await asyncio.to_thread(rl_step, bf16_trainer, hf, step)
                    report = await delta.update(step, PauseMode.ABORT)
                    after_delta = await engine_hashes(client)
                    await whole.update(step, PauseMode.ABORT)
                    results.append((step, report, after_delta, await engine_hashes(client)))
                await delta.close()
                await whole.close()
            return results

    results = asyncio.run(body())
    previous = None
    for step, report, after_delta, after_whole in results:
        assert after_delta == after_whole, f"step {step}: delta-synced parameters differ from a whole sync's"
        assert after_delta != previous, f"step {step}: the weights did not change (the comparison would be vacuous)"
        previous = after_delta
        first_of_link = step in (1, STEPS // 2 + 1)
        assert report.delta is not first_of_link  # each link's first sync goes whole: no baseline yet
        if report.delta:
            assert report.bytes < report.dense_bytes and 0 < report.changed_elements < report.elements
        print(f"[measured] step {step} {report.transport}: delta={report.delta} {report.bytes / 1e3:.1f} kB of "
              f"{report.dense_bytes / 1e3:.1f} kB, {report.changed_elements / report.elements:.4f} of the elements")
