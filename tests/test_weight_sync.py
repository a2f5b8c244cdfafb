"""Weight sync into one real SGLang server (CPU) from Megatron trainers under every layout.

For each layout the trainer (Ray actors) takes two RL steps, the weights go to the engine through
the ``distributed`` transport (gloo, flattened buckets), and the engine's greedy continuation and
log-probs for a fixed prompt must equal those of an HF model built from the trainer's own export
(megatron-bridge's full gather); the recovery path then writes the same weights as a disk
checkpoint, whose tensors must equal that export bit for bit (the TP2xEP2 trainer's, into a TP2+EP2
engine, in tests/test_weight_sync_sharded_engine.py). The colocated ``tensor`` transport,
a failed transfer (engine held paused, then recovered), an engine killed mid-sync (reported,
restarted, recovered) and the control round trips of a sync run on the single-process trainer.
The engine is the session's shared one (tests/conftest.py), serving this module's checkpoint; the
kill test, which restarts it, runs last.
"""
import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from hf_oracle import hf_from_state, hf_greedy, load_hf, make_samples
from in_flight import start_decoding
from single_request import generate_one

from megarl.config import default_config, load_config
from megarl.config.components import optimizer_settings
from megarl.engines.client import SGLangClient
from megarl.engines.types import EngineError, PauseMode, SamplingParams
from megarl.parallel import Layout
from megarl.sync import SyncReport, SyncSettings, WeightSync, WeightSyncError
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

BUCKET_MB = 0.25  # the tiny model (1.9 MB) travels in ~8 buckets
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
LAYOUTS = {
    "tp2_sp": Layout(world_size=2, tp=2, sequence_parallel=True),
    "ep2": Layout(world_size=2, ep=2),
    "pp2": Layout(world_size=2, pp=2),
}


@pytest.fixture(scope="module")
def checkpoint(sharp_checkpoint):
    """The tiny MoE checkpoint with its lm_head sharpened (``sharp_checkpoint``, tests/conftest.py): greedy
    choices are not near-ties."""
    return sharp_checkpoint


async def serve(engine, path: str) -> None:
    """Load the checkpoint at ``path`` into ``engine`` as version 0."""
    async with SGLangClient(engine.url, engine.model) as client:
        await client.update_weights_from_disk(path, version=0)


@pytest.fixture(scope="module")
def engine(tiny_engine, checkpoint, tiny_checkpoint):
    """The session's shared engine serving this module's checkpoint (version 0); the tiny
    checkpoint goes back in, as version 0, after the module."""
    asyncio.run(serve(tiny_engine, checkpoint))
    yield tiny_engine
    asyncio.run(serve(tiny_engine, tiny_checkpoint))


@pytest.fixture(scope="module")
def prompt(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint).encode("3+4=")


def rl_steps(group, layout: Layout, checkpoint: str, steps: int, seed: int) -> None:
    """``steps`` RL steps (lr 1e-2, so the weights move visibly) on samples made by the HF model."""
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_batch import build_rl_batch

    hf = load_hf(checkpoint)
    for step in range(steps):
        batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=seed + step))
        batching = MicroBatching(max_tokens=32, vocab_size=hf.config.vocab_size, keep_routing=False,
                                 sequence_parallel=layout.sequence_parallel)
        asyncio.run(group.rl_step(batch, AlgorithmConfig(), batching))


def trained_group(layout: Layout, checkpoint: str, steps: int = 2):
    """A TrainerGroup under ``layout`` after ``steps`` RL steps."""
    from megarl.trainer.actor import TrainerGroup
    from megarl.trainer.model_setup import ModelSettings

    group = TrainerGroup(layout)
    model = ModelSettings("local", "alltoall", routing_replay=False, recompute="none", recompute_num_layers=None,
                          moe_aux_loss_coeff=0.0, reference=False)
    asyncio.run(group.build(checkpoint, optimizer_settings(default_config(), lr=1e-2), model))
    rl_steps(group, layout, checkpoint, steps, seed=0)
    return group


@pytest.fixture(scope="module")
def single(ray_local, checkpoint):
    group = trained_group(Layout(), checkpoint)
    yield group
    group.shutdown()


async def engine_greedy(client: SGLangClient, prompt: list[int]):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return await generate_one(client, prompt, params, return_routed_experts=False, return_sampling_mask=False)


