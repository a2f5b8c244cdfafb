"""Trainer checkpoints with megatron-core ``dist_checkpointing`` (format ``torch_dist``).

A checkpoint holds the model chunks, the DistributedOptimizer state (sharded per parameter, so
it reshards across TP/PP/EP/DP layouts), the LR schedule, every RNG (python, numpy, torch CPU,
CUDA when present, megatron's RNG tracker), the step and the caller's data position (a small
dict of ints, floats, strings, e.g. ``{"consumed_prompts": 512, "rng_seed": 7}``). A LoRA model's
checkpoint holds its adapters (and their optimizer state) only; the base is rebuilt from its HF
checkpoint. With a critic (:mod:`megarl.trainer.critic`) its model, optimizer state and LR schedule are
a second dist_checkpointing checkpoint in the ``critic/`` subdirectory, covered by the same
``complete.json``.

Layout on disk, under a root directory::

    root/iter_0000012/                one checkpoint: dist_checkpointing files, metadata.json and
    root/iter_0000012/critic/         the critic's dist_checkpointing files (runs with a critic)
    root/iter_0000012/complete.json   every file's size and xxh3-64 checksum, written last
    root/latest                       the step of the newest checkpoint saved, as text

A save writes ``iter_<step>.tmp`` first; once every rank's files are written, the ranks checksum
them (each a share of the files), rank 0 writes ``complete.json``, renames the directory to
``iter_<step>`` and then replaces ``latest`` (write-then-rename): a crash at any point leaves the
previous checkpoint and its ``latest`` intact. A checkpoint counts only when every file its
``complete.json`` lists is there with its size and checksum: a resume takes the newest such one at or
before ``latest`` and names, in one warning, the newer ones it skipped (truncated, missing or corrupted
files, no ``complete.json``, past ``latest``) and why. :func:`prune_checkpoints` keeps the newest few.
RNG states are restored only under the layout they were saved with (ranks
of another layout draw different streams anyway); model, optimizer, schedule, step and data
position are restored under any layout.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from megarl.models.lora import is_adapter_key
from megarl.trainer import save_results_queue

log = logging.getLogger(__name__)

LATEST = "latest"
CRITIC_DIR = "critic"  # the critic's checkpoint inside a step's directory
COMPLETE = "complete.json"  # a checkpoint's completion record: {"step": int, "files": {name: {size, xxh3_64}}}
_HASH_CHUNK = 16 << 20  # bytes read at a time while checksumming
FORMAT = "torch_dist"
# Optimizer state in model-parameter shapes (gathered over DP on save), reshardable across every
# layout; megatron's per-buffer 'dp_reshardable' format reshards only along DP.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# The model hyper-parameters a checkpoint must agree on to be loaded into a model.
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk")

# what reading a damaged checkpoint raises; torch's CheckpointException is a BaseException
_READ_ERRORS = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable, or does not match the model."""


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_checkpoint` restored besides the model, optimizer, schedule and RNG."""

    step: int
    data_position: dict
    path: Path
    rng_restored: bool  # False when the checkpoint was saved under another layout
    skipped: tuple[str, ...] = ()  # newer checkpoints passed over: "iter_<step> (why)"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_step(root: str | Path) -> int | None:
    """The step ``root/latest`` names, or None when there is no ``latest`` file."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer}: expected a step number, found {text[:40]!r}")
    return int(text)


def save_checkpoint(root: str | Path, step: int, trainable, data_position: dict[str, Any], critic=None) -> Path:
    """Save this rank's share of ``trainable`` (a model_setup.TrainableModel) at ``step``, and of ``critic``
    (another, the value model) when given.

    Collective: every rank calls it with the same ``root``, ``step`` and ``data_position``.
    Returns the final ``root/iter_<step>`` directory once ``latest`` names it.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    _check_plain(data_position, "data_position")
    if trainable.scheduler.num_steps == 0:
        raise CheckpointError("no optimizer step has run yet: the checkpoint to resume from is the HF one it "
                              "started from")
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # a stale one from an earlier crash
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    state, optimizer = _trainer_state(trainable, is_loading=False)
    state["rng_state"] = _rng_object(_rng_state())
    state["megarl"] = {"step": step, "data_position": data_position, "model": _model_signature(trainable),
                       "layout": _layout_signature(), "optimizer": optimizer.common()}
    state["scheduler"] = trainable.scheduler.state_dict()
    save_results_queue.install()  # the save is synchronous: an in-process queue, not megatron's Manager process
    dist_checkpointing.save(state, str(tmp), sharded_strategy=get_default_save_sharded_strategy(FORMAT),
                            async_sharded_save=False)
    torch.distributed.barrier()
    if critic is not None:
        _save_critic(tmp / CRITIC_DIR, critic)
    files = _gather_shares({name: _file_record(tmp / name) for name in _share(_file_names(tmp))})
    if rank0:
        _write_completion_record(tmp, step, files)
        _publish(tmp, final, step)
    torch.distributed.barrier()
    log.info("saved checkpoint %s", final)
    return final


def load_checkpoint(root: str | Path, trainable, step: int | None = None, critic=None) -> Resumed:
    """Restore ``trainable`` (and ``critic`` when given) from ``root/iter_<step>`` (default: the newest
    complete checkpoint under ``root``, see :func:`newest_complete`).

    Collective. Raises :class:`CheckpointError` for a missing or incomplete checkpoint, for one whose
    model differs from ``trainable``'s (layer count, sizes, experts), and, with ``critic``, for one
    without a critic or with another critic model.
    """
    from megatron.core import dist_checkpointing

    path, skipped = _resolve(Path(root), step)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except _READ_ERRORS as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {exc})") from exc
    if "megarl" not in common:
        raise CheckpointError(f"{path} is a {FORMAT} checkpoint, but not one megarl's trainer saved")
    saved = common["megarl"]
    _check_model(path, saved["model"], _model_signature(trainable))
    rng_restored = saved["layout"] == _layout_signature()
    loaded = _load_trainer_state(path, trainable, saved["optimizer"], rng_restored)
    if critic is not None:
        _load_critic(path / CRITIC_DIR, critic)
    if rng_restored:
        _set_rng_state(loaded["rng_state"])
    else:
        log.warning("%s was saved under layout %s, not %s: RNG states not restored",
                    path, saved["layout"], _layout_signature())
    log.info("loaded checkpoint %s (step %d)", path, saved["step"])
    return Resumed(step=saved["step"], data_position=saved["data_position"], path=path, rng_restored=rng_restored,
                   skipped=skipped)


def _trainer_state(trainable, is_loading: bool) -> tuple[dict, _OptimizerState]:
    """The sharded state of ``trainable``'s model chunks and optimizer (under "optimizer"), and the latter's
    :class:`_OptimizerState`."""
    state = _model_state(trainable)
    optimizer = _OptimizerState(trainable.optimizer, state, is_loading=is_loading)
    state["optimizer"] = optimizer.shards
    return state, optimizer


def _load_trainer_state(path: Path, trainable, optimizer_common: dict, with_rng: bool) -> dict:
    """Load model chunks, optimizer and LR schedule of ``trainable`` from the checkpoint at ``path``
    (``optimizer_common``: its saved :meth:`_OptimizerState.common`); what was loaded (with the RNG
    states when ``with_rng``). Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    state, optimizer = _trainer_state(trainable, is_loading=True)
    if with_rng:
        state["rng_state"] = _rng_object(None)
    try:
        loaded = dist_checkpointing.load(state, str(path),
                                         sharded_strategy=get_default_load_sharded_strategy(str(path)))
        for index, module in enumerate(_modules(trainable)):  # a LoRA model's base stays as built
            module.load_state_dict(loaded[_model_key(trainable, index)], strict=trainable.lora is None)
        optimizer.load(loaded["optimizer"], optimizer_common)
        trainable.scheduler.load_state_dict(loaded["scheduler"])
    except _READ_ERRORS as exc:
        raise CheckpointError(f"{path}: cannot load into this model ({type(exc).__name__}: {exc})") from exc
    return loaded


def _save_critic(directory: Path, critic) -> None:
    """Save the critic (a model_setup.TrainableModel) as a checkpoint of its own at ``directory``. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    if torch.distributed.get_rank() == 0:
        directory.mkdir()
    torch.distributed.barrier()
    state, optimizer = _trainer_state(critic, is_loading=False)
    state["megarl"] = {"model": _model_signature(critic), "optimizer": optimizer.common()}
    state["scheduler"] = critic.scheduler.state_dict()
    dist_checkpointing.save(state, str(directory), sharded_strategy=get_default_save_sharded_strategy(FORMAT),
                            async_sharded_save=False)
    torch.distributed.barrier()


def _load_critic(directory: Path, critic) -> None:
    """Restore the critic from its checkpoint at ``directory`` (:func:`_save_critic`). Collective."""
    from megatron.core import dist_checkpointing

    if not directory.is_dir():
        raise CheckpointError(f"{directory.parent} holds no critic (its run trained none): a run with "
                              "critic.enabled cannot resume from it")
    try:
        saved = dist_checkpointing.load_common_state_dict(str(directory))["megarl"]
    except _READ_ERRORS as exc:
        raise CheckpointError(f"{directory}: unreadable critic checkpoint ({type(exc).__name__}: {exc})") from exc
    _check_model(directory, saved["model"], _model_signature(critic))
    _load_trainer_state(directory, critic, saved["optimizer"], with_rng=False)


def newest_complete(root: Path) -> tuple[Path, tuple[str, ...]]:
    """The newest checkpoint under ``root`` at or before the step ``latest`` names (any, without a ``latest``)
    whose files all match its ``complete.json``, and the newer ones skipped, each as "iter_<step> (why)";
    warns once (rank 0) when it skipped any. A directory past ``latest`` was not saved by the run ``latest``
    belongs to (or its save never finished): it is skipped.

    Collective: every rank checks a share of each candidate's files and all agree on the answer (a
    process outside a process group checks them all).
    Raises :class:`CheckpointError` naming ``root`` when no checkpoint there is complete.
    """
    skipped = []
    latest = latest_step(root)
    for path in sorted(root.glob("iter_" + "[0-9]" * 7), reverse=True):
        step = int(path.name.removeprefix("iter_"))
        problem = f"past latest, step {latest}" if latest is not None and step > latest else _verify(path)
        if problem is None:
            if skipped and _rank_and_world()[0] == 0:
                log.warning("resuming from %s, the newest complete checkpoint; skipped %s", path,
                            "; ".join(skipped))
            return path, tuple(skipped)
        skipped.append(f"{path.name} ({problem})")
    found = f": {'; '.join(skipped)}" if skipped else " (no iter_<step> directory)"
    raise CheckpointError(f"{root} holds no complete checkpoint{found}")


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints at or before ``latest`` under ``root`` (0: keep every one);
    the directories deleted. Run it after a save (the newest is complete then); directories past ``latest``
    are left to :func:`newest_complete` to report."""
    latest = latest_step(root)
    if keep == 0 or latest is None:
        return []
    ours = [p for p in sorted(Path(root).glob("iter_" + "[0-9]" * 7)) if int(p.name.removeprefix("iter_")) <= latest]
    doomed = ours[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _verify(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (a file missing, truncated or corrupted, or no
    ``complete.json``), or None when every file it lists matches. Collective."""
    try:
        listed = json.loads((path / COMPLETE).read_text())["files"]
    except FileNotFoundError:
        return f"no {COMPLETE}: its save did not finish"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {COMPLETE} ({type(exc).__name__}: {exc})"
    problems = _gather_shares({name: _file_problem(path / name, listed[name]) for name in _share(sorted(listed))})
    return next((problems[name] for name in sorted(problems) if problems[name] is not None), None)


def _file_problem(file: Path, expected: dict) -> str | None:
    """What is wrong with ``file`` against its record ``expected`` ({"size", "xxh3_64"}), or None."""
    if not file.is_file():
        return f"{file.name} is missing"
    size = file.stat().st_size
    if size != expected["size"]:
        return f"{file.name} has {size} bytes, {expected['size']} were written"
    if _file_record(file)["xxh3_64"] != expected["xxh3_64"]:
        return f"{file.name} does not match its checksum"
    return None


def _file_record(file: Path) -> dict:
    """``file``'s size in bytes and xxh3-64 checksum (hex)."""
    digest = xxhash.xxh3_64()
    with open(file, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return {"size": file.stat().st_size, "xxh3_64": digest.hexdigest()}


def _file_names(directory: Path) -> list[str]:
    """The files under ``directory`` (paths relative to it), sorted: the same list on every rank."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) outside a process group (a check run alone)."""
    if not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names``: every world_size-th, from its rank on."""
    rank, world = _rank_and_world()
    return names[rank::world]


def _gather_shares(mine: dict) -> dict:
    """Every rank's ``mine`` merged into one dict, on every rank (collective; ``mine`` alone outside a group)."""
    if not torch.distributed.is_initialized():
        return dict(mine)
    shares = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, mine)
    return {key: value for share in shares for key, value in share.items()}


def _write_completion_record(directory: Path, step: int, files: dict) -> None:
    """Write ``directory/complete.json`` (write-then-rename, synced): the checkpoint is complete."""
    staged = directory / (COMPLETE + ".tmp")
    with open(staged, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, directory / COMPLETE)


def _publish(tmp: Path, final: Path, step: int) -> None:
    """Rename the finished ``tmp`` to ``final``, then point ``latest`` at it (write-then-rename)."""
    aside = final.with_name(final.name + ".old")
    if final.exists():  # saving the same step again: keep the old copy until the new one is named
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    tmp.rename(final)
    pointer = final.parent / LATEST
    staged = pointer.with_name(LATEST + ".tmp")
    with open(staged, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, pointer)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    shutil.rmtree(aside, ignore_errors=True)


def _resolve(root: Path, step: int | None) -> tuple[Path, tuple[str, ...]]:
    """The checkpoint to load (``step``'s, else the newest complete one) and the newer ones skipped."""
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} does not exist")
    if step is None:
        return newest_complete(root)
    path = step_dir(root, step)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    problem = _verify(path)
    if problem is not None:
        raise CheckpointError(f"{path} is not a complete checkpoint: {problem}")
    return path, ()


def _model_key(trainable, index: int) -> str:
    return "model" if len(trainable.chunks) == 1 else f"model{index}"


def _modules(trainable) -> list:
    """The chunks without their DDP / Float16Module wrappers (whose state dicts add 'module.')."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(trainable.chunks)


def _model_state(trainable) -> dict:
    """The model chunks' sharded state dicts ("model", or "model0", "model1", ... with virtual stages);
    with LoRA only the adapters' (the frozen base is the HF checkpoint the run started from)."""
    states = {_model_key(trainable, i): module.sharded_state_dict() for i, module in enumerate(_modules(trainable))}
    if trainable.lora is not None:
        states = {key: {k: v for k, v in state.items() if is_adapter_key(k)} for key, state in states.items()}
    return states


class _OptimizerState:
    """The DistributedOptimizer's state in a form that does not depend on the layout.

    megatron chains one optimizer for dense and one for expert-parallel parameters when EP > 1,
    and a single one otherwise, so its own (chained, nested) state dict changes shape with the
    layout. Here every optimizer's per-parameter tensors (``fully_reshardable``: parameter-shaped,
    keyed by the parameter) go into one flat dict, the checkpoint keeps the Adam step and the
    grad-scaler state, and the rest (param-group settings, set by the LR schedule) stays this
    process's own.
    """

    def __init__(self, optimizer, model_state: dict, is_loading: bool):
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.utils import extract_sharded_base
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self.nested, self.local = [], []
        for inner in self.inner:
            if not isinstance(inner, DistributedOptimizer):
                raise ValueError(f"checkpoints need megatron's DistributedOptimizer, not {type(inner).__name__} "
                                 "(OptimizerSettings.use_distributed_optimizer=True)")
            if is_loading and not inner.optimizer.state:
                _allocate_optimizer_state(inner)
            shards, local = extract_sharded_base(
                inner.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA))
            self.nested.append(shards)
            self.local.append(local)
        # dist_checkpointing matches shards by their own keys and offsets, not by where they sit in
        # the state dict: a flat, numbered dict loads the same under any layout.
        flat = [shard for shards in self.nested for shard in nested_values(shards)]
        self.shards = {str(i): shard for i, shard in enumerate(flat)}
        self._names = {id(shard): str(i) for i, shard in enumerate(flat)}

    def common(self) -> dict:
        """The layout-free rest of the state: the Adam step and the grad scaler (fp16 only)."""
        steps = {group.get("step") for local in self.local for group in local["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise RuntimeError(f"the chained optimizers disagree on the Adam step: {sorted(map(str, steps))}")
        return {"adam_step": steps.pop(), "grad_scaler": self.local[0].get("grad_scaler")}

    def load(self, loaded: dict, common: dict) -> None:
        """Give every optimizer its loaded tensors and the saved Adam step and grad scaler."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge

        for inner, shards, local in zip(self.inner, self.nested, self.local):
            state = merge(local, dict_list_map_inplace(lambda shard: loaded[self._names[id(shard)]], shards))
            for group in state["optimizer"]["param_groups"]:
                group["step"] = common["adam_step"]
            if common["grad_scaler"] is not None:
                state["grad_scaler"] = common["grad_scaler"]
            inner.load_state_dict(state)


def _allocate_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer over torch's Adam (no TE/apex) has no Adam state yet, and its
    ``state_dict()`` then fails (``assert len(steps) == 1``). Megatron's own dummy step (zero
    gradients) allocates the state; the load overwrites it and the parameters it touched."""
    optimizer._init_optimizer_states_with_dummy_values()


def _model_signature(trainable) -> dict:
    from megatron.core.utils import get_model_config

    config = get_model_config(trainable.chunks[0])
    signature = {name: getattr(config, name, None) for name in MODEL_FIELDS}
    signature["vocab_size"] = _modules(trainable)[0].vocab_size
    lora = trainable.lora
    signature["lora"] = None if lora is None else lora.describe()
    return signature


def _check_model(path: Path, saved: dict, current: dict) -> None:
    differ = [f"{name}: checkpoint {saved.get(name)} vs model {value}"
              for name, value in current.items() if saved.get(name) != value]
    if differ:
        raise CheckpointError(f"{path} holds a different model: " + "; ".join(differ))


def _layout_signature() -> dict:
    from megatron.core import parallel_state as ps

    return {"world_size": torch.distributed.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size()}


def _rng_object(data):
    """This rank's RNG states as one shard of the per-rank ``rng_state`` object."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return ShardedObject("rng_state", data, (world,), (rank,), replica_id=0)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_plain(value, where: str) -> None:
    """Checkpoint metadata is loaded with ``weights_only``: only plain python values pass."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a string")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise TypeError(f"{where}: {type(value).__name__} is not a plain int/float/str/bool/None/list/dict")
