"""LoRA: adapters trained by megatron-bridge's PEFT under several trainer layouts, synced alone into
a real SGLang CPU engine (``--enable-lora``), and checked against HF transformers with the adapter
merged by hand from the PEFT directory (W + alpha / r * B A, independent of the bridge's merge):
greedy tokens equal, log-probs within 1e-4, routed experts equal. Also: the base stays frozen,
bytes per sync are the adapter's, checkpoints hold adapters only and restore them exactly, and bad
settings fail before anything starts.
"""
import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_oracle import hf_from_state, hf_greedy, load_hf, make_samples, router_topk, sharpened_checkpoint
from in_flight import start_decoding
from lora_runs import ATTENTION, merged_by_hand, read_adapter, trained_group
from single_request import generate_one

from megarl.config import ConfigError, load_config
from megarl.config.platform_rules import refuse_what_is_not_built
from megarl.engines.client import SGLangClient
from megarl.engines.server import EngineSettings, SGLangEngine, lora_serving
from megarl.engines.types import PauseMode, SamplingParams
from megarl.models.lora import LoraConfig, unmatched_targets
from megarl.parallel import Layout
from megarl.sync import AdapterSync, SyncSettings, WeightSyncError
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

LM_HEAD_SCALE = 25.0  # no near-ties in greedy decoding
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
LAYOUTS = {
    "single": Layout(),
    "tp2_sp": Layout(world_size=2, tp=2, sequence_parallel=True),
    "ep2": Layout(world_size=2, ep=2),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    return str(sharpened_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("tiny_moe_lora"), LM_HEAD_SCALE))


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    """A one-rank CPU engine serving LoRA adapters on the attention projections."""
    settings = EngineSettings(model_path=checkpoint, dtype="float32", max_total_tokens=2048,
                              log_path=str(tmp_path_factory.mktemp("sglang_lora") / "server.log"),
                              **lora_serving(ATTENTION))
    with SGLangEngine(settings) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompt(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint).encode("3+4=")


async def engine_greedy(client: SGLangClient, prompt: list[int]):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return await generate_one(client, prompt, params, return_routed_experts=True, return_sampling_mask=False)


async def shared_prefill_copies(client: SGLangClient, prompt: list[int], copies: int = 3):
    """Greedy samples of ``copies`` copies of ``prompt`` in one batch, the prompt prefilled once first,
    on a flushed prefix cache."""
    client.shared_prefill_min_tokens = 1
    await client.flush_cache()
    try:
        return await client.generate_batch([prompt] * copies, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                                              ignore_eos=True),
                                           group_ids=["g"] * copies, return_routed_experts=False,
                                           return_sampling_mask=False)
    finally:
        client.shared_prefill_min_tokens = 0


