"""Trainer checkpoints: exact resume, resume under another layout, atomic saves, clear errors.

A TP2+SP run trains two steps, saves, and trains two more (with an LR warm-up, so the schedule
and the Adam moments shape step 4). Fresh TP2+SP processes (another seed) that load the
checkpoint must reproduce steps 3 and 4 and the RNG draws exactly; fresh EP2 processes must
reproduce the losses within 1e-5 (model and optimizer resharded from TP to EP). A checkpoint
whose files do not match its completion record (truncated, missing, corrupted) is skipped for
the previous complete one, with one warning naming it.
"""
import dataclasses
import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from megarl.parallel import Layout
from megarl.trainer.launch import run_ranks

pytestmark = pytest.mark.usefixtures("ray_local")  # the test process's Ray for the module's runs (conftest)

TP2 = Layout(world_size=2, tp=2, sequence_parallel=True)
EP2 = Layout(world_size=2, ep=2)
SETTINGS = dict(lr=1e-3, adam_beta2=0.99, lr_warmup_steps=4, lr_decay_steps=10, lr_decay_style="linear")
DATA_POSITION = {"consumed_prompts": 16, "rng_seed": 7, "order": [3, 1, 2]}


def _trainable(hf_path, layout):
    from megarl.config import default_config
    from megarl.config.components import optimizer_settings
    from megarl.trainer.model_setup import ModelSettings, build_trainable

    return build_trainable(hf_path, layout, dataclasses.replace(optimizer_settings(default_config()), **SETTINGS),
                           ModelSettings(transformer_impl="local"))


def _batch():
    from megarl.trainer.token_batch import token_batch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 12, (8,), generator=gen).tolist()
    sequences = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    return token_batch(sequences, [2] * 8)


def _steps(trainable, count):
    """[(loss, grad_norm)] of ``count`` steps; loss None off the last pipeline stage."""
    from megatron.core import parallel_state

    from megarl.trainer.sft_step import supervised_step

    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    out = []
    for _ in range(count):
        result = supervised_step(trainable.chunks, trainable.optimizer, trainable.scheduler, _batch(), 40)
        out.append((result.loss if last else None, result.grad_norm))
    return out