def check_engine_equals_hf(sample, hf_tokens, hf_logprobs, version):
    assert sample.response_ids == hf_tokens
    diff = max(abs(a - b) for a, b in zip(sample.rollout_logprobs.tolist(), hf_logprobs))
    assert diff < LOGPROB_TOLERANCE, f"engine vs HF log-probs differ by {diff}"
    assert sample.model_version.tolist() == [version] * NEW_TOKENS
    return diff


def settings(tmp_path, transport="distributed", bucket_mb=BUCKET_MB, **kw) -> SyncSettings:
    base = SyncSettings.from_config(load_config(["recipe=tiny_moe_cpu"]).sync)  # transport resolved
    return dataclasses.replace(base, transport=transport, bucket_mb=bucket_mb, work_dir=str(tmp_path / "sync"), **kw)


def read_checkpoint(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def sync_and_compare(group, engine, checkpoint, prompt, tmp_path, version, transport="distributed",
                     bucket_mb=BUCKET_MB):
    """Sync, compare the engine with HF built from the trainer's export, recover through disk and
    compare the checkpoint bit for bit. Returns (report, max log-prob diff)."""
    engine_tp = engine.settings.tp
    reference = asyncio.run(group.export_hf_state())
    hf_tokens, hf_logprobs = hf_greedy(hf_from_state(checkpoint, reference, tmp_path), prompt, NEW_TOKENS)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            sync = WeightSync(settings(tmp_path, transport, bucket_mb, engine_tp=engine_tp), group, [client])
            await sync.setup()
            report = await sync.update(version, PauseMode.ABORT)
            after = await engine_greedy(client, prompt)
            engine_version = await client.weight_version()
            await sync.recover(client)  # the disk path: writes v{version} and reloads it
            recovered = await engine_greedy(client, prompt)
            await sync.close()
            return report, after, engine_version, recovered

    report, after, engine_version, recovered = asyncio.run(body())
    assert isinstance(report, SyncReport) and engine_version == version
    diff = check_engine_equals_hf(after, hf_tokens, hf_logprobs, version)
    check_engine_equals_hf(recovered, hf_tokens, hf_logprobs, version)
    base_tokens, base_logprobs = hf_greedy(load_hf(checkpoint), prompt, NEW_TOKENS)
    assert base_tokens != hf_tokens or max(abs(a - b) for a, b in zip(base_logprobs, hf_logprobs)) > 1e-3, \
        "training did not move the weights: the comparison would be vacuous"

    exported = read_checkpoint(tmp_path / "sync" / f"v{version}")
    assert sorted(exported) == sorted(reference)
    unequal = [name for name in reference if not torch.equal(exported[name], reference[name])]
    assert not unequal, f"exported tensors differ from the trainer's gathered parameters: {unequal[:5]}"
    assert report.bytes == sum(t.numel() * t.element_size() for t in reference.values())
    assert report.tensors == len(reference) and report.buckets >= report.bytes // int(BUCKET_MB * 2**20)
    assert report.peak_bucket_bytes <= 2 * max(int(BUCKET_MB * 2**20), report.largest_tensor_bytes)
    print(f"\n[measured] {transport}: {report.bytes / 1e6:.2f} MB in {report.buckets} buckets, "
          f"{report.total_s:.2f} s (gather {report.gather_s:.3f}, convert {report.convert_s:.3f}, "
          f"send {report.send_s:.3f}, load {report.load_s:.3f}); max |engine - HF| log-prob {diff:.1e}")
    return report, diff


def test_single_process_distributed_sync_equals_hf(single, engine, checkpoint, prompt, tmp_path):
    sync_and_compare(single, engine, checkpoint, prompt, tmp_path, version=2)


def test_colocated_tensor_transport_equals_hf(single, engine, checkpoint, prompt, tmp_path):
    rl_steps(single, Layout(), checkpoint, 1, seed=10)
    sync_and_compare(single, engine, checkpoint, prompt, tmp_path, version=3, transport="tensor")


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_consecutive_syncs_through_one_link_equal_hf(transport, single, engine, checkpoint, prompt, tmp_path):
    """Two syncs through one link with a training step between them: on CPU the sender keeps its
    two bucket buffers from the first sync for the second and the engine keeps its receive buffers
    (distributed) or its mappings of the sender's shared memory (tensor); the engine must serve
    exactly the new weights after each sync."""
    versions = {"distributed": (30, 31), "tensor": (32, 33)}[transport]

    async def sync_to(sync, client, version):
        report = await sync.update(version, PauseMode.ABORT)
        return report, await engine_greedy(client, prompt)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            sync = WeightSync(settings(tmp_path, transport), single, [client], initial_version=versions[0] - 1)
            await sync.setup()
            results = []
            for seed, version in enumerate(versions):
                await asyncio.to_thread(rl_steps, single, Layout(), checkpoint, 1, 50 + seed)
                reference = await single.export_hf_state()
                expected = hf_greedy(hf_from_state(checkpoint, reference, tmp_path), prompt, NEW_TOKENS)
                results.append((expected, *await sync_to(sync, client, version)))
            await sync.close()
            return results

    for ((hf_tokens, hf_logprobs), report, after), version in zip(asyncio.run(body()), versions):
        assert report.buckets > 2  # the two buffers take turns
        check_engine_equals_hf(after, hf_tokens, hf_logprobs, version)


LOADS = ("/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weights_from_disk")


def record_calls(client: SGLangClient) -> list:
    """Record every HTTP call of ``client`` as (path, JSON body) from now on."""
    calls, real = [], client._request

    async def recorded(method, path, payload=None):
        calls.append((path, payload))
        return await real(method, path, payload)

    client._request = recorded
    return calls


def record_trainer_calls(trainer, calls: list, monkeypatch,
                         methods=("weight_sync_begin", "weight_sync_next", "weight_sync_send")) -> None:
    """Record each call of ``trainer``'s ``methods`` in ``calls`` as ("trainer", name), when it is made,
    until ``monkeypatch`` undoes it."""
    for name in methods:
        real = getattr(trainer, name)

        async def recorded(*args, _real=real, _name=name, **kwargs):
            calls.append(("trainer", _name))
            return await _real(*args, **kwargs)

        monkeypatch.setattr(trainer, name, recorded)


def test_sync_makes_four_control_round_trips(single, engine, prompt, tmp_path, monkeypatch):
    """A sync costs each engine four control calls (pause, begin, end, continue) around the bucket
    loads; the version and the cache flush ride on the last load, in flight as well as idle; the
    disk transport and recovery through disk take the same four around their one load. The trainer
    begins its side, gathers its first bucket and starts sending it while the engines pause and then open
    their update session.
    Tokens generated afterwards carry the new version; a request running across the sync resumes on
    it (RETRACT)."""
    control = ["/pause_generation", "/begin_weight_update", "/end_weight_update", "/continue_generation"]
    long = SamplingParams(max_new_tokens=56, temperature=1.0, ignore_eos=True)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client, \
                SGLangClient(engine.url, engine.model) as load:
            sync = WeightSync(settings(tmp_path), single, [client])
            await sync.setup()
            calls = record_calls(client)
            record_trainer_calls(single, calls, monkeypatch)
            seen = {}
            for version, mode, in_flight in ((4, PauseMode.ABORT, False), (5, PauseMode.RETRACT, True),
                                             (6, PauseMode.IN_PLACE, False)):
                running = None
                if in_flight:  # decoding when the pause comes
                    running, = await start_decoding(
                        lambda: [asyncio.ensure_future(load.generate_batch(
                            [prompt] * 64, long, group_ids=[""] * 64, return_routed_experts=False,
                            return_sampling_mask=False))], engine.url, engine.settings.api_key)
                calls.clear()
                report = await sync.update(version, mode)
                seen[version] = (list(calls), report, await running if running is not None else None,
                                 await client.weight_version(), await engine_greedy(client, prompt))
            calls.clear()
            await sync.recover(client)
            recovered = list(calls)
            await sync.close()
            disk = WeightSync(settings(tmp_path, "disk"), single, [client], initial_version=6)
            await disk.setup()
            calls.clear()
            await disk.update(7, PauseMode.RETRACT)
            through_disk = (list(calls), await client.weight_version(), await engine_greedy(client, prompt))
            await disk.close()
            return seen, recovered, through_disk

    seen, recovered, (disk_calls, disk_version, disk_after) = asyncio.run(body())
    for version, (calls, report, running, engine_version, after) in seen.items():
        first = [path for path, _ in calls[:5]]  # the first buckets are packed and sent while the engines pause
        assert sorted(first) == ["/begin_weight_update", "/pause_generation", "trainer", "trainer", "trainer"], \
            calls[:6]
        assert first.index("/pause_generation") < first.index("/begin_weight_update"), calls[:6]
        assert [name for path, name in calls[:5] if path == "trainer"] == \
            ["weight_sync_begin", "weight_sync_next", "weight_sync_send"]
        calls = [(path, body) for path, body in calls if path != "trainer"]
        loads = [body for path, body in calls if path in LOADS]
        assert [path for path, _ in calls if path not in LOADS] == control, calls
        assert len(loads) == report.buckets > 1
        assert all("weight_version" not in body and body["flush_cache"] is False for body in loads[:-1])
        assert loads[-1]["weight_version"] == str(version)
        assert loads[-1]["flush_cache"] is (version != 6)  # IN_PLACE: the frozen requests keep their cache
        assert engine_version == version and after.model_version.tolist() == [version] * NEW_TOKENS
        if running is not None:  # retracted and resumed: old version, then the new one, never mixed back
            spans = [sample.model_version.tolist() for sample in running]
            assert all(len(v) == long.max_new_tokens and v == sorted(v) and set(v) <= {4, version} for v in spans)
            across = sum(v[0] == 4 and v[-1] == version for v in spans)
            assert across, "no request was in flight across the sync"
            print(f"\n[measured] {across} of {len(spans)} requests ran across the RETRACT sync "
                  f"({report.total_s * 1e3:.0f} ms in flight)")
    link = ("/destroy_weights_update_group",)  # recover() also drops the link: it forms again at the next sync
    recovered = [(path, body) for path, body in recovered if path != "trainer"]
    assert [path for path, _ in recovered if path not in LOADS + link] == control, recovered
    [disk_load] = [body for path, body in recovered if path in LOADS]
    assert disk_load["weight_version"] == "6" and disk_load["flush_cache"] is True
    assert sorted(path for path, _ in disk_calls[:5]) == ["/begin_weight_update", "/pause_generation"] + \
        ["trainer"] * 3, disk_calls
    disk_calls = [(path, body) for path, body in disk_calls if path != "trainer"]
    assert [path for path, _ in disk_calls] == control[:2] + ["/update_weights_from_disk"] + control[2:], disk_calls
    assert disk_calls[2][1]["weight_version"] == "7" and disk_calls[2][1]["flush_cache"] is True
    assert disk_version == 7 and disk_after.model_version.tolist() == [7] * NEW_TOKENS


def test_engines_open_their_update_session_while_the_trainer_packs(single, engine, tmp_path, monkeypatch):
    """An engine's ``begin_weight_update`` follows its own pause, not the trainer's first bucket: with the
    trainer's packing slowed down, the engine has paused and opened its session before the trainer sends."""
    real_next = single.weight_sync_next

    async def slow_next():
        await asyncio.sleep(0.5)
        return await real_next()

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            sync = WeightSync(settings(tmp_path), single, [client])
            await sync.setup()
            calls = record_calls(client)
            monkeypatch.setattr(single, "weight_sync_next", slow_next)
            record_trainer_calls(single, calls, monkeypatch, methods=("weight_sync_next", "weight_sync_send"))
            await sync.update(8, PauseMode.RETRACT)
            version = await client.weight_version()
            await sync.close()
            return [name if path == "trainer" else path for path, name in calls], version

    names, version = asyncio.run(body())
    assert version == 8
    assert names.index("/pause_generation") < names.index("/begin_weight_update") < names.index("weight_sync_send"), \
        names
    assert names.index("weight_sync_next") < names.index("weight_sync_send") < names.index(LOADS[0]), names


class PauseRefused:
    """An engine that refuses its pause and then answers nothing."""

    base_url = "http://pause-refused.invalid"

    async def pause_generation(self, mode):
        raise EngineError("injected: pause refused")

    async def weight_version(self):
        raise EngineError("injected: unreachable")


def test_a_refused_pause_leaves_no_update_session_open_on_the_others(single, engine, prompt, tmp_path, monkeypatch):
    """One engine refuses its pause while another is still opening its update session: the sync fails once
    every engine's pause and session call has ended, so the other engine's session is closed and it resumes;
    the next sync into it succeeds (a session left open would refuse its ``begin_weight_update``)."""
    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            real_begin = client.begin_weight_update

            async def slow_begin():
                await asyncio.sleep(0.5)
                await real_begin()

            monkeypatch.setattr(client, "begin_weight_update", slow_begin)
            sync = WeightSync(settings(tmp_path), single, [client])
            await sync.setup()
            before = await client.weight_version()
            sync.engines = [PauseRefused(), client]
            with pytest.raises(WeightSyncError, match="pause refused") as failure:
                await sync.update(22, PauseMode.RETRACT)
            resumed = await asyncio.wait_for(engine_greedy(client, prompt), 60)  # a paused engine would not answer
            report = await sync.update(23, PauseMode.RETRACT)
            version = await client.weight_version()
            await sync.close()
            return before, failure.value, resumed, report, version

    before, failure, resumed, report, version = asyncio.run(body())
    assert failure.failed == [PauseRefused.base_url] and failure.held == []
    assert resumed.model_version.tolist() == [before] * NEW_TOKENS  # resumed on its previous weights
    assert report.engines == 1 and version == 23


def test_bucket_waiting_at_session_end_is_loaded(single, engine, checkpoint, prompt, tmp_path, monkeypatch):
    """The engine loads each bucket during the next one's receive (megarl.engine_process.pipelined_load);
    when no load call carries the version (a caller other than megarl's driver), the bucket
    received last is loaded by end_weight_update: every new weight is served, the label unchanged."""
    rl_steps(single, Layout(), checkpoint, 1, seed=40)
    reference = asyncio.run(single.export_hf_state())
    hf_tokens, hf_logprobs = hf_greedy(hf_from_state(checkpoint, reference, tmp_path), prompt, NEW_TOKENS)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            before = await client.weight_version()
            real, loads = client.update_weights_from_distributed, []

            async def without_finish(names, dtypes, shapes, group_name, load_format=None, **finish):
                loads.append(names)
                await real(names, dtypes, shapes, group_name, load_format)  # no version, no flush

            monkeypatch.setattr(client, "update_weights_from_distributed", without_finish)
            two_buckets = dataclasses.replace(settings(tmp_path), bucket_mb=1.0)  # the second: half the model
            sync = WeightSync(two_buckets, single, [client], initial_version=before)
            await sync.setup()
            report = await sync.update(before + 1, PauseMode.ABORT)
            await sync.close()
            await client.flush_cache()
            return before, loads, report, await client.weight_version(), await engine_greedy(client, prompt)

    before, loads, report, version, after = asyncio.run(body())
    assert len(loads) == report.buckets == 2 and any(".self_attn." in name for name in loads[-1])
    assert version == before and after.model_version.tolist() == [before] * NEW_TOKENS
    assert after.response_ids == hf_tokens
    diff = max(abs(a - b) for a, b in zip(after.rollout_logprobs.tolist(), hf_logprobs))
    assert diff < LOGPROB_TOLERANCE, f"engine vs HF log-probs differ by {diff}: a bucket was not loaded"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_sync_equals_hf(name, ray_local, engine, checkpoint, prompt, tmp_path, monkeypatch):
    """Every trainer layout into the one-rank engine (the TP2xEP2 trainer goes into a TP2+EP2 engine, with
    the same checks, in tests/test_weight_sync_sharded_engine.py). PP2 goes in buckets small enough that
    its stages pack different numbers of them (stage 0's embedding travels alone): the stage that has
    sent its last bucket waits while the other sends the rest."""
    group = trained_group(LAYOUTS[name], checkpoint)
    packed, real_next = [], group.weight_sync_next

    async def recorded_next():
        indices = await real_next()
        packed.extend(index.stage for index in indices if index is not None)
        return indices

    monkeypatch.setattr(group, "weight_sync_next", recorded_next)
    try:
        sync_and_compare(group, engine, checkpoint, prompt, tmp_path, version=10 + list(LAYOUTS).index(name),
                         bucket_mb=0.06 if name == "pp2" else BUCKET_MB)
    finally:
        group.shutdown()
    per_stage = [packed.count(stage) for stage in range(LAYOUTS[name].pp)]
    assert all(per_stage) and (name != "pp2" or per_stage[0] != per_stage[1]), per_stage


def test_failed_transfer_holds_the_engine_until_recovered(single, engine, checkpoint, prompt, tmp_path,
                                                          monkeypatch):
    """The engine rejects the second bucket: the sync fails within its timeout, the engine (with
    part of the weights) stays paused and serves nothing until recover() brings it to the version."""
    rl_steps(single, Layout(), checkpoint, 1, seed=20)
    reference = asyncio.run(single.export_hf_state())
    hf_tokens, hf_logprobs = hf_greedy(hf_from_state(checkpoint, reference, tmp_path), prompt, NEW_TOKENS)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            real = client.update_weights_from_distributed
            calls = []

            async def second_bucket_rejected(names, dtypes, shapes, group_name, load_format=None, **finish):
                calls.append(names)
                if len(calls) == 2:
                    raise EngineError("injected: engine rejected the bucket")
                await real(names, dtypes, shapes, group_name, load_format, **finish)

            monkeypatch.setattr(client, "update_weights_from_distributed", second_bucket_rejected)
            sync = WeightSync(settings(tmp_path, timeout_s=20.0), single, [client])
            await sync.setup()
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError, match="injected") as failure:
                await sync.update(21, PauseMode.ABORT)
            failed_after = time.monotonic() - t0
            print(f"\n[measured] rejected bucket: WeightSyncError after {failed_after:.1f} s")
            waiting = asyncio.ensure_future(engine_greedy(client, prompt))
            await asyncio.sleep(1.0)  # ample for the tiny model's few tokens, were the engine not held
            served_while_held = waiting.done()
            monkeypatch.setattr(client, "update_weights_from_distributed", real)
            await sync.recover(client)
            held_request = await asyncio.wait_for(waiting, 60)
            report = await sync.update(22, PauseMode.RETRACT)  # the link forms again after the failure
            after = await engine_greedy(client, prompt)
            await sync.close()
            return failure.value, failed_after, served_while_held, held_request, report, after

    error, failed_after, served_while_held, held_request, report, after = asyncio.run(body())
    assert error.held == [engine.url] and error.failed == [] and error.version == 21
    assert failed_after < 20.0 + 30.0  # the link's timeout bounds the stuck transfer
    assert not served_while_held, "a request was served while the engine held partial weights"
    check_engine_equals_hf(held_request, hf_tokens, hf_logprobs, 21)  # served only after recovery
    assert report.version == 22
    check_engine_equals_hf(after, hf_tokens, hf_logprobs, 22)


