"""Engine parallelism passed to SGLang: the settings' rules and command line without a server, then
the tiny MoE served by one engine of 2 ranks with TP2 and with TP2 + EP2 (SGLang's expert-parallel
ranks are tensor-parallel ranks, so EP2 needs TP >= 2), checked against HF transformers: greedy
tokens, log-probs and the routed experts of every token.

TP2 starts an engine for the module; TP2 + EP2 is the session's (``tp2_ep2_engine``,
tests/conftest.py, shared with the weight-sync tests). The prompts are few and short.
"""
import asyncio
import tempfile
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch
from hf_oracle import load_hf, router_topk

from megarl.config import load_config
from megarl.engines.client import SGLangClient
from megarl.engines.server import EngineSettings, SGLangEngine
from megarl.engines.supervisor import client_of
from megarl.engines.types import SamplingParams
from megarl.platform import sglang_cpu

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["3+4=", "9+9=", "0+1="]
MAX_NEW_TOKENS = 5


# --- settings and command line, no server ---------------------------------------------------------

def settings(path, **kwargs) -> EngineSettings:
    return EngineSettings(model_path=str(path), **kwargs)


def flag_values(cmd: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs of a command line (a flag followed by another flag maps to None)."""
    out = {}
    for i, arg in enumerate(cmd):
        if arg.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


@pytest.mark.unit
def test_command_passes_the_parallelism(tiny_checkpoint):
    plain = flag_values(SGLangEngine(settings(tiny_checkpoint)).command())
    assert not {"--tp-size", "--ep-size", "--attn-dp-size", "--nnodes"} & set(plain)

    flags = flag_values(SGLangEngine(settings(tiny_checkpoint, tp=2, ep=2, dp_attention=True, device="cuda")).command())
    assert (flags["--tp-size"], flags["--ep-size"], flags["--attn-dp-size"]) == ("2", "2", "2")
    assert "--nnodes" not in flags
    with pytest.raises(ValueError, match="dp_attention does not run on SGLang's CPU path"):
        SGLangEngine(settings(tiny_checkpoint, tp=2, dp_attention=True, device="cpu"))

    with pytest.raises(ValueError, match="nnodes=2 needs dist_init_addr"):  # the engine's node 0 sets it
        SGLangEngine(settings(tiny_checkpoint, tp=2, nnodes=2, device="cpu"))
    multi = SGLangEngine(settings(tiny_checkpoint, tp=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:25000",
                                  device="cpu"))
    flags = flag_values(multi.command())
    assert (flags["--nnodes"], flags["--node-rank"], flags["--dist-init-addr"]) == ("2", "1", "10.0.0.1:25000")
    assert multi.environment()[sglang_cpu.RANKS_PER_NODE_ENV] == "1"  # 2 TP ranks over 2 nodes
    assert multi.environment()[sglang_cpu.RANKS_ENV] == "2"  # SGLang counts both against the NUMA nodes
    # no CUDA crash diagnostics on CPU (they hold a stopped server up to 65 s)
    assert multi.environment()["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert multi.environment()["CUDA_VISIBLE_DEVICES"] == ""  # a CPU engine never sees a GPU


@pytest.mark.unit
def test_an_engine_never_started_leaves_no_log_file(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a default log goes
    engine = SGLangEngine(settings(tiny_checkpoint))
    engine.command(), engine.environment()
    assert list(tmp_path.iterdir()) == []
    first = engine.log_path
    assert first.parent == tmp_path and first.is_file()  # made on first use
    assert engine.log_path == first and list(tmp_path.iterdir()) == [first]  # once


@pytest.mark.unit
def test_the_topology_gives_the_engines_their_parallelism(tiny_checkpoint, tmp_path):
    from megarl.config.topology import RunTopology, pool_engine_settings
    from megarl.platform.description import Platform

    def policy(*overrides: str, recipe: str = "tiny_moe_cpu") -> list[EngineSettings]:
        cfg = load_config([f"recipe={recipe}", f"model.hf_path={tiny_checkpoint}", f"logging.run_dir={tmp_path}",
                           *overrides])
        topology = RunTopology.from_config(cfg)
        return pool_engine_settings(cfg, topology, topology.policy, Platform.cpu(), None, tiny_checkpoint)

    parallel = ["rollout.num_engines=2", "rollout.engine_tp=2", "rollout.engine_ep=2",
                "rollout.engine_dp_attention=true",
                "rollout.prefix_cache=false", "rollout.mem_fraction_static=0.7", "task.seed=3"]
    s = policy(*parallel)[1]
    assert (s.tp, s.ep, s.dp_attention, s.random_seed, s.prefix_cache, s.nnodes) == (2, 2, True, 4, False, 1)
    # an engine of 2 ranks on nodes of one device: two nodes
    assert policy(*parallel, "cluster.gpus_per_node=1")[1].nnodes == 2
    assert flag_values(SGLangEngine(replace(s, device="cuda")).command())["--mem-fraction-static"] == "0.7"
    assert (s.lora_max_rank, s.lora_target_modules) == (0, ())
    # the shared prefill reaches the engines' clients, and only where the prefix cache it fills is on
    off = client_of(s, "http://127.0.0.1:1")
    shared = policy("rollout.prefix_cache=true", "rollout.shared_prefill_min_tokens=16")[0]
    client = client_of(shared, "http://127.0.0.1:1")
    assert off.shared_prefill_min_tokens == 0
    assert (client.shared_prefill_min_tokens, client.model.vocab_size) == (16, 384)
    for c in (off, client):
        asyncio.run(c.aclose())
    lora = policy(recipe="tiny_moe_lora_cpu")[0]
    assert (lora.lora_max_rank, lora.lora_target_modules) == (8, ("k_proj", "o_proj", "q_proj", "v_proj"))
    assert "--max-loras-per-batch" in SGLangEngine(lora).command()


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 0}, "tp and ep must be >= 1"),
    ({"tp": 2, "ep": 4}, "ep=4 must divide tp=2"),
    ({"tp": 3, "ep": 3}, "must divide the model's 8 experts"),
    ({"dp_attention": True}, "dp_attention needs tp > 1"),
    ({"tp": 8}, "must divide the 4 attention heads"),
    ({"tp": 3, "ep": 1, "nnodes": 2, "dist_init_addr": "h:1"}, "do not split evenly"),
    ({"tp": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank < nnodes"),
    ({"tp": 2, "nnodes": 2, "dist_init_addr": "h"}, "must be host:port"),
    ({"mem_fraction_static": 1.0}, r"mem_fraction_static must be in \(0, 1\)"),
])
def test_parallelism_rules(tiny_checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        settings(tiny_checkpoint, **kwargs)


@pytest.mark.unit
def test_omp_threads_bind_splits_the_cores_evenly():
    assert sglang_cpu.omp_threads_bind(2, [0, 1]) == "0|1"
    assert sglang_cpu.omp_threads_bind(4, [0, 1]) == "0|0|1|1"  # more ranks than cores: neighbours share
    assert sglang_cpu.omp_threads_bind(2, list(range(8))) == "0-3|4-7"
    assert sglang_cpu.omp_threads_bind(3, list(range(8))) == "0-1|2-4|5-7"
    assert sglang_cpu.omp_threads_bind(1, [0, 2, 3, 4, 9]) == "0,2-4,9"
    with pytest.raises(ValueError):
        sglang_cpu.omp_threads_bind(0, [0])


# --- served: TP2 and TP2 + EP2 against HF ---------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(sharp_checkpoint):
    """The tiny MoE checkpoint with its lm_head sharpened (tests/conftest.py): greedy has no near-ties."""
    return sharp_checkpoint


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf(str(checkpoint))


@pytest.fixture(scope="module", params=[(2, 1), (2, 2)], ids=["tp2", "tp2_ep2"])
def engine(request, checkpoint, tmp_path_factory):
    """One engine per configuration (float32, as megarl serves: the run topology's engine settings)."""
    tp, ep = request.param
    # a GPU engine needs one device per rank; with fewer GPUs the layout runs on the CPU path (CI's case)
    device = "cuda" if torch.cuda.device_count() >= tp else "cpu"
    shared = request.getfixturevalue("tp2_ep2_engine") if (tp, ep) == (2, 2) else None
    if shared is not None and shared.device == device:  # the session's (the checkpoint's weights, version 0)
        yield shared
        return
    eng = SGLangEngine(EngineSettings(
        model_path=str(checkpoint), device=device, dtype="float32", max_total_tokens=1024, tp=tp, ep=ep,
        mem_fraction_static=0.75,
        log_path=str(tmp_path_factory.mktemp(f"sglang_tp{tp}_ep{ep}") / "server.log"),
    ))
    eng.start()
    print(f"\n[measured] SGLang TP{tp} EP{ep} start-up {eng.startup_s:.1f} s")
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def samples(engine, checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def main():
        async with SGLangClient(engine.url, engine.model) as client:
            return await client.generate_batch(prompts, greedy, group_ids=[""] * len(prompts),
                                               return_routed_experts=True, return_sampling_mask=False)

    return asyncio.run(main())


def test_engine_runs_the_requested_layout(engine):
    info = httpx.get(engine.url + "/server_info", timeout=10).json()
    assert (info["tp_size"], info["ep_size"]) == (engine.settings.tp, engine.settings.ep)
    assert info["mem_fraction_static"] == engine.settings.mem_fraction_static == 0.75


def test_greedy_tokens_equal_hf(samples, hf_model):
    for sample in samples:
        ids = torch.tensor(sample.prompt_ids)
        with torch.no_grad():
            for _ in range(MAX_NEW_TOKENS):
                ids = torch.cat([ids, hf_model(ids[None]).logits[0, -1].argmax().reshape(1)])
        assert sample.response_ids == ids[len(sample.prompt_ids):].tolist()


def test_logprobs_equal_hf(samples, hf_model):
    worst = 0.0
    for sample in samples:
        ids = torch.tensor(sample.prompt_ids + sample.response_ids)
        p = len(sample.prompt_ids)
        with torch.no_grad():
            log_probs = torch.log_softmax(hf_model(ids[None, :-1]).logits[0].double(), dim=-1)
        expected = log_probs[p - 1:].gather(1, ids[p:, None]).squeeze(1).numpy()
        np.testing.assert_allclose(sample.rollout_logprobs, expected, atol=LOGPROB_TOLERANCE, rtol=0)
        worst = max(worst, float(np.abs(sample.rollout_logprobs - expected).max()))
    print(f"\n[measured] max |log-prob - HF| {worst:.2e} over {sum(len(s.response_ids) for s in samples)} tokens")


def test_routed_experts_equal_hf(samples, hf_model):
    for sample in samples:
        ids = torch.tensor(sample.prompt_ids + sample.response_ids)
        expected = router_topk(hf_model, ids[:-1]).numpy()  # the last token is never fed: no routing row
        assert sample.routed_experts.shape == expected.shape
        np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), np.sort(expected, -1))
