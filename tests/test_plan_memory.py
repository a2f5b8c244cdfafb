"""The planner's per-rank trainer memory against the live Megatron objects of the tiny model.

Every layout (one of them an uneven PP split of a 3-layer variant) builds the tiny Qwen3-MoE
trainer as the RL driver does (DDP with fp32 ``main_grad`` buffers, the distributed optimizer,
routing replay), runs two RL steps of the tiny recipe's shape (512 samples, micro-batches of
exactly ``max_tokens_per_microbatch`` = 4096 tokens) and measures on each rank:

- weights, gradients, optimizer state: exact bytes of the parameters, of the gradient buffers and
  of the Adam moments (+ fp32 master copies) the distributed optimizer holds for its shard;
- activations: the peak of the bytes autograd keeps saved for backward (``saved_tensors_hooks``,
  one count per storage, parameters excluded) during the second step;
- the step's peak: growth of the process's peak resident memory (``VmHWM`` reset through
  ``/proc/self/clear_refs``, after ``malloc_trim``) over the second step, which adds the
  temporaries of forward, backward and the optimizer to the saved activations.

The measured numbers are in docs/planner.md ("Checked against the tiny CPU runs").
"""
from __future__ import annotations

import pytest

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

SAMPLES, PROMPT, RESPONSE, TOP_K = 512, 13, 4, 20  # the tiny recipe: 64 prompts x 8, 3 + eos new tokens
POSITIONS = PROMPT + RESPONSE - 1  # 16 positions a row: 256 rows fill a 4096-token micro-batch

LAYOUTS = {
    "tiny": Layout(),  # recipes/tiny_moe_cpu.yaml: one rank
    # (DP2xEP2, TP2+SP and even PP2 were measured too, docs/planner.md; left out to keep the suite short)
    "pp2_uneven": Layout(world_size=2, pp=2, first_stage_layers=1),  # 3 layers: 1 + 2
}
LAYERS = {"pp2_uneven": 3}  # decoder layers of the tiny model a layout runs (default 2)

# Tolerances, relative to the planner's number:
STATIC = 0.003  # weights / gradients / optimizer: only Megatron's bucket padding (256 elements here)
ACTIVATIONS = 0.15  # saved-for-backward peak against the activation model (measured: +1% to +12%)
# The step's peak resident growth over the activation estimate: the rest is backward temporaries
# (activation gradients, the logits' gradient and softmax) and allocator caching, which the planner
# leaves to trainer.reserved_memory_gb (measured: 1.3x to 2.7x).
STEP_PEAK = (1.0, 3.5)

