"""Model-weight conversion through megatron-bridge: HF <-> Megatron ``torch_dist``, and a logit check.

- :func:`to_megatron`: HF checkpoint -> Megatron model under a TP/PP/EP layout (the bridge's
  mappings) -> a megatron-core ``dist_checkpointing`` checkpoint (format ``torch_dist``).
- :func:`to_hf`: a ``torch_dist`` checkpoint (written here or by the trainer, any layout) -> the
  Megatron model under the layout given -> HF safetensors shards, config and tokenizer.
- :func:`verify`: logits of the Megatron checkpoint against an HF transformers forward.

Each runs as one process per rank of the layout: the trainer's Ray actors (:func:`megarl.trainer.launch.run_ranks`).

Memory: no process ever holds the whole model. On the way in, every rank reads from the HF
safetensors, one tensor at a time, only the tensors of its own pipeline stage and experts (a
tensor split over TP is read by TP rank 0 and scattered), and ``dist_checkpointing`` writes each
rank's shard. On the way out, every rank loads only its shard, megatron-bridge's
``export_hf_weights`` yields one full HF tensor at a time (gathered over TP, EP and PP), and
:func:`write_hf_shards` on rank 0 buffers at most one output file (``max_shard_bytes``) before
writing it. The peak per process is its model shard plus one shard file plus one tensor, so a 671B
model converts under a layout whose shards fit the hosts (e.g. the training layout itself).

The checkpoint layout on disk is the trainer's (:mod:`megarl.trainer.checkpoint`): the model under
``model`` (``model0``, ``model1``, ... with virtual stages), its hyper-parameters under
``megarl.model``, so a trainer checkpoint (its optimizer state is ignored) converts to HF as well.

A LoRA run's trainer checkpoint holds the adapters only (its ``megarl.model.lora`` describes them).
:func:`to_hf` then needs their :class:`~megarl.models.lora.LoraConfig` (:func:`lora_settings`:
from the run's ``config.yaml`` or given one by one) and, as ``hf_path``, the base model they were
trained on: the ranks build the base from it, add the adapters and load them from the checkpoint,
and write either the adapters as an HF PEFT directory (megatron-bridge's ``save_hf_adapter``) or,
with ``merge``, the base with the adapters merged (``export_hf_weights`` merges them) as an HF
checkpoint through :func:`write_hf_shards`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from megarl.models.lora import LoraConfig, is_adapter_key
from megarl.parallel import Layout
from megarl.trainer.device import collective_device, model_device
from megarl.trainer.packing import micro_batch_count_multiple

log = logging.getLogger(__name__)

FORMAT = "torch_dist"
DEFAULT_PROMPTS = ("3+4=", "The capital of France is", "def fibonacci(n):", "1 2 3 4 5 6 7 8")
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.05}  # max |logit difference|


class ConversionError(ValueError):
    """An input the converter cannot use; the message is one line naming it and why."""


@dataclass(frozen=True)
class HfExport:
    """How :func:`to_hf` writes: safetensors files of at most ``max_shard_bytes``; a LoRA run's adapters
    (``lora``, their settings) as an HF PEFT directory, or with ``merge`` merged into the base's weights."""

    max_shard_bytes: int = 5 * 10**9
    lora: LoraConfig | None = None
    merge: bool = False


@dataclass(frozen=True)
class Verification:
    """The prompts whose logits a written checkpoint is checked on, and the largest |logit difference|
    allowed (None: :data:`DEFAULT_TOLERANCE` of the dtype)."""

    prompts: list[str]
    tolerance: float | None


@dataclass(frozen=True)
class ShardReport:
    """The safetensors files written (by :func:`write_hf_shards`, or a PEFT adapter's one file), and
    the most bytes held in memory at once."""

    files: list[str]
    tensors: int
    total_bytes: int
    peak_buffered_bytes: int


@dataclass(frozen=True)
class VerifyReport:
    """Megatron vs HF logits on the prompts: the max absolute difference and top-1 agreement."""

    max_abs_diff: float
    per_prompt: list[float]
    top1_agreement: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


# ---------------------------------------------------------------- checks of the inputs

