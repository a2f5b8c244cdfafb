"""The steps of tools/gpu_smoke.py, one a process: ``python tools/gpu_smoke_steps.py STEP CHECKPOINT``.

Each prints ``smoke: {json}`` with what it measured and exits 0, or raises. The trainer steps run one
NCCL rank on the first GPU, the model built through megatron-bridge from the tiny MoE checkpoint.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # megarl, and the HF oracle of the tests

import torch  # noqa: E402


def report(**values) -> None:
    print("smoke: " + json.dumps(values), flush=True)


def _join() -> None:
    """One trainer rank on NCCL (``GPU_SMOKE_BACKEND=gloo`` runs a step's body on the host, to check a
    change to this file before a GPU is at hand)."""
    import os

    from megarl.parallel import Layout, free_port
    from megarl.trainer.distributed import init_rank

    init_rank(0, Layout(), "127.0.0.1", free_port("127.0.0.1"), backend=os.environ.get("GPU_SMOKE_BACKEND", "nccl"))


def _settings(dtype: str, lr: float = 1e-3, offload: bool = False):
    from megarl.trainer.optimizer import OptimizerSettings

    return OptimizerSettings(lr=lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10, lr_decay_style="constant",
                             weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0,
                             use_distributed_optimizer=True, dtype=dtype, optimizer_cpu_offload=offload)


def _sft_batch():
    from megarl.trainer.token_batch import token_batch

    gen = torch.Generator().manual_seed(0)
    return token_batch([torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 7, 9, 11, 13, 6)], [2] * 6)


def env(ckpt: str) -> None:
    import importlib.metadata

    from megarl.platform import megatron_cpu
    from megarl.platform.description import detect

    versions = {}
    for dist in ("torch", "transformers", "megatron-core", "megatron-bridge", "transformer-engine", "sglang"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    platform = detect()
    report(gpu=torch.cuda.get_device_name(0), capability=platform.capability, gpus=platform.gpu_count,
           cuda=torch.version.cuda, versions=versions, importable=sorted(platform.importable),
           missing=platform.missing, workarounds=megatron_cpu.apply())


def sft(ckpt: str, impl: str = "local") -> None:
    """Three packed bfloat16 supervised steps (the loss falls) and one padded."""
    from megarl.parallel import Layout
    from megarl.trainer.device import model_device
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.sft_step import supervised_step

    _join()
    t = build_trainable(ckpt, Layout(), _settings("bfloat16"), ModelSettings(transformer_impl=impl))
    batch = _sft_batch()
    packed = [supervised_step(t.chunks, t.optimizer, t.scheduler, batch, 32, pack=True) for _ in range(3)]
    padded = supervised_step(t.chunks, t.optimizer, t.scheduler, batch, 32, pack=False)
    losses = [r.loss for r in packed] + [padded.loss]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[2] < losses[0], f"the loss did not fall: {losses}"
    report(device=str(model_device(t.chunks)), layers=impl, losses=losses,
           grad_norms=[r.grad_norm for r in packed + [padded]])


def _rl_metrics(ckpt: str, dtype: str, impl: str) -> dict:
    from hf_oracle import load_hf, make_samples

    from megarl.algos.settings import AlgorithmConfig
    from megarl.parallel import Layout
    from megarl.trainer.distributed import shutdown_rank
    from megarl.trainer.micro_batching import MicroBatching
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.rl_step import rl_step

    _join()
    try:
        t = build_trainable(ckpt, Layout(), _settings(dtype, lr=0.0),
                            ModelSettings(transformer_impl=impl, routing_replay=True))
        hf = load_hf(ckpt)
        batch = build_rl_batch(make_samples(hf, 8, top_k=5, seed=1))
        out = {}
        for pack in (True, False):
            result = rl_step(t.chunks, t.optimizer, t.scheduler, batch, AlgorithmConfig(),
                             batching=MicroBatching(max_tokens=24, vocab_size=hf.config.vocab_size, keep_routing=True,
                                                    sequence_parallel=False, pack=pack))
            out["packed" if pack else "padded"] = {k: v for k, v in result.metrics.items()
                                                   if k.startswith(("mismatch/", "routing/", "loss"))}
        return out
    finally:
        shutdown_rank()


def rl_replay(ckpt: str, impl: str = "local") -> None:
    """Frozen RL steps on HF-sampled routes and top-k masks: float32 reproduces HF, bfloat16 stays near."""
    fp32, bf16 = _rl_metrics(ckpt, "float32", impl), _rl_metrics(ckpt, "bfloat16", impl)
    for name, metrics in fp32.items():
        assert metrics["mismatch/logprob_abs_diff"] < 1e-4, (name, metrics)
        assert metrics["routing/agreement"] == 1.0, (name, metrics)
    for name, metrics in bf16.items():
        assert metrics["mismatch/logprob_abs_diff"] < 0.1, (name, metrics)
    report(layers=impl, float32=fp32, bfloat16=bf16)


def optimizer_offload(ckpt: str) -> None:
    """Three bfloat16 steps with the Adam state on the GPU and in host memory: the same losses."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megarl.parallel import Layout
    from megarl.trainer.distributed import shutdown_rank
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.sft_step import supervised_step

    runs = {}
    for offload in (False, True):
        _join()
        try:
            t = build_trainable(ckpt, Layout(), _settings("bfloat16", offload=offload),
                                ModelSettings(transformer_impl="local"))
            batch = _sft_batch()
            losses = [supervised_step(t.chunks, t.optimizer, t.scheduler, batch, 32).loss for _ in range(3)]
            inner = [o.optimizer for o in getattr(t.optimizer, "chained_optimizers", [t.optimizer])]
            assert all(isinstance(o, HybridDeviceOptimizer) for o in inner) == offload, inner
            devices = sorted({v.device.type for o in inner for s in o.state.values() for v in s.values()
                              if torch.is_tensor(v) and v.numel() > 1})
            runs[offload] = (losses, devices)
        finally:
            shutdown_rank()
    (on_gpu, gpu_devices), (offloaded, host_devices) = runs[False], runs[True]
    assert gpu_devices == ["cuda"] and host_devices == ["cpu"], (gpu_devices, host_devices)
    assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(on_gpu, offloaded)), (on_gpu, offloaded)
    report(losses_on_gpu=on_gpu, losses_offloaded=offloaded)