def sync_settings(tmp_path: Path) -> SyncSettings:
    base = SyncSettings.from_config(load_config(["recipe=tiny_moe_lora_cpu"]).sync)
    return SyncSettings(transport=base.transport, bucket_mb=base.bucket_mb, work_dir=str(tmp_path / "sync"),
                        timeout_s=120.0, engine_tp=1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_synced_adapter_equals_hf_with_the_adapter_merged(name, ray_local, engine, checkpoint, prompt, tmp_path):
    group = trained_group(LAYOUTS[name], checkpoint)
    version = 3 + list(LAYOUTS).index(name)
    try:
        bridge_merged = asyncio.run(group.export_hf_state())  # megatron-bridge's own merge, for the frozen base

        async def body():
            async with SGLangClient(engine.url, engine.model) as client:
                sync = AdapterSync(sync_settings(tmp_path), group, [client])
                report = await sync.update(version, PauseMode.ABORT)
                synced = await engine_greedy(client, prompt)
                copies = await shared_prefill_copies(client, prompt)
                client.adapter = None  # the base model, still served beside the adapter
                base = await engine_greedy(client, prompt)
                await sync.update(version + 10, PauseMode.ABORT)  # the next version replaces it
                return report, synced, copies, base, client.adapter, await client.weight_version()

        report, synced, copies, base, adapter, engine_version = asyncio.run(body())
    finally:
        group.shutdown()
    adapter_dir = tmp_path / "sync" / "adapters" / f"v{version + 10}"
    config, tensors = read_adapter(adapter_dir)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"] and config["r"] == 8
    assert not (tmp_path / "sync" / "adapters" / f"v{version}").exists(), "the older version is not removed"
    assert adapter.name.endswith(f"-v{version + 10}") and adapter.version == version + 10
    assert engine_version == version + 10

    weights = merged_by_hand(checkpoint, adapter_dir)
    for key, tensor in bridge_merged.items():  # the bridge's merge = base + the exported adapter: the base is frozen
        torch.testing.assert_close(tensor, weights[key], atol=1e-6, rtol=0, msg=key)
    hf = hf_from_state(checkpoint, weights, tmp_path)
    hf_tokens, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
    assert synced.response_ids == hf_tokens
    # the prompt prefilled once under the adapter: each copy reads it from the cache and answers as HF merged
    assert [(c.response_ids, c.cached_tokens) for c in copies] == [(hf_tokens, len(prompt) - 1)] * len(copies)
    diff = max(abs(a - b) for a, b in zip(synced.rollout_logprobs.tolist(), hf_logprobs))
    assert diff < LOGPROB_TOLERANCE, f"engine vs HF log-probs differ by {diff}"
    assert synced.model_version.tolist() == [version] * NEW_TOKENS
    ids = torch.tensor(prompt + synced.response_ids)
    expected = router_topk(hf, ids[:-1]).numpy()
    np.testing.assert_array_equal(np.sort(synced.routed_experts, -1), np.sort(expected, -1))

    base_tokens, base_logprobs = hf_greedy(load_hf(checkpoint), prompt, NEW_TOKENS)
    assert base.response_ids == base_tokens
    assert max(abs(a - b) for a, b in zip(base.rollout_logprobs.tolist(), base_logprobs)) < LOGPROB_TOLERANCE
    assert base_tokens != hf_tokens or max(abs(a - b) for a, b in zip(base_logprobs, hf_logprobs)) > 1e-3, \
        "training did not move the adapter: the comparison would be vacuous"

    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    model_bytes = sum(t.numel() * t.element_size() for t in bridge_merged.values())
    assert adapter_bytes <= report.bytes <= adapter_bytes + 64 * 1024  # the tensors plus the safetensors header
    assert report.transport == "adapter" and report.bytes < model_bytes / 20
    assert report.tensors == len(tensors) and report.bytes_per_engine_rank == report.bytes
    assert report.largest_tensor_bytes == max(t.numel() * t.element_size() for t in tensors.values())
    print(f"\n[measured] {name}: adapter sync {report.bytes / 1e3:.1f} kB ({report.bytes / model_bytes:.4f} of the "
          f"{model_bytes / 1e6:.2f} MB model) in {report.total_s:.2f} s; max |engine - HF| log-prob {diff:.1e}")


def test_merged_sync_of_expert_adapters_equals_hf_with_them_merged(ray_local, engine, checkpoint, prompt, tmp_path):
    """``lora.sync=merged``, the fallback where an engine cannot serve the adapters (experts on CPU):
    the base with every adapter merged goes through the distributed transport into the engine (no
    adapter named), which then equals HF with the PEFT export merged by hand; the engine's base is
    put back from disk afterwards."""
    from megarl.sync import WeightSync

    everything = LoraConfig(enabled=True, rank=4, alpha=8, dropout=0.0,
                              target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), sync="merged")
    group = trained_group(Layout(), checkpoint, lora=everything)
    try:
        asyncio.run(group.save_hf_adapter(str(tmp_path / "adapter")))

        async def body():
            async with SGLangClient(engine.url, engine.model) as client:
                sync = WeightSync(dataclasses.replace(sync_settings(tmp_path), transport="distributed"), group,
                                  [client])
                await sync.setup()
                report = await sync.update(50, PauseMode.ABORT)
                merged = await engine_greedy(client, prompt)
                await sync.close()
                await client.update_weights_from_disk(checkpoint, 51)  # the module's other tests serve the base
                return report, merged

        report, merged = asyncio.run(body())
    finally:
        group.shutdown()
    config, tensors = read_adapter(tmp_path / "adapter")
    assert {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"])
    assert any(".experts." in name for name in tensors)
    merged_hf = hf_from_state(checkpoint, merged_by_hand(checkpoint, tmp_path / "adapter"), tmp_path)
    hf_tokens, hf_logprobs = hf_greedy(merged_hf, prompt, NEW_TOKENS)
    assert merged.response_ids == hf_tokens and merged.model_version.tolist() == [50] * NEW_TOKENS
    assert max(abs(a - b) for a, b in zip(merged.rollout_logprobs.tolist(), hf_logprobs)) < LOGPROB_TOLERANCE
    from safetensors.torch import load_file

    base = load_file(Path(checkpoint) / "model.safetensors")
    assert report.bytes == sum(t.numel() * t.element_size() for t in base.values())  # the whole model moves


def kl_to_reference(group, checkpoint: str) -> list[float]:
    """Per sample, the summed low-variance KL of the group's policy to its reference on HF samples."""
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_batch import build_rl_batch

    hf = load_hf(checkpoint)
    batch = build_rl_batch(make_samples(hf, 4, top_k=5, seed=7))
    return asyncio.run(group.sequence_kl(batch, AlgorithmConfig(kl_type="low_var_kl"),
        batching=MicroBatching(max_tokens=32, vocab_size=hf.config.vocab_size, keep_routing=False,
                               sequence_parallel=False)))


def test_checkpoint_holds_adapters_only_and_restores_them(ray_local, checkpoint, tmp_path):
    """Adapters and their optimizer state alone in the checkpoint; restored bit for bit into a fresh
    LoRA model, whose KL reference stays the base."""
    from torch.distributed.checkpoint import FileSystemReader

    from megarl.trainer.checkpoint import step_dir

    trained = trained_group(Layout(), checkpoint)
    try:
        asyncio.run(trained.save_checkpoint(str(tmp_path / "ckpt"), 2, {"consumed_prompts": 16}))
        asyncio.run(trained.save_hf_adapter(str(tmp_path / "before")))
    finally:
        trained.shutdown()
    keys = FileSystemReader(str(step_dir(tmp_path / "ckpt", 2))).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if not k.startswith(("optimizer.", "rng_state", "common_state"))]
    assert model_keys and all(".adapter." in k for k in model_keys), [k for k in model_keys if ".adapter." not in k]
    optimizer_keys = [k for k in keys if k.startswith("optimizer.")]
    assert optimizer_keys and all(".adapter." in k for k in optimizer_keys), optimizer_keys[:5]

    fresh = trained_group(Layout(), checkpoint, steps=0, reference=True)
    try:
        kl_before = kl_to_reference(fresh, checkpoint)
        resumed = asyncio.run(fresh.load_checkpoint(str(tmp_path / "ckpt")))
        asyncio.run(fresh.save_hf_adapter(str(tmp_path / "after")))
        kl_after = kl_to_reference(fresh, checkpoint)
    finally:
        fresh.shutdown()
    # the KL reference is the base (the adapters at zero), held by swapping the adapters alone
    assert all(abs(kl) < 1e-9 for kl in kl_before) and sum(kl_after) > 1e-4, (kl_before, kl_after)
    assert resumed.step == 2 and resumed.data_position == {"consumed_prompts": 16}
    _, before = read_adapter(tmp_path / "before")
    _, after = read_adapter(tmp_path / "after")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(before[k].abs().sum() > 0 for k in before if ".lora_B." in k), "the adapters never moved"