def hf_architecture(hf_path: str | Path) -> str:
    """The architecture named in ``hf_path/config.json``, if megatron-bridge has a bridge for it."""
    from megarl.models.bridge_registry import auto_bridge_for
    from megarl.platform import megatron_cpu

    megatron_cpu.apply()
    config_file = Path(hf_path) / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{hf_path}: not an HF checkpoint (no config.json)")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not architectures:
        raise ConversionError(f"{config_file}: names no architecture ('architectures' is empty)")
    AutoBridge = auto_bridge_for(architectures[:1])
    if not AutoBridge.can_handle(str(hf_path)):
        raise ConversionError(
            f"{config_file}: megatron-bridge has no bridge for architecture {architectures[0]} "
            f"(AutoBridge.list_supported_models() lists the {len(AutoBridge.list_supported_models())} it has)")
    return architectures[0]


def check_layout(hf_path: str | Path, layout: Layout) -> None:
    """Raise :class:`ConversionError` when ``layout`` cannot shard the model of ``hf_path/config.json``."""
    from megarl.models.hf_config import checkpoint_arch

    arch = checkpoint_arch(str(hf_path))
    if not arch:
        raise ConversionError(f"{hf_path}: not an HF checkpoint (no config.json)")
    experts, layers = arch["num_experts"] or 0, arch["num_layers"]
    heads, groups = arch["num_attention_heads"], arch["num_query_groups"] or arch["num_attention_heads"]
    etp = layout.etp or layout.tp
    model_parallel, stage_ranks = layout.tp * layout.pp * layout.cp, layout.world_size // layout.pp
    problems = []
    if layout.world_size % model_parallel:
        problems.append(f"world size {layout.world_size} is not divisible by tp*pp*cp = {model_parallel}")
    elif stage_ranks % (layout.ep * etp):
        problems.append(f"ep*etp = {layout.ep * etp} does not divide the {stage_ranks} ranks of a stage")
    if layout.cp > 1:
        problems.append(f"cp={layout.cp}: conversion splits weights, not sequences; use cp=1")
    if experts and experts % layout.ep:
        problems.append(f"{experts} experts are not divisible by ep={layout.ep}")
    if layout.ep > 1 and not experts:
        problems.append(f"ep={layout.ep} but the model has no experts")
    if layers % (layout.pp * (layout.vpp or 1)):
        problems.append(f"{layers} layers do not split into pp*vpp = {layout.pp * (layout.vpp or 1)} stages")
    if heads % layout.tp:
        problems.append(f"{heads} attention heads are not divisible by tp={layout.tp}")
    if groups % layout.tp and layout.tp % groups:
        problems.append(f"{groups} KV heads and tp={layout.tp}: neither divides the other")
    if problems:
        raise ConversionError(f"layout {describe(layout)} does not fit the model: " + "; ".join(problems))


def describe(layout: Layout) -> str:
    return (f"world_size={layout.world_size} tp={layout.tp} pp={layout.pp} vpp={layout.vpp} "
            f"ep={layout.ep} etp={layout.etp or layout.tp}")


def checkpoint_dir(path: str | Path) -> Path:
    """A ``torch_dist`` checkpoint directory: ``path`` itself, or a trainer root's newest complete
    checkpoint (the one a resume takes: every file its ``complete.json`` lists intact; newer ones
    skipped with a warning naming why)."""
    from megarl.trainer.checkpoint import CheckpointError, newest_complete

    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    if path.is_dir() and any(path.glob("iter_*")):
        try:
            return newest_complete(path)[0]
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
    raise ConversionError(f"{path}: not a {FORMAT} checkpoint (no metadata.json, no iter_<step> under it)")


def check_checkpoint_matches(ckpt: Path, hf_path: str | Path, architecture: str, signature: dict) -> None:
    """Raise :class:`ConversionError` when ``ckpt`` holds another model than the HF config describes."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(ckpt)).get("megarl", {})
    if "model" not in saved:
        raise ConversionError(f"{ckpt}: not written by megarl (no 'megarl.model' hyper-parameters)")
    if saved.get("hf_architecture", architecture) != architecture:
        raise ConversionError(f"{ckpt} holds a {saved['hf_architecture']}, {hf_path}/config.json is a {architecture}")
    differ = [f"{name}: checkpoint {saved['model'].get(name)} vs HF {value}"
              for name, value in signature.items() if saved["model"].get(name) != value]
    if differ:
        raise ConversionError(f"{ckpt} holds a different model than {hf_path}/config.json: " + "; ".join(differ))


def saved_lora(ckpt: Path) -> str | None:
    """The adapters a trainer checkpoint holds instead of a full model, as the trainer described them
    (``"rank 8, alpha 16, ['linear_qkv', 'linear_proj']"``); None for a full model."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # read here, outside the ranks, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            common = dist_checkpointing.load_common_state_dict(str(ckpt))
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise ConversionError(f"{ckpt}: unreadable checkpoint ({type(exc).__name__}: {exc})") from exc
    return common.get("megarl", {}).get("model", {}).get("lora")


