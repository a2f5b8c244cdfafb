"""Faults at cluster scale: a trainer node that leaves the Ray cluster is found dead from Ray's node
table (megarl/pipeline/node_watch.py) and ends the run with one line naming it and status 75, which
slurm/megarl.sbatch requeues; the requeued run, the conversion tool and the rerun message take the
newest *complete* checkpoint, never the ``latest`` pointer alone."""
import asyncio
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.pipeline.node_watch import TrainerNodeLost, cancel_on_loss, dead_nodes, loss_of, node_ids
from megarl.trainer.checkpoint import _file_record, _write_completion_record, step_dir
from megarl.trainer.convert import ConversionError, checkpoint_dir


def ray_node(node_id: str, address: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive}


@pytest.mark.unit
def test_a_trainer_node_is_dead_once_ray_reports_it_dead_or_a_new_node_takes_its_address():
    nodes = [ray_node("a", "10.0.0.2"), ray_node("b", "10.0.0.3"), ray_node("old", "10.0.0.3", alive=False)]
    watched = node_ids(["10.0.0.2", "10.0.0.3"], nodes)
    assert watched == {"10.0.0.2": "a", "10.0.0.3": "b"}
    assert dead_nodes(watched, nodes) == []
    rejoined = [ray_node("a", "10.0.0.2"), ray_node("b", "10.0.0.3", alive=False), ray_node("c", "10.0.0.3")]
    assert dead_nodes(watched, rejoined) == ["10.0.0.3"]  # the node came back as a new Ray node: its ranks are gone
    assert dead_nodes(watched, nodes[:1]) == ["10.0.0.3"]  # no longer listed
    with pytest.raises(ValueError, match=r"no alive Ray node at \['10.0.0.9'\]"):
        node_ids(["10.0.0.9"], nodes)


@pytest.mark.unit
def test_a_lost_node_cancels_the_run_which_then_raises_the_loss():
    async def body():
        async def lose():
            await asyncio.sleep(0.05)
            raise TrainerNodeLost("trainer node 10.0.0.3 left the Ray cluster")

        run = asyncio.create_task(asyncio.sleep(30))
        watch = asyncio.create_task(lose())
        cancel_on_loss(watch, run)
        with pytest.raises(asyncio.CancelledError):
            await run
        return loss_of(watch)

    lost = asyncio.run(body())
    assert isinstance(lost, TrainerNodeLost) and "10.0.0.3" in str(lost)
    assert loss_of(None) is None


def save(root: Path, step: int, complete: bool) -> None:
    """A stand-in checkpoint of ``step`` under ``root`` (``latest`` names it), with its completion
    record when ``complete``."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"step": step}))
    (path / "shard.distcp").write_bytes(bytes(range(256)) * step)
    if complete:
        _write_completion_record(path, step, {n: _file_record(path / n) for n in ("metadata.json", "shard.distcp")})
    (root / "latest").write_text(str(step))


@pytest.mark.unit
def test_conversion_and_the_rerun_message_take_the_newest_complete_checkpoint(tmp_path):
    from megarl.train import what_a_rerun_does

    root = tmp_path / "run" / "checkpoints"
    save(root, 1, complete=True)
    save(root, 2, complete=True)
    (step_dir(root, 2) / "shard.distcp").write_bytes(b"torn")  # truncated by a node lost mid-save
    save(root, 3, complete=False)  # its save never finished; latest names it
    assert checkpoint_dir(root) == step_dir(root, 1)
    assert checkpoint_dir(step_dir(root, 3)) == step_dir(root, 3)  # a directory named on purpose is taken as is
    cfg = OmegaConf.create({"mode": "sync", "logging": {"run_dir": str(tmp_path / "run")}, "trainer": {"resume": True}})
    message = what_a_rerun_does(cfg)
    assert message.startswith("the same command resumes after step 1 (the run's newest complete checkpoint")
    assert "iter_0000003 (no complete.json" in message and "iter_0000002 (shard.distcp" in message
    (step_dir(root, 1) / "complete.json").unlink()
    with pytest.raises(ConversionError, match="holds no complete checkpoint"):
        checkpoint_dir(root)
    assert "holds no complete checkpoint" in what_a_rerun_does(cfg)
