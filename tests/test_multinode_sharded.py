"""Sharded resharding across fake nodes (megarl/rehearsal/fake_nodes.py): a TP2xEP2 trainer of four ranks on
nodes 0 and 1 (two each) syncs into one TP2+EP2 SGLang engine on node 2 through ``sync.transport=sharded``
(gloo over the bridge: every trainer rank sends its own slices straight to the engine rank that loads them).

The trainer starts from the tiny checkpoint with its head sharpened, the engine from the plain one, so the
engine's log-probs differ until the sync. After it the engine's greedy tokens, routed experts and
log-probs equal those of an HF model built from the trainer's gathered export, and each engine rank
received at most 0.55 of the model's bytes (the senders' counters, in the sync report); a ``distributed``
sync of the same weights then gives the same answers with the whole model per engine rank. Placement: Ray
custom resources ``megarl_trainer`` (two) on nodes 0 and 1, ``megarl_engine`` on node 2."""
from __future__ import annotations

import json
import shutil
import time

import numpy as np
import torch
from test_multinode import PYTHON, ROOT, node_env, ray_cluster  # noqa: F401

ROLES = {0: {"megarl_trainer": 2}, 1: {"megarl_trainer": 2}, 2: {"megarl_engine": 1}}  # read by ray_cluster
LM_HEAD_SCALE = 5.0  # the trainer's head: log-probs move visibly, logits stay small (float32 rounding)
LOGPROB_TOLERANCE = 2e-6
MOST_PER_ENGINE_RANK = 0.55

# Run in node 0 against the cluster: the trainer, the engine, one sharded sync, one greedy answer.
DRIVER = r"""
import asyncio, dataclasses, json, sys
import ray
from safetensors.torch import save_file
from megarl.config import default_config, load_config
from megarl.config.components import optimizer_settings
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
from megarl.engines.types import PauseMode, SamplingParams
from megarl.parallel import Layout
from megarl.sync import SyncSettings, WeightSync
from megarl.trainer.actor import TrainerGroup
from megarl.trainer.model_setup import ModelSettings
from megarl.trainer.optimizer import OptimizerSettings
trainer_model, engine_model, prompt, out_dir = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
ray.init(address="auto")

async def answer(client):
    (s,) = await client.generate_batch([prompt], GREEDY, group_ids=[''], return_routed_experts=True,
                                      return_sampling_mask=False)
    return {"tokens": s.response_ids, "logprobs": [float(x) for x in s.rollout_logprobs],
            "experts": s.routed_experts.tolist()}

async def main():
    group = TrainerGroup(Layout(world_size=4, tp=2, ep=2))
    model = ModelSettings("local", "alltoall", routing_replay=False, recompute="none", recompute_num_layers=None,
                          moe_aux_loss_coeff=0.0, reference=False)
    await group.build(trainer_model, optimizer_settings(default_config()), model)
    settings = EngineSettings(model_path=engine_model, dtype="float32", max_total_tokens=1024, tp=2, ep=2,
                              device="cpu", log_path=out_dir + "/engine.log")
    pool = await EnginePool.launch([settings], num_cpus=0.5)
    try:
        client = pool.clients[0]
        out = {"trainer_nodes": await group.node_addresses(), "engine_node": ray.get(pool.actors[0].info.remote()).node,
               "before": await answer(client)}
        save_file(await group.export_hf_state(), out_dir + "/model.safetensors", metadata={"format": "pt"})
        base = SyncSettings.from_config(load_config(["recipe=tiny_moe_cpu"]).sync, engine_tp=2)
        for version, transport in enumerate(("sharded", "distributed"), start=1):
            sync = WeightSync(dataclasses.replace(base, transport=transport, bucket_mb=0.25, timeout_s=300,
                                                  work_dir=out_dir + "/sync"), group, [client], version - 1)
            await sync.setup()
            report = await sync.update(version, PauseMode.ABORT)
            await sync.close()
            out[transport] = {"answer": await answer(client), "bytes_per_engine_rank": report.bytes_per_engine_rank,
                              "seconds": report.total_s, "transport": report.transport}
    finally:
        await pool.aclose()
        group.shutdown()
    print("RESULT " + json.dumps(out), flush=True)

asyncio.run(main())
"""


def test_tp2_ep2_trainer_on_two_nodes_into_tp2_ep2_engine_on_a_third(fake_nodes, ray_cluster,  # noqa: F811
                                                                      tiny_checkpoint, tmp_path):
    from hf_oracle import load_hf, router_topk, sharpened_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    (tmp_path / "sharp").mkdir()
    trainer_model = str(sharpened_checkpoint(tiny_checkpoint, tmp_path / "sharp", LM_HEAD_SCALE))
    prompt = AutoTokenizer.from_pretrained(tiny_checkpoint).encode("3+4=")
    started = time.monotonic()
    argv = [PYTHON, "-c", DRIVER, trainer_model, tiny_checkpoint, json.dumps(prompt), str(tmp_path)]
    driver = fake_nodes[0].run(argv, env=node_env(RAY_ADDRESS=ray_cluster["address"]), cwd=ROOT, capture_output=True,
                               text=True, timeout=900)
    print(f"\n[measured] trainer and engine start, one sharded sync over three nodes: "
          f"{time.monotonic() - started:.0f} s")
    assert driver.returncode == 0, (driver.stdout + driver.stderr)[-8000:]
    result = json.loads(next(line for line in driver.stdout.splitlines() if line.startswith("RESULT "))[7:])
    addresses = [node.address for node in fake_nodes]
    assert sorted(result["trainer_nodes"]) == sorted(addresses[:2] * 2) and result["engine_node"] == addresses[2]
    after, whole = result["sharded"]["answer"], result["distributed"]["answer"]
    reference = load_file(tmp_path / "model.safetensors")
    shutil.copy(f"{trainer_model}/config.json", tmp_path / "config.json")
    hf = load_hf(str(tmp_path))  # the trainer's gathered export
    ids = torch.tensor(prompt + after["tokens"])
    with torch.no_grad():
        log_probs = torch.log_softmax(hf(ids[None, :-1]).logits[0].float(), dim=-1)[len(prompt) - 1:]
    assert after["tokens"] == log_probs.argmax(-1).tolist()
    moved = max(abs(a - b) for a, b in zip(result["before"]["logprobs"], after["logprobs"]))
    assert moved > 1e-3, "the engine served the trainer's weights before the sync: the check would be vacuous"
    expected = log_probs.gather(1, ids[len(prompt):, None]).squeeze(1).tolist()
    diff = max(abs(a - b) for a, b in zip(after["logprobs"], expected))
    assert diff < LOGPROB_TOLERANCE, f"engine vs HF log-probs differ by {diff}"
    routed = router_topk(hf, ids[:-1]).sort(-1).values.numpy()
    np.testing.assert_array_equal(np.sort(np.array(after["experts"]), -1), routed)
    assert whole == after, "the engine answers differently after a distributed sync of the same weights"
    model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    sharded, broadcast = result["sharded"], result["distributed"]
    assert sharded["transport"] == "sharded" and broadcast["bytes_per_engine_rank"] == model_bytes
    assert sharded["bytes_per_engine_rank"] <= MOST_PER_ENGINE_RANK * model_bytes, sharded["bytes_per_engine_rank"]
    print(f"[measured] bytes per engine rank: {sharded['bytes_per_engine_rank'] / model_bytes:.3f} of the model "
          f"(distributed: 1.0); sync {sharded['seconds']:.1f} s (distributed {broadcast['seconds']:.1f} s); "
          f"max |engine - HF| log-prob {diff:.1e}")