def lora_settings(config: str | Path | None = None, rank: int | None = None, alpha: int | None = None,
                  targets: Sequence[str] | None = None) -> LoraConfig | None:
    """The LoRA settings of a run: the ``lora`` section of its ``config.yaml`` (``config``), or
    ``rank``, ``alpha`` and ``targets`` (Megatron linear names; dropout 0, which only the PEFT
    config records). None when none is given; :class:`ConversionError` when both kinds, only some
    of the three, or invalid settings are given, or ``config`` is no LoRA run's config."""
    flags = {"--lora-rank": rank, "--lora-alpha": alpha, "--lora-targets": targets}
    given = [name for name, value in flags.items() if value is not None]
    if config is not None and given:
        raise ConversionError(f"give the LoRA settings by --config or by {'/'.join(flags)}, not both")
    if config is None and not given:
        return None
    if config is None and len(given) < len(flags):
        missing = [name for name in flags if name not in given]
        raise ConversionError(f"{', '.join(missing)} missing: the LoRA settings need all of {', '.join(flags)}")
    try:
        if config is not None:
            return _config_lora(Path(config))
        return LoraConfig.when_enabled(LoraConfig(enabled=True, rank=rank, alpha=alpha, dropout=0.0,
                                                  target_modules=list(targets), sync="adapter"))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConversionError(str(exc).splitlines()[0]) from exc


def _config_lora(path: Path) -> LoraConfig:
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ConversionError(f"--config {path}: no such file (a run's config.yaml, in its logging.run_dir)")
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:
        raise ConversionError(f"{path}: not a YAML config ({type(exc).__name__})") from exc
    lora = cfg.get("lora") if OmegaConf.is_dict(cfg) else None
    if lora is None or not lora.get("enabled"):
        raise ConversionError(f"{path}: lora.enabled is not true, not the config of a LoRA run")
    return LoraConfig.when_enabled(lora)


def check_lora(ckpt: Path, lora: LoraConfig | None, merge: bool) -> None:
    """Raise :class:`ConversionError` unless ``lora`` is given exactly for an adapter checkpoint and
    describes its adapters, and ``merge`` is asked only of one."""
    saved = saved_lora(ckpt)
    if saved is None and lora is not None:
        raise ConversionError(f"{ckpt} holds a full model, not LoRA adapters: drop the LoRA settings")
    if saved is None and merge:
        raise ConversionError(f"--merge: {ckpt} holds a full model, no LoRA adapters to merge")
    if saved is not None and lora is None:
        raise ConversionError(
            f"{ckpt} holds LoRA adapters only ({saved}): give their settings, --config RUN_DIR/config.yaml or "
            "--lora-rank/--lora-alpha/--lora-targets, and as --hf the base model they were trained on")
    if saved is not None and saved != lora.describe():
        raise ConversionError(f"{ckpt} holds adapters of {saved}, the LoRA settings given are {lora.describe()}")


# ---------------------------------------------------------------- HF safetensors, streamed