def te_layers(ckpt: str) -> None:
    sft(ckpt, "transformer_engine")
    rl_replay(ckpt, "transformer_engine")


def engine_memory(ckpt: str) -> None:
    """One bfloat16 engine with the memory saver: release frees memory, resume takes it back, and after a
    reload the greedy output is the same."""
    import asyncio
    import tempfile

    from megarl.engines.client import SGLangClient
    from megarl.engines.server import EngineSettings, SGLangEngine
    from megarl.engines.types import PauseMode, SamplingParams

    engine = SGLangEngine(EngineSettings(model_path=ckpt, dtype="bfloat16", device="cuda", memory_saver=True,
                                         mem_fraction_static=0.3, log_path=tempfile.mktemp(suffix=".log")))
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, top_k=1)

    def free_gib() -> float:
        return torch.cuda.mem_get_info(0)[0] / 2**30

    async def run() -> dict:
        async with SGLangClient(engine.url, engine.model) as c:
            (before,) = await c.generate_batch([[1, 2, 3, 4]], greedy, group_ids=["smoke"], return_routed_experts=True,
                                                return_sampling_mask=True)
            f0 = free_gib()
            await c.pause_generation(PauseMode.RETRACT)
            await c.release_memory(("kv_cache", "weights"))
            f1 = free_gib()
            await c.resume_memory(("weights",))
            await c.resume_memory(("kv_cache",))
            f2 = free_gib()
            await c.update_weights_from_disk(ckpt, version=1)
            await c.continue_generation()
            (after,) = await c.generate_batch([[1, 2, 3, 4]], greedy, group_ids=["smoke"], return_routed_experts=True,
                                               return_sampling_mask=True)
        assert f1 - f0 > 0.5 and f1 - f2 > 0.5, (f0, f1, f2)
        assert after.response_ids == before.response_ids, (before.response_ids, after.response_ids)
        return {"released_gib": f1 - f0, "resumed_gib": f1 - f2, "tokens": list(before.response_ids)}

    engine.start()
    try:
        report(**asyncio.run(run()))
    finally:
        engine.stop()


def colocated_run(ckpt: str) -> None:
    """Two colocated bfloat16 RL steps (transformer-engine layers, CUDA IPC sync, engines released)."""
    import subprocess
    import tempfile

    from megarl.metrics.sink import read_metrics

    work = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "megarl.train", "recipe=tiny_moe_cpu", f"model.hf_path={ckpt}",
                    "model.dtype=bfloat16", "model.transformer_impl=auto", "placement=colocated",
                    "sync.transport=tensor", "parallel.backend=nccl", "steps=2", "warmup.steps=5",
                    f"warmup.save_hf_path={work / 'warm'}", f"logging.run_dir={work / 'run'}"], check=True, cwd=ROOT)
    rows = [r for r in read_metrics(work / "run") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["sync/version"] == r["step"] for r in rows), rows
    report(steps=len(rows), mismatch=[r.get("mismatch/logprob_abs_diff") for r in rows],
           reserved_gb=[r.get("colocate/trainer_reserved_gb") for r in rows])


if __name__ == "__main__":
    step, checkpoint = sys.argv[1], sys.argv[2]
    globals()[step](checkpoint)