def test_engine_killed_during_sync_is_reported_and_recovered(single, engine, checkpoint, prompt, tmp_path,
                                                             monkeypatch):
    """Last in the module (restarts the engine). The engine dies after the first bucket: the sync
    raises WeightSyncError naming it, the restarted engine (same URL) is brought to the version."""
    rl_steps(single, Layout(), checkpoint, 1, seed=30)
    reference = asyncio.run(single.export_hf_state())
    hf_tokens, hf_logprobs = hf_greedy(hf_from_state(checkpoint, reference, tmp_path), prompt, NEW_TOKENS)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            real = client.update_weights_from_distributed
            calls = []

            async def die_after_first_bucket(names, dtypes, shapes, group_name, load_format=None, **finish):
                calls.append(names)
                if len(calls) == 2:
                    os.killpg(engine.pid, signal.SIGKILL)
                await real(names, dtypes, shapes, group_name, load_format, **finish)

            monkeypatch.setattr(client, "update_weights_from_distributed", die_after_first_bucket)
            sync = WeightSync(settings(tmp_path, timeout_s=20.0), single, [client])
            await sync.setup()
            during = asyncio.ensure_future(engine_greedy(client, prompt))
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as failure:
                await sync.update(31, PauseMode.ABORT)
            print(f"\n[measured] engine killed mid-sync: WeightSyncError after {time.monotonic() - t0:.1f} s")
            served = await asyncio.gather(during, return_exceptions=True)
            t0 = time.monotonic()
            monkeypatch.setattr(client, "update_weights_from_distributed", real)
            engine.stop()
            engine.start()  # same port: the same URL
            await sync.recover(client)
            print(f"[measured] restart + recover {time.monotonic() - t0:.1f} s")
            after = await engine_greedy(client, prompt)
            version = await client.weight_version()
            report = await sync.update(32, PauseMode.ABORT)
            again = await engine_greedy(client, prompt)
            await sync.close()
            return failure.value, served[0], after, version, report, again

    error, served, after, version, report, again = asyncio.run(body())
    assert error.failed == [engine.url] and error.held == [] and error.version == 31
    # the request sent during the sync either ran before the pause (old version only) or failed with the engine
    assert isinstance(served, EngineError) or set(served.model_version.tolist()) <= {22}, served
    assert version == 31
    check_engine_equals_hf(after, hf_tokens, hf_logprobs, 31)
    assert report.version == 32
    check_engine_equals_hf(again, hf_tokens, hf_logprobs, 32)