def write_hf_shards(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                    max_shard_bytes: int) -> ShardReport:
    """Write ``(name, tensor)`` pairs as HF safetensors files of at most ``max_shard_bytes`` each.

    Holds at most one file's tensors at a time (a tensor larger than the limit gets a file of its
    own). One file is ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``, as transformers writes them.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    buffer: dict[str, torch.Tensor] = {}
    buffered = peak = total = count = 0

    def flush():
        nonlocal buffered
        part = out / f"part-{len(parts):05d}.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in buffer.items()}, str(part), metadata={"format": "pt"})
        parts.append((part, list(buffer)))
        buffer.clear()
        buffered = 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if buffer and buffered + size > max_shard_bytes:
            flush()
        tensor = tensor.detach().cpu()
        if tensor.untyped_storage().nbytes() > size:  # a view would keep its whole base alive
            tensor = tensor.clone()
        buffer[name] = tensor
        buffered += size
        peak, total, count = max(peak, buffered), total + size, count + 1
    if buffer:
        flush()
    names = (["model.safetensors"] if len(parts) == 1 else
             [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))])
    for (part, _), name in zip(parts, names):
        os.replace(part, out / name)
    if len(parts) > 1:
        weight_map = {key: name for (_, keys), name in zip(parts, names) for key in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return ShardReport(files=names, tensors=count, total_bytes=total, peak_buffered_bytes=peak)


# ---------------------------------------------------------------- rank functions (run_ranks)

def _megatron_state(chunks) -> dict:
    from megatron.core.utils import unwrap_model

    modules = unwrap_model(chunks)
    return {("model" if len(modules) == 1 else f"model{i}"): m.sharded_state_dict() for i, m in enumerate(modules)}


def _model_signature(chunks) -> dict:
    from megatron.core.utils import get_model_config

    from megarl.trainer.checkpoint import MODEL_FIELDS

    config = get_model_config(chunks[0])
    return {name: getattr(config, name, None) for name in MODEL_FIELDS}


def _load(chunks, ckpt: str, adapters_only: bool = False) -> None:
    """Overwrite ``chunks`` with the model in the ``torch_dist`` checkpoint ``ckpt`` (any layout);
    ``adapters_only``: only their LoRA adapters, the checkpoint of a LoRA run."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.utils import unwrap_model

    state = _megatron_state(chunks)
    if adapters_only:
        state = {key: {k: v for k, v in shards.items() if is_adapter_key(k)} for key, shards in state.items()}
    loaded = dist_checkpointing.load(state, ckpt, sharded_strategy=get_default_load_sharded_strategy(ckpt))
    for key, module in zip(state, unwrap_model(chunks)):
        module.load_state_dict(loaded[key], strict=not adapters_only)


def _loaded_model(hf_path: str, ckpt: str, layout: Layout, dtype: str, lora: LoraConfig | None = None):
    """The model of ``hf_path``'s architecture with the weights of the checkpoint ``ckpt``; with
    ``lora``, ``hf_path``'s weights with the checkpoint's adapters on them."""
    from megarl.models.bridge import ModelSettings, build_megatron_model

    architecture = hf_architecture(hf_path)
    model = build_megatron_model(hf_path, layout, ModelSettings(transformer_impl="local", lora=lora), dtype=dtype,
                                 load_weights=lora is not None)
    check_checkpoint_matches(Path(ckpt), hf_path, architecture, _model_signature(model.chunks))
    _load(model.chunks, ckpt, adapters_only=lora is not None)
    return model


