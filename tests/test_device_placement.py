"""The trainer's steps on a model that does not live on the host.

No accelerator is here, so two stand-ins show what a GPU rank would meet:
- a model whose parameters are on torch's ``meta`` device: every tensor the supervised and RL steps
  hand it (tokens, positions, THD boundaries) must be on that device, not the host's;
- on that model (its forward and loss stood in for: they cannot run on ``meta``), an RL step moves each
  micro-batch to the device when the schedule reaches it: at every forward the device holds the routes and
  sampling masks of at most two micro-batches, and the routers' replay lists no more;
- the steps run with every tensor that their device-side code (the forward and loss functions, the
  reductions: :data:`DEVICE_SIDE`) creates without naming a device put on ``meta``: such a tensor
  meets the host tensors of the model and the gloo collectives in a device mismatch, so the steps
  complete (with the numbers of a run without the stand-in) only when every tensor is created on the
  device of what it meets and every collective on its group's device. The host-side planning
  (micro-batch plans, selection, model inputs before they move) is left on the host.
"""
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks
from megarl.trainer.micro_batching import MicroBatching

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)


class _ReachedModel(Exception):
    pass


# Files (under megarl/) and functions whose unplaced tensors would be on a GPU rank's host.
DEVICE_SIDE_FILES = ("trainer/rl_step.py", "trainer/routing_replay.py", "trainer/sft_step.py", "trainer/mismatch.py",
                     "trainer/logprobs.py", "algos/")
DEVICE_SIDE_FUNCTIONS = {("trainer/packing.py", "scatter"), ("trainer/packing.py", "to_grid")}
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.as_tensor,
             torch.randn, torch.rand, torch.eye, torch.linspace}


class UnplacedToMeta(TorchFunctionMode):
    """Puts a factory call without ``device`` on ``meta`` when the code that made it is megarl's device-side
    code (a library's calls are left alone)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None and self._device_side():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)

    @staticmethod
    def _device_side() -> bool:
        frame = sys._getframe(2)
        while frame is not None and "/torch/" in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is None or "/megarl/" not in frame.f_code.co_filename:
            return False  # a library's own tensor
        path = frame.f_code.co_filename.split("/megarl/")[-1]
        return path.startswith(DEVICE_SIDE_FILES) or (path, frame.f_code.co_name) in DEVICE_SIDE_FUNCTIONS


def _build(hf_path):
    import torch

    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable

    torch.manual_seed(0)
    return build_trainable(hf_path, Layout(), optimizer_settings(default_config(), lr=1e-3),
                           ModelSettings(transformer_impl="local", routing_replay=True))


def _batches(hf_path):
    """(a supervised TokenBatch, an RLBatch with routing and sampling masks) from the HF model."""
    import torch
    from hf_oracle import make_samples
    from transformers import AutoModelForCausalLM

    from megarl.trainer.rl_batch import build_rl_batch
    from megarl.trainer.token_batch import token_batch

    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 7, 9, 11)]
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    return token_batch(sequences, [2] * 4), build_rl_batch(make_samples(hf, 4, top_k=5, seed=1))


def _steps(trainable, sft_batch, rl_batch, vocab_size):
    """(supervised loss, RL metrics without perf/) of one step each, packed."""
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_step import rl_step
    from megarl.trainer.sft_step import supervised_step

    sft = supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, sft_batch, 24, pack=True)
    rl = rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, rl_batch, AlgorithmConfig(),
                 batching=MicroBatching(max_tokens=24, vocab_size=vocab_size, keep_routing=True,
                                        sequence_parallel=False))
    return sft.loss, {k: v for k, v in rl.metrics.items() if not k.startswith("perf/")}


def inputs_on_meta_model(rank, layout, hf_path):
    """{step: the devices of every tensor the model received} with the model's parameters on meta."""
    trainable = _build(hf_path)
    sft_batch, rl_batch = _batches(hf_path)
    seen = {}

    def record(module, args, kwargs):
        params = kwargs.get("packed_seq_params")
        tensors = [*args, *kwargs.values(), *(vars(params).values() if params is not None else ())]
        seen["devices"] = sorted({str(t.device) for t in tensors if isinstance(t, torch.Tensor)})
        raise _ReachedModel

    for chunk in trainable.chunks:
        chunk.to("meta")
        chunk.register_forward_pre_hook(record, with_kwargs=True)
    out = {}
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.rl_step import rl_step
    from megarl.trainer.sft_step import supervised_step

    for name, step in (
        ("sft", lambda: supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, sft_batch, 24)),
        ("rl", lambda: rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, rl_batch, AlgorithmConfig(),
                               batching=MicroBatching(max_tokens=24, vocab_size=256, keep_routing=True,
                                                      sequence_parallel=False))),
    ):
        seen.clear()
        with pytest.raises(_ReachedModel):
            step()
        out[name] = seen["devices"]
    return out