def synthetic_batch(vocab: int, layers: int, experts: int, topk: int, seed: int = 0):
    """An RLBatch of the tiny recipe's shape: random tokens, the last RESPONSE positions trained,
    ``TOP_K`` kept ids per trained position (the target among them), random distinct routing."""
    import torch

    from megarl.trainer.logprobs import CsrMask
    from megarl.trainer.rl_batch import RLBatch

    gen = torch.Generator().manual_seed(seed)
    B, S = SAMPLES, POSITIONS
    tokens = torch.randint(3, vocab, (B, S), generator=gen)
    targets = torch.randint(3, vocab, (B, S), generator=gen)
    loss_mask = torch.zeros(B, S)
    loss_mask[:, PROMPT - 1:] = 1.0
    routed = torch.rand(B, S, layers, experts, generator=gen).topk(topk, dim=-1).indices
    rows = []
    for b in range(B):
        for s in range(S):
            if s < PROMPT - 1:
                rows.append([])
                continue
            others = torch.randperm(vocab, generator=gen)[:TOP_K].tolist()
            target = int(targets[b, s])
            rows.append(sorted(set(others[:TOP_K - 1] if target not in others else others) | {target}))
    counts = torch.tensor([len(r) for r in rows])
    offsets = torch.zeros(B * S + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    mask = CsrMask(torch.tensor([i for r in rows for i in r], dtype=torch.long), offsets)
    return RLBatch(tokens=tokens.reshape(-1), targets=targets.reshape(-1), loss_mask=loss_mask.reshape(-1),
                   rollout_logprobs=(torch.full((B, S), -3.0) * loss_mask).reshape(-1),
                   staleness=torch.zeros(B * S, dtype=torch.int32),
                   cu_seqlens=torch.arange(B + 1) * S, advantages=torch.randn(B, generator=gen),
                   routed_experts=routed.reshape(B * S, layers, topk).to(torch.int16), sampling_mask=mask)


class _Saved:
    """One tensor autograd saved, held for the meter; releasing it is the meter's free event."""

    def __init__(self, meter: "SavedTensorMeter", ptr: int, tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor.detach()  # no grad_fn: no cycle through the graph

    def __del__(self):
        self.meter.release(self.ptr)


class SavedTensorMeter:
    """Bytes autograd holds for backward, live: each storage counted once, while any saved tensor
    on it is alive; storages in ``exclude`` (parameters, gradient buffers) are not counted.
    Use ``torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)``."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.refs, self.sizes, self.live, self.peak = exclude, {}, {}, 0, 0

    def pack(self, tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self.exclude or ptr == 0:
            return tensor
        if self.refs.get(ptr, 0) == 0:
            self.sizes[ptr] = tensor.untyped_storage().nbytes()
            self.live += self.sizes[ptr]
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Saved(self, ptr, tensor)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.sizes.pop(ptr)


def _proc_status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure_rank(rank, layout, hf_path):
    """This rank's exact static bytes, its peak saved-activation bytes and its step's peak RSS growth."""
    import ctypes
    import gc

    import torch
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from megarl.algos.settings import AlgorithmConfig
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.rl_step import rl_step

    trainable = build_trainable(hf_path, layout, optimizer_settings(default_config(), lr=1e-4),
                                ModelSettings(transformer_impl="local", routing_replay=True))
    hf = AutoConfig.from_pretrained(hf_path)
    batch = synthetic_batch(hf.vocab_size, hf.num_hidden_layers, hf.num_local_experts, hf.num_experts_per_tok)

    def step():
        return rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                       batching=MicroBatching(max_tokens=4096, vocab_size=hf.vocab_size, keep_routing=True,
                                              sequence_parallel=layout.sequence_parallel))

    step()  # the optimizer creates its state on the first step
    params = {id(p): p for chunk in trainable.chunks for p in chunk.parameters()}.values()
    buffers = [b for chunk in trainable.chunks for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers)]
    optimizers = getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
    adam_moments = sum(t.numel() * t.element_size() for o in optimizers for state in o.optimizer.state.values()
                       for name, t in state.items() if name in ("exp_avg", "exp_avg_sq"))
    masters = sum(p.numel() * p.element_size() for o in optimizers for group in o.shard_fp32_from_float16_groups
                  for p in group)
    exclude = {p.untyped_storage().data_ptr() for p in params}
    exclude |= {t.untyped_storage().data_ptr() for b in buffers for t in (b.grad_data, b.param_data) if t is not None}
    meter = SavedTensorMeter(exclude)

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_before = _proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        step()
    peak_growth = (_proc_status_kb("VmHWM") - rss_before) * 1024
    return dict(
        stage=parallel_state.get_pipeline_model_parallel_rank(),
        weights=sum(p.numel() * p.element_size() for p in params),
        param_buffers=sum(b.param_data.numel() * b.param_data.element_size() for b in buffers
                          if b.param_data is not None),
        grads=sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
        grad_buffers=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        optimizer=adam_moments + masters,
        saved_activations=meter.peak,
        step_peak_growth=peak_growth,
    )


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[int, str]:
    """The tiny model's HF checkpoint by number of decoder layers."""
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

    return {2: tiny_checkpoint, 3: str(make_tiny_moe(tmp_path_factory.mktemp("tiny3"), TinyMoeSpec(num_layers=3)))}


@pytest.fixture(scope="module")
def measured(checkpoints):
    return {name: run_ranks(measure_rank, layout, checkpoints[LAYERS.get(name, 2)]) for name, layout in LAYOUTS.items()}


def planned(checkpoints, name: str):
    from megarl.planner.arch import resolve_arch
    from megarl.planner.trainer_memory import trainer_memory

    cfg = planned_config(checkpoints, name)
    return trainer_memory(resolve_arch(cfg), cfg)


def planned_config(checkpoints, name: str, *overrides: str):
    """The tiny recipe as layout ``name`` runs it in these tests (plus ``overrides``)."""
    from megarl.config import load_config

    layout, layers = LAYOUTS[name], LAYERS.get(name, 2)
    first = "null" if layout.first_stage_layers is None else layout.first_stage_layers
    cfg = load_config(["recipe=tiny_moe_cpu", f"model.hf_path={checkpoints[layers]}", f"model.arch.num_layers={layers}",
                       f"parallel.world_size={layout.world_size}", f"parallel.tp={layout.tp}",
                       f"parallel.pp={layout.pp}", f"parallel.ep={layout.ep}", f"parallel.first_stage_layers={first}",
                       f"parallel.sequence_parallel={str(layout.sequence_parallel).lower()}",
                       f"rollout.max_prompt_tokens={PROMPT}", f"rollout.max_new_tokens={RESPONSE}", *overrides])
    assert cfg.trainer.max_tokens_per_microbatch == SAMPLES * POSITIONS // 2
    return cfg


@pytest.mark.parametrize("name", LAYOUTS)
def test_static_memory_equals_the_live_megatron_objects(name, measured, checkpoints):
    """Weights and gradients to the byte before Megatron's bucket padding, and within it after;
    the distributed optimizer's Adam state likewise (its shard of the padded buffer)."""
    stages = planned(checkpoints, name)
    for rank, m in enumerate(measured[name]):
        plan = stages[m["stage"]]
        assert m["weights"] == plan.weights, (name, rank)
        assert m["grads"] == plan.grads, (name, rank)
        assert plan.grads <= m["grad_buffers"] <= plan.grads * (1 + STATIC), (name, rank, m["grad_buffers"])
        assert plan.weights <= m["param_buffers"] <= plan.weights * (1 + STATIC), (name, rank, m["param_buffers"])
        assert abs(m["optimizer"] - plan.optimizer) <= STATIC * plan.optimizer, (name, rank, m["optimizer"],
                                                                                   plan.optimizer)


@pytest.mark.parametrize("name", LAYOUTS)
def test_activation_estimate_against_the_measured_peak(name, measured, checkpoints):
    stages = planned(checkpoints, name)
    for rank, m in enumerate(measured[name]):
        plan = stages[m["stage"]]
        ratio = m["saved_activations"] / plan.activations
        assert abs(ratio - 1) <= ACTIVATIONS, (name, rank, m["saved_activations"], plan.activations)
        growth = m["step_peak_growth"] / plan.activations
        assert STEP_PEAK[0] <= growth <= STEP_PEAK[1], (name, rank, m["step_peak_growth"], plan.activations)


RECOMPUTE = ("none", "selective", "full")


def measure_recompute(rank, layout, hf_path):
    """{recompute: (this rank's gradient after one RL step, peak saved-activation bytes)} for the
    same batch; its routing is random, so only a replayed recompute reproduces the gradients."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from transformers import AutoConfig

    from megarl.algos.settings import AlgorithmConfig
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable
    from megarl.trainer.rl_step import rl_step

    hf = AutoConfig.from_pretrained(hf_path)
    batch = synthetic_batch(hf.vocab_size, hf.num_hidden_layers, hf.num_local_experts, hf.num_experts_per_tok)
    out = {"stage": parallel_state.get_pipeline_model_parallel_rank()}
    for recompute in RECOMPUTE:
        RouterReplay.clear_global_router_replay_instances()
        trainable = build_trainable(hf_path, layout, optimizer_settings(default_config(), lr=0.0),
                                    ModelSettings(transformer_impl="local", routing_replay=True, recompute=recompute))
        params = [p for chunk in trainable.chunks for p in chunk.parameters()]
        meter = SavedTensorMeter({p.untyped_storage().data_ptr() for p in params})
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, batch, AlgorithmConfig(),
                    batching=MicroBatching(max_tokens=SAMPLES * POSITIONS // 2, vocab_size=hf.vocab_size,
                                           keep_routing=True, sequence_parallel=layout.sequence_parallel))
        out[recompute] = (torch.cat([p.main_grad.flatten().clone() for p in params]), meter.peak)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_recompute_replays_routing_and_saves_what_the_planner_predicts(name, checkpoints):
    """Full and selective recompute give the gradients of no recompute (within 1e-6) under Keep
    Routing with routing the model would not choose (two micro-batches: under PP2 the recomputes
    interleave with forwards), and the saved activations drop as the planner's model says."""
    from megarl.planner.arch import resolve_arch
    from megarl.planner.trainer_memory import trainer_memory

    per_rank = run_ranks(measure_recompute, LAYOUTS[name], checkpoints[LAYERS.get(name, 2)])
    for m in per_rank:
        base_grads, base_peak = m["none"]
        for recompute in ("selective", "full"):
            grads, peak = m[recompute]
            assert float((grads - base_grads).abs().max()) <= 1e-6, (name, recompute)
            cfg = planned_config(checkpoints, name, f"trainer.recompute={recompute}")
            plan = trainer_memory(resolve_arch(cfg), cfg)[m["stage"]].activations
            plan_none = planned(checkpoints, name)[m["stage"]].activations
            assert peak < base_peak, (name, recompute, peak, base_peak)
            measured_ratio, planned_ratio = peak / base_peak, plan / plan_none
            assert abs(measured_ratio / planned_ratio - 1) <= ACTIVATIONS, (name, recompute, measured_ratio,
                                                                            planned_ratio)