def to_megatron_rank(rank: int, layout: Layout, hf_path: str, out_dir: str, dtype: str,
                     prompts: list[str] | None, tolerance: float | None) -> VerifyReport | None:
    """Rank body of :func:`to_megatron`; with ``prompts``, reloads the written checkpoint and verifies it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from megarl.models.bridge import ModelSettings, build_megatron_model

    architecture = hf_architecture(hf_path)
    model = build_megatron_model(hf_path, layout, ModelSettings(transformer_impl="local"), dtype=dtype)
    state = _megatron_state(model.chunks)
    state["megarl"] = {"model": _model_signature(model.chunks), "hf_architecture": architecture}
    dist_checkpointing.save(state, out_dir, sharded_strategy=get_default_save_sharded_strategy(FORMAT))
    torch.distributed.barrier()
    if prompts is None:
        return None
    _load(model.chunks, out_dir)  # verify what was written, not what is in memory
    return _verify_model(model, hf_path, dtype, prompts, tolerance)


def to_hf_rank(rank: int, layout: Layout, ckpt: str, hf_path: str, out_dir: str, dtype: str, export: HfExport,
               verification: Verification | None) -> tuple[ShardReport | None, VerifyReport | None]:
    """Rank body of :func:`to_hf`; rank 0 writes the files and returns the reports."""
    from megarl.models.bridge import save_hf_adapter

    model = _loaded_model(hf_path, ckpt, layout, dtype, export.lora)
    if export.lora is not None and not export.merge:
        save_hf_adapter(model, export.lora, out_dir)  # collective; rank 0 writes
        return (_adapter_report(Path(out_dir)) if rank == 0 else None), None
    tensors = model.bridge.export_hf_weights(model.chunks, cpu=True, show_progress=False)
    shards = None
    if rank == 0:
        model.bridge.hf_pretrained.save_artifacts(out_dir)
        shards = write_hf_shards(tensors, out_dir, export.max_shard_bytes)
    else:
        for _ in tensors:  # the export's gathers are collective
            pass
    torch.distributed.barrier()
    if verification is None:
        return shards, None
    return shards, _verify_model(model, out_dir, dtype, verification.prompts, verification.tolerance)


def _adapter_report(out_dir: Path) -> ShardReport:
    """What ``save_hf_adapter`` wrote: one file, its tensors gathered whole before the write."""
    from safetensors.torch import load_file

    name = "adapter_model.safetensors"
    tensors = load_file(out_dir / name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return ShardReport(files=[name], tensors=len(tensors), total_bytes=total, peak_buffered_bytes=total)


def verify_rank(rank: int, layout: Layout, ckpt: str, hf_path: str, dtype: str, prompts: list[str],
                tolerance: float | None) -> VerifyReport | None:
    """Rank body of :func:`verify`."""
    return _verify_model(_loaded_model(hf_path, ckpt, layout, dtype), hf_path, dtype, prompts, tolerance)


# ---------------------------------------------------------------- logits, both sides

def _prompt_ids(hf_path: str, prompts: list[str]) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    return [torch.tensor(tokenizer(p)["input_ids"], dtype=torch.long) for p in prompts]


def _megatron_logits(chunks, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, vocab_size] float32 host logits of one sequence (``ids`` int64 [S] on the host), on every rank
    (computed by the last pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tp = ps.get_tensor_model_parallel_world_size()
    length = len(ids)
    device = model_device(chunks)
    tokens = torch.nn.functional.pad(ids, (0, -length % tp))[None].to(device)  # sequence parallel splits S by tp
    kept = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, torch.arange(batch.shape[1], device=device)[None], None)

        def keep(logits):
            kept.append(gather_from_tensor_model_parallel_region(logits)[0, :length, :vocab_size].float())
            return logits.sum() * 0, torch.tensor(1, device=device), {}
        return output, keep

    count = micro_batch_count_multiple()  # virtual stages run no fewer micro-batches than pipeline stages
    data = [iter([tokens] * count) for _ in chunks] if len(chunks) > 1 else iter([tokens])  # one per virtual stage
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=count,
            seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True)
    source = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
              and ps.get_data_parallel_rank() == 0)
    logits = (kept[0] if source else torch.zeros(length, vocab_size, device=device)).to(collective_device())
    torch.distributed.all_reduce(logits)  # exactly one rank contributes
    return logits.cpu()


def _verify_model(model, hf_path: str, dtype: str, prompts: list[str], tolerance: float | None) -> VerifyReport | None:
    """Compare ``model``'s logits with HF transformers' on ``prompts``; the report on rank 0, None elsewhere."""
    from megarl.models.bridge import DTYPES

    ids = _prompt_ids(hf_path, prompts)
    vocab_size = model.bridge.hf_pretrained.config.vocab_size
    for chunk in model.chunks:
        chunk.eval()
    megatron = [_megatron_logits(model.chunks, seq, vocab_size) for seq in ids]
    if torch.distributed.get_rank() != 0:
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=DTYPES[dtype]).eval()
    diffs, agree, total = [], 0, 0
    with torch.no_grad():
        for seq, mine in zip(ids, megatron):
            reference = hf(seq[None]).logits[0].float()
            diffs.append(float((mine - reference).abs().max()))
            agree += int((mine.argmax(-1) == reference.argmax(-1)).sum())
            total += len(seq)
    return VerifyReport(max_abs_diff=max(diffs), per_prompt=diffs, top1_agreement=agree / total,
                        tolerance=DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance)


# ---------------------------------------------------------------- drivers (start the ranks)

def default_world_size(tp: int, pp: int, ep: int, etp: int | None) -> int:
    """The fewest ranks that hold a layout: pp stages of lcm(tp, ep*etp) ranks."""
    return pp * math.lcm(tp, ep * (etp or tp))


def conversion_layout(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, vpp: int | None = None,
                      world_size: int | None = None) -> Layout:
    """A layout for conversion (sequence parallel whenever tp > 1, as MoE requires)."""
    return Layout(world_size=world_size or default_world_size(tp, pp, ep, etp), tp=tp, pp=pp, vpp=vpp, ep=ep,
                  etp=etp, sequence_parallel=tp > 1)


def _resolve_dtype(hf_path: str | Path, dtype: str) -> str:
    from megarl.models.bridge import DTYPES

    if dtype == "auto":
        config = json.loads((Path(hf_path) / "config.json").read_text())
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        return dtype if dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return dtype


def _empty_output(out_dir: str | Path) -> str:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    return str(out)


def _run(fn, layout: Layout, *args):
    """Rank 0's result of ``fn`` on every rank; a :class:`ConversionError` on a rank is raised here."""
    from megarl.trainer.launch import run_ranks

    results = run_ranks(_guarded, layout, fn, *args)
    for result in results:
        if isinstance(result, ConversionError):
            raise result
    return results[0]