class RandomAdapterTrainer:
    """Writes a random rank-8 PEFT adapter on the attention projections (seeded by the call count)."""

    def __init__(self, checkpoint: str):
        self.hf = load_hf(checkpoint).config
        self.calls = 0

    async def save_hf_adapter(self, out_dir):
        from safetensors.torch import save_file

        self.calls += 1
        gen = torch.Generator().manual_seed(self.calls)
        h, d = self.hf.hidden_size, self.hf.head_dim
        outs = {"q_proj": self.hf.num_attention_heads * d, "k_proj": self.hf.num_key_value_heads * d,
                "v_proj": self.hf.num_key_value_heads * d, "o_proj": h}
        tensors = {}
        for layer in range(self.hf.num_hidden_layers):
            for module, out in outs.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                fan_in = self.hf.num_attention_heads * d if module == "o_proj" else h
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, fan_in, generator=gen) * 0.3
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, 8, generator=gen) * 0.3
        path = Path(out_dir)
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": sorted(outs), "bias": "none",
            "task_type": "CAUSAL_LM"}))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return str(path)


@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.ABORT])
def test_requests_in_flight_keep_their_adapter_and_its_version(mode, engine, checkpoint, prompt, tmp_path):
    """``continue`` (IN_PLACE): requests in flight across a sync finish on the adapter they named, every
    token labelled with its version; ``abort_resubmit`` (ABORT): they come back aborted, labelled so too
    (a request that finished before the abort reached the engine comes back whole)."""
    params = SamplingParams(max_new_tokens=56, temperature=0.0, ignore_eos=True)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            sync = AdapterSync(sync_settings(tmp_path), RandomAdapterTrainer(checkpoint), [client])
            await sync.update(1, mode)
            alone = await generate_one(client, prompt, params, return_routed_experts=False, return_sampling_mask=False)
            finished = {}

            async def one(i):
                sample = await generate_one(client, prompt, params, return_routed_experts=False,
                                            return_sampling_mask=False)
                finished[i] = asyncio.get_running_loop().time()
                return sample

            # 32 requests (within the engine's KV): on a loaded machine 16 could all end before the pause
            in_flight = await start_decoding(lambda: [asyncio.ensure_future(one(i)) for i in range(32)],
                                             engine.url, engine.settings.api_key)
            await sync.update(2, mode)
            synced_at = asyncio.get_running_loop().time()
            samples = await asyncio.gather(*in_flight)
            after = await generate_one(client, prompt, params, return_routed_experts=False, return_sampling_mask=False)
            await sync.close()
            return alone, samples, after, synced_at, finished

    alone, samples, after, synced_at, finished = asyncio.run(body())
    assert after.model_version.tolist() == [2] * 56 and after.response_ids != alone.response_ids
    assert alone.model_version.tolist() == [1] * 56
    for sample in samples:
        assert sample.model_version.tolist() == [1] * len(sample.response_ids)
        assert sample.response_ids == alone.response_ids[:len(sample.response_ids)]
    if mode is PauseMode.ABORT:
        aborted = [s.finish_reason.value == "aborted" for s in samples]
        assert any(aborted), "every request ended before the sync: nothing was in flight"
        assert all(len(s.response_ids) < 56 if cut else len(s.response_ids) == 56 for s, cut in zip(samples, aborted))
    else:
        assert all(len(s.response_ids) == 56 for s in samples)
        assert max(finished.values()) > synced_at, "every request ended before the sync: nothing was in flight"