def micro_batches_on_meta(rank, layout, hf_path):
    """For each forward of a Keep Routing RL step on the model placed on ``meta``, its micro-batches each
    one sample: (micro-batches whose routes the device holds, whose sampling masks it holds, the longest
    replay list of any router)."""
    import weakref

    import megarl.trainer.optimizer as optimizer
    import megarl.trainer.rl_step as rl_step_module
    from megarl.algos.settings import AlgorithmConfig
    from megarl.trainer.mismatch import empty_mismatch
    from megarl.trainer.rl_batch import RLBatch
    from megarl.trainer.routing_replay import replay_routers

    trainable = _build(hf_path)
    _, rl_batch = _batches(hf_path)
    moved, seen = [], []
    to = RLBatch.to

    def recorded_to(batch, device):
        out = to(batch, device)
        if out.routed_experts.is_meta:
            moved.append((weakref.ref(out.routed_experts), weakref.ref(out.sampling_mask.ids)))
        return out

    def forward(tokens, position_ids, attention_mask, packed_seq_params=None, padding_mask=None):
        seen.append((sum(routes() is not None for routes, _ in moved), sum(ids() is not None for _, ids in moved),
                     max(len(r.replay_backward_list) for r in replay_routers())))
        return torch.zeros(*tokens.shape, 384, device="meta")

    def loss(output, *, mb, setup, **_):  # host tensors: megatron keeps the loss scale process-wide
        return torch.zeros(()), torch.tensor(len(mb.tokens)), {
            "sums": torch.zeros(len(setup.sum_keys), dtype=torch.float64),
            "maxima": torch.full((len(setup.max_keys),), -float("inf"), dtype=torch.float64),
            "mismatch": empty_mismatch(torch.device("cpu"))}

    class HostLoadCounter(rl_step_module.LoadCounter):  # counts on meta have no data to reduce
        @classmethod
        def for_model(cls, chunks):
            counter = super().for_model(chunks)
            counter.counts = torch.zeros_like(counter.counts, device="cpu")
            return counter

    for chunk in trainable.chunks:
        chunk.to("meta")
        chunk.forward = forward
    stand_ins = [(RLBatch, "to", recorded_to), (rl_step_module, "_micro_batch_loss", loss),
                 (rl_step_module, "LoadCounter", HostLoadCounter),
                 (optimizer, "optimizer_step", lambda *args: (True, 0.0))]  # meta parameters: nothing to update
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in stand_ins]
    for owner, name, value in stand_ins:
        setattr(owner, name, value)
    try:  # the rank process serves later tests (kept ranks): its modules are put back
        rl_step_module.rl_step(trainable.chunks, trainable.optimizer, trainable.scheduler, rl_batch,
                               AlgorithmConfig(), batching=MicroBatching(max_tokens=1, vocab_size=256,
                                                                         keep_routing=True, sequence_parallel=False))
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)
    return seen


def steps_with_unplaced_on_meta(rank, layout, hf_path, unplaced_on_meta):
    """:func:`_steps` on a fresh model, with or without :class:`UnplacedToMeta`."""
    from transformers import AutoConfig

    trainable = _build(hf_path)
    sft_batch, rl_batch = _batches(hf_path)
    vocab_size = AutoConfig.from_pretrained(hf_path).vocab_size
    if not unplaced_on_meta:
        return _steps(trainable, sft_batch, rl_batch, vocab_size)
    import megarl.trainer.optimizer as optimizer

    update = optimizer.optimizer_step

    def update_outside_the_mode(*args, **kwargs):  # megatron's optimizer is the library's (the CPU
        with torch._C.DisableTorchFunction():  # work-around for its CUDA type check patches Tensor.type)
            return update(*args, **kwargs)

    optimizer.optimizer_step = update_outside_the_mode
    try:
        with UnplacedToMeta():
            return _steps(trainable, sft_batch, rl_batch, vocab_size)
    finally:
        optimizer.optimizer_step = update


def test_the_model_receives_every_input_on_its_own_device(tiny_checkpoint):
    [devices] = run_ranks(inputs_on_meta_model, Layout(), str(tiny_checkpoint))
    assert devices == {"sft": ["meta"], "rl": ["meta"]}


def test_a_step_holds_at_most_two_micro_batches_on_the_device(tiny_checkpoint):
    [seen] = run_ranks(micro_batches_on_meta, Layout(), str(tiny_checkpoint))
    assert len(seen) == 4  # one forward per sample
    assert all(routes <= 2 and masks <= 2 and replay <= 2 for routes, masks, replay in seen), seen
    assert all(routes >= 1 and replay >= 1 for routes, _, replay in seen), seen  # the stand-in saw them


def test_steps_place_every_tensor_they_create(tiny_checkpoint):
    plain, elsewhere = (run_ranks(steps_with_unplaced_on_meta, Layout(), str(tiny_checkpoint), on_meta)[0]
                        for on_meta in (False, True))
    assert elsewhere[0] == pytest.approx(plain[0], abs=1e-6)
    assert elsewhere[1] == pytest.approx(plain[1], abs=1e-6)
    assert {"loss", "mismatch/logprob_abs_diff", "routing/agreement"} <= set(plain[1])


def test_collectives_run_on_their_group_backends_device(monkeypatch):
    import torch.distributed as dist

    from megarl.trainer.device import collective_device

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)