def _guarded(rank: int, layout: Layout, fn, *args):
    """Return a :class:`ConversionError` instead of raising it (every rank checks the same inputs)."""
    try:
        return fn(rank, layout, *args)
    except ConversionError as exc:
        return exc


def to_megatron(hf_path: str | Path, out_dir: str | Path, layout: Layout, *, dtype: str = "auto",
                prompts: Sequence[str] | None = None, tolerance: float | None = None) -> VerifyReport | None:
    """Convert an HF checkpoint to a ``torch_dist`` checkpoint at ``out_dir`` under ``layout``.

    With ``prompts``, the written checkpoint is read back and its logits compared with HF's.
    """
    check_layout(hf_path, layout)
    dtype, out = _resolve_dtype(hf_path, dtype), _empty_output(out_dir)
    verified = _run(to_megatron_rank, layout, str(hf_path), out, dtype, _list(prompts), tolerance)
    log.info("%s -> %s (%s, %s)", hf_path, out, FORMAT, describe(layout))
    return verified


def to_hf(ckpt: str | Path, hf_path: str | Path, out_dir: str | Path, layout: Layout, export: HfExport = HfExport(),
          *, dtype: str = "auto", prompts: Sequence[str] | None = None,
          tolerance: float | None = None) -> tuple[ShardReport, VerifyReport | None]:
    """Convert the ``torch_dist`` checkpoint ``ckpt`` (any layout) to an HF checkpoint at ``out_dir``.

    ``hf_path`` is the HF checkpoint the model came from: it gives the architecture (which must
    be the checkpoint's), the config and the tokenizer. The ranks load ``ckpt`` under ``layout``.

    A LoRA run's checkpoint (adapters only) needs ``export.lora``, its settings, and ``hf_path`` is then
    the base model (its weights too). It converts to an HF PEFT directory (``adapter_config.json``
    + ``adapter_model.safetensors``) or, with ``export.merge``, to an HF checkpoint of the base with the
    adapters merged (W + alpha / rank * B A); ``prompts`` (verification) need ``export.merge``.
    """
    path = checkpoint_dir(ckpt)
    check_layout(hf_path, layout)
    check_lora(path, export.lora, export.merge)
    if export.lora is not None and not export.merge and prompts is not None:
        raise ConversionError("verification compares the logits of an HF checkpoint, which a PEFT adapter is not: "
                              "verify the adapters with --merge")
    dtype, out = _resolve_dtype(hf_path, dtype), _empty_output(out_dir)
    verification = None if prompts is None else Verification(list(prompts), tolerance)
    shards, verified = _run(to_hf_rank, layout, str(path), str(hf_path), out, dtype, export, verification)
    log.info("%s -> %s: %d tensors in %d files, %.1f MB", path, out, shards.tensors, len(shards.files),
             shards.total_bytes / 2**20)
    return shards, verified


def verify(ckpt: str | Path, hf_path: str | Path, layout: Layout, *, dtype: str = "auto",
           prompts: Sequence[str] = DEFAULT_PROMPTS, tolerance: float | None = None) -> VerifyReport:
    """Logits of the ``torch_dist`` checkpoint ``ckpt`` (loaded under ``layout``) against HF's at ``hf_path``."""
    path = checkpoint_dir(ckpt)
    check_layout(hf_path, layout)
    if saved_lora(path) is not None:
        raise ConversionError(f"{path} holds LoRA adapters only: verify them with to-hf --merge --verify "
                              "(their settings and, as --hf, the base model they were trained on)")
    return _run(verify_rank, layout, str(path), str(hf_path), _resolve_dtype(hf_path, dtype), list(prompts), tolerance)


def _list(prompts: Sequence[str] | None) -> list[str] | None:
    return None if prompts is None else list(prompts)


def report_dict(report) -> dict:
    return dict(asdict(report), passed=report.passed) if isinstance(report, VerifyReport) else asdict(report)