def test_an_adapter_the_engine_rejects_fails_the_sync_with_its_message(engine, tmp_path):
    """An adapter of a rank above the engine's --max-lora-rank: SGLang's reason reaches the error."""
    from safetensors.torch import save_file

    class TooLargeTrainer:
        async def save_hf_adapter(self, out_dir):
            path = Path(out_dir)
            path.mkdir(parents=True)
            config = {"peft_type": "LORA", "r": 64, "lora_alpha": 64, "target_modules": ["q_proj"],
                      "bias": "none", "task_type": "CAUSAL_LM"}
            (path / "adapter_config.json").write_text(json.dumps(config))
            save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(64, 64),
                       "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 64)},
                      str(path / "adapter_model.safetensors"))
            return str(path)

    async def body():
        async with SGLangClient(engine.url, engine.model) as client:
            sync = AdapterSync(sync_settings(tmp_path), TooLargeTrainer(), [client], initial_version=0)
            version = await client.weight_version()
            with pytest.raises(WeightSyncError, match="rank") as failure:
                await sync.update(1, PauseMode.ABORT)
            assert failure.value.failed == [client.base_url] and sync.engines == []
            assert client.adapter is None and await client.weight_version() == version  # still serving its base
            sample = await engine_greedy(client, [1, 5, 6])
            return sample

    assert len(asyncio.run(body()).response_ids) == NEW_TOKENS


@pytest.mark.parametrize("override, message", [
    ("lora.rank=0", "lora.rank: must be >= 1, got 0"),
    ("lora.target_modules=[linear_q]", "not Megatron linear names"),
    ("lora.sync=weights", "lora.sync"),
    ("lora.dropout=1.5", "lora.dropout"),
    ("lora.target_modules=[linear_qkv,router]", "router"),
])
def test_bad_lora_settings_fail_before_the_run(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["recipe=tiny_moe_lora_cpu", override])


def test_expert_adapters_on_a_cpu_engine_are_refused_with_sglangs_error():
    cfg = load_config(["recipe=tiny_moe_lora_cpu", "lora.target_modules=[linear_qkv,linear_fc1]",
                       "model.make_tiny_if_missing=false"])
    with pytest.raises(ConfigError, match="Triton fused-MoE"):
        refuse_what_is_not_built(cfg)
    merged = load_config(["recipe=tiny_moe_lora_cpu", "lora.target_modules=[linear_qkv,linear_fc1]",
                          "lora.sync=merged"])
    assert lora_serving(LoraConfig.when_enabled(merged.lora)) == {}  # a merged sync serves no adapters


def test_targets_that_match_no_module_are_named():
    names = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1"]
    assert unmatched_targets(["linear_qkv", "*.layers.1.*.linear_fc1", "*.layers.7.*.linear_qkv"], names) == \
        ["*.layers.7.*.linear_qkv"]


def test_engine_rejects_lora_serving_without_targets(checkpoint):
    with pytest.raises(ValueError, match="lora_target_modules"):
        EngineSettings(model_path=checkpoint, lora_max_rank=8)