def _draws():
    """One draw from every RNG a checkpoint restores."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracker = torch.rand(3).tolist()
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3).tolist(),
            "tracker": tracker}


def _parameters(trainable):
    return torch.cat([p.detach().flatten().clone() for chunk in trainable.chunks for p in chunk.parameters()])


def train_save_continue(rank, layout, hf_path, root):
    from megarl.trainer.checkpoint import save_checkpoint

    trainable = _trainable(hf_path, layout)
    _steps(trainable, 2)
    _draws()  # the RNGs move on (data shuffling, sampling) before the save
    save_checkpoint(root, 2, trainable, DATA_POSITION)
    return {"steps": _steps(trainable, 2), "draws": _draws()}


def resume_continue(rank, layout, hf_path, root):
    from megarl.trainer.checkpoint import load_checkpoint

    trainable = _trainable(hf_path, layout)
    resumed = load_checkpoint(root, trainable)
    return {"resumed": resumed, "steps": _steps(trainable, 2), "draws": _draws()}


@pytest.fixture(scope="module")
def saved(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_tp2")
    return root, run_ranks(train_save_continue, TP2, tiny_checkpoint, str(root))


def test_resume_is_exact(saved, tiny_checkpoint):
    root, uninterrupted = saved
    resumed = run_ranks(resume_continue, TP2, tiny_checkpoint, str(root), seed=4321)
    for rank in range(TP2.world_size):
        assert resumed[rank]["resumed"].step == 2
        assert resumed[rank]["resumed"].data_position == DATA_POSITION
        assert resumed[rank]["resumed"].rng_restored
        for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(resumed[rank]["steps"], uninterrupted[rank]["steps"]):
            assert loss == pytest.approx(ref_loss, abs=1e-6)
            assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-6)
        assert resumed[rank]["draws"] == uninterrupted[rank]["draws"]
    # step 3 moved the parameters (LR warm-up, Adam moments): equal step-4 losses show those restored
    assert uninterrupted[0]["steps"][1][0] != uninterrupted[0]["steps"][0][0]


def test_resume_under_another_layout(saved, tiny_checkpoint):
    root, uninterrupted = saved
    resumed = run_ranks(resume_continue, EP2, tiny_checkpoint, str(root))
    for rank in range(EP2.world_size):
        assert resumed[rank]["resumed"].step == 2
        assert not resumed[rank]["resumed"].rng_restored  # ranks of another layout draw other streams
        for (loss, grad_norm), (ref_loss, ref_grad_norm) in zip(resumed[rank]["steps"], uninterrupted[0]["steps"]):
            assert loss == pytest.approx(ref_loss, abs=1e-5)
            assert grad_norm == pytest.approx(ref_grad_norm, abs=1e-5)


def _error(call) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # the test asserts on the type and message
        return type(exc).__name__, str(exc)
    return "no error", ""


def crash_and_bad_inputs(rank, layout, hf_path, other_hf_path, root):
    """Single process: a save that crashes half-way, then every kind of bad checkpoint."""
    import megatron.core.dist_checkpointing.serialization as serialization

    from megarl.trainer.checkpoint import latest_step, load_checkpoint, save_checkpoint

    root = Path(root)
    out = {}
    trainable = _trainable(hf_path, layout)
    _steps(trainable, 1)
    save_checkpoint(root, 1, trainable, DATA_POSITION)
    at_step_1 = _parameters(trainable)
    _steps(trainable, 1)

    def crash(*args, **kwargs):  # after the shards are written, before metadata.json
        raise RuntimeError("simulated crash")

    write_config, serialization.save_config = serialization.save_config, crash
    out["crash"] = _error(lambda: save_checkpoint(root, 2, trainable, DATA_POSITION))
    serialization.save_config = write_config
    out["after_crash"] = {"latest": latest_step(root), "entries": sorted(p.name for p in root.iterdir()),
                          "tmp_files": sorted(p.name for p in (root / "iter_0000002.tmp").iterdir())}
    out["resumed_step"] = load_checkpoint(root, trainable).step
    out["parameters_restored"] = bool(torch.equal(_parameters(trainable), at_step_1))
    save_checkpoint(root, 2, trainable, DATA_POSITION)  # the next save clears the stale .tmp
    out["after_next_save"] = {"latest": latest_step(root), "entries": sorted(p.name for p in root.iterdir())}

    errors = {}
    errors["missing_root"] = _error(lambda: load_checkpoint(root / "nowhere", trainable))
    empty = root.parent / "empty"
    empty.mkdir()
    errors["no_checkpoint"] = _error(lambda: load_checkpoint(empty, trainable))
    errors["missing_step"] = _error(lambda: load_checkpoint(root, trainable, step=5))
    (empty / "latest").write_text("iter_2\n")
    errors["bad_latest"] = _error(lambda: latest_step(empty))
    shutil.copytree(root / "iter_0000001", empty / "iter_0000001")
    (empty / "iter_0000001" / "metadata.json").unlink()
    errors["no_metadata"] = _error(lambda: load_checkpoint(empty, trainable, step=1))
    for shard in (root / "iter_0000001").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:1000])
    errors["truncated"] = _error(lambda: load_checkpoint(root, trainable, step=1))
    errors["data_position"] = _error(lambda: save_checkpoint(root, 3, trainable, {"t": torch.zeros(1)}))
    errors["other_model"] = _error(lambda: load_checkpoint(root, _trainable(other_hf_path, layout), step=2))
    errors["before_first_step"] = _error(lambda: save_checkpoint(root.parent / "fresh", 0, _trainable(hf_path, layout),
                                                                 DATA_POSITION))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def single_process(tiny_checkpoint, tmp_path_factory):
    from megarl.models.tiny_moe import TinyMoeSpec, make_tiny_moe

    three_layers = make_tiny_moe(tmp_path_factory.mktemp("tiny_moe_3l"), TinyMoeSpec(num_layers=3))
    root = tmp_path_factory.mktemp("crash") / "ckpt"
    return run_ranks(crash_and_bad_inputs, Layout(), tiny_checkpoint, str(three_layers), str(root))[0]


def test_crash_mid_save_keeps_previous_checkpoint(single_process):
    assert single_process["crash"] == ("RuntimeError", "simulated crash")
    after = single_process["after_crash"]
    assert after["latest"] == 1
    assert after["entries"] == ["iter_0000001", "iter_0000002.tmp", "latest"]
    assert any(name.endswith(".distcp") for name in after["tmp_files"])  # the crash came after writing
    assert "metadata.json" not in after["tmp_files"]
    assert single_process["resumed_step"] == 1
    assert single_process["parameters_restored"]
    assert single_process["after_next_save"] == {"latest": 2, "entries": ["iter_0000001", "iter_0000002", "latest"]}


@pytest.mark.parametrize("case, kind, message", [
    ("missing_root", "CheckpointError", "nowhere does not exist"),
    ("before_first_step", "CheckpointError", "no optimizer step has run yet"),
    ("no_checkpoint", "CheckpointError", "empty holds no complete checkpoint (no iter_<step> directory)"),
    ("missing_step", "CheckpointError", "iter_0000005 does not exist"),
    ("bad_latest", "CheckpointError", "expected a step number, found 'iter_2'"),
    ("no_metadata", "CheckpointError", "iter_0000001 is not a complete checkpoint: metadata.json is missing"),
    ("truncated", "CheckpointError", "iter_0000001 is not a complete checkpoint: __0_0.distcp has 1000 bytes"),
    ("data_position", "TypeError", "data_position['t']: Tensor is not a plain"),
    ("other_model", "CheckpointError", "holds a different model: num_layers: checkpoint 2 vs model 3"),
])
def test_bad_checkpoints_get_clear_errors(single_process, case, kind, message):
    got_kind, got_message = single_process["errors"][case]
    assert got_kind == kind, got_message
    assert message in got_message


def test_completion_record_lists_every_rank_file(saved):
    """The TP2 save's complete.json: every file of the checkpoint (both ranks' shards), with its size and
    its xxh3-64 checksum computed here over the whole file."""
    root, _ = saved
    path = root / "iter_0000002"
    record = json.loads((path / "complete.json").read_text())
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "complete.json")
    assert record["step"] == 2 and sorted(record["files"]) == on_disk
    assert {"__0_0.distcp", "__1_0.distcp", "metadata.json"} <= set(on_disk)
    for name in on_disk:
        data = (path / name).read_bytes()
        assert record["files"][name] == {"size": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}


def _truncate(path: Path) -> None:
    path.write_bytes(b"")


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = bytes(255 - b for b in data[len(data) // 2: len(data) // 2 + 8])
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "missing": Path.unlink, "corrupted": _flip_bytes,
          "no_record": lambda shard: (shard.parent / "complete.json").unlink()}


def damaged_newest(rank, layout, hf_path, root):
    """Single process: checkpoints at steps 1 and 2, then step 2's first shard damaged in each way of
    DAMAGE (one copy each); every resume returns to step 1. Last, both damaged: the error."""
    from megarl.trainer.checkpoint import load_checkpoint, save_checkpoint

    root = Path(root)
    trainable = _trainable(hf_path, layout)
    _steps(trainable, 1)
    save_checkpoint(root, 1, trainable, DATA_POSITION)
    at_step_1 = _parameters(trainable)
    _steps(trainable, 1)
    save_checkpoint(root, 2, trainable, DATA_POSITION)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megarl.trainer.checkpoint").addHandler(handler)
    out = {}
    for kind, damage in DAMAGE.items():
        copy = root.parent / kind
        shutil.copytree(root, copy)
        damage(copy / "iter_0000002" / "__0_0.distcp")
        warnings.clear()
        resumed = load_checkpoint(copy, trainable)
        out[kind] = {"step": resumed.step, "skipped": resumed.skipped, "warnings": list(warnings),
                     "parameters_restored": bool(torch.equal(_parameters(trainable), at_step_1))}
    _flip_bytes(root.parent / "truncated" / "iter_0000001" / "__0_0.distcp")
    out["none_complete"] = _error(lambda: load_checkpoint(root.parent / "truncated", trainable))
    return out


@pytest.fixture(scope="module")
def damaged(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged") / "ckpt"
    return run_ranks(damaged_newest, Layout(), tiny_checkpoint, str(root))[0]


@pytest.mark.parametrize("kind, why", [
    ("truncated", "__0_0.distcp has 0 bytes, "),
    ("missing", "__0_0.distcp is missing"),
    ("corrupted", "__0_0.distcp does not match its checksum"),
    ("no_record", "no complete.json: its save did not finish"),
])
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(damaged, kind, why):
    got = damaged[kind]
    assert got["step"] == 1 and got["parameters_restored"]
    assert len(got["skipped"]) == 1 and got["skipped"][0].startswith(f"iter_0000002 ({why}"), got["skipped"]
    assert len(got["warnings"]) == 1, got["warnings"]
    assert f"/{kind}/iter_0000001, the newest complete checkpoint; skipped iter_0000002 ({why}" in got["warnings"][0]


def test_no_complete_checkpoint_is_an_error_naming_the_directory(damaged):
    kind, message = damaged["none_complete"]
    assert kind == "CheckpointError"
    assert "truncated holds no complete checkpoint: iter_0000002 (__0_0.distcp has 0 bytes, " in message, message
    assert message.endswith("; iter_0000001 (__0_0.distcp does not match its checksum)"), message
