"""The placement rehearsal's driver: ``python -m megarl.rehearsal.driver WORK_DIR RECIPE [RECIPE ...] [-- OVERRIDES]``,
run in node 0 of a Ray cluster of fake GPU nodes (``RAY_ADDRESS``, :mod:`megarl.rehearsal.cluster`).

For each recipe, one after the other on the one cluster: load it with the overrides, scale its topology
down (:mod:`megarl.rehearsal.scale`), write a stand-in checkpoint (its ``config.json`` from the recipe's
``model.arch``), load it again scaled, in a directory of its own (its relative paths resolve there), and
run the real start-up (:func:`megarl.pipeline.startup.placement.place_run`) for a Hopper node
(:data:`TARGET`) with the stand-ins of :mod:`megarl.rehearsal.stand_ins` in place of the trainer ranks'
Megatron build and the SGLang servers; then check what they recorded (:mod:`megarl.rehearsal.checks`) and
print one ``REHEARSAL-REPORT {json}`` line: the recipe, its scaled overrides, the nodes used, the problems
found (or why it was not rehearsed, or the start-up's error).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

from megarl.config import load_config
from megarl.engines.server import nodes_of
from megarl.models.hf_config import HF_KEYS
from megarl.parallel import Layout
from megarl.pipeline.startup.placement import Processes, place_run
from megarl.pipeline.startup.trainer import checkpoint_dir
from megarl.planner.placement import place
from megarl.platform.description import Platform
from megarl.rehearsal.checks import Records, check_all
from megarl.rehearsal.cluster import REPORT_PREFIX
from megarl.rehearsal.scale import not_rehearsable, scale
from megarl.rehearsal.stand_in_server import RECORD_PREFIX
from megarl.rehearsal.stand_ins import StandInRank
from megarl.trainer.actor import TrainerGroup

TARGET = Platform.cuda()  # the machine the recipes are written for: Hopper nodes with the GPU extras
STAND_IN_SERVER = "megarl.rehearsal.stand_in_server"
CONTEXT_LENGTH = 32768  # the stand-in checkpoint's max_position_embeddings (nothing is generated)


class StandInGroup(TrainerGroup):
    """The trainer group, placed and joined as a run's, whose ranks are :class:`StandInRank` and whose build
    builds nothing."""

    rank_class = StandInRank

    async def build(self, hf_path: str, optimizer, model, critic=None) -> int:
        return 0


def stand_in_checkpoint(cfg, where: Path) -> str:
    """A directory with a ``config.json`` of ``cfg.model.arch``'s numbers (what the engines' settings and the
    config checks read of a checkpoint); its path."""
    arch = dataclasses.asdict(cfg.model.arch)
    config = {HF_KEYS[k][0]: v for k, v in arch.items() if k in HF_KEYS and v is not None}
    config |= {"model_type": arch["family"], "architectures": [], "max_position_embeddings": CONTEXT_LENGTH}
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config, indent=1))
    return str(where)


def server_records(run_dir: str, engines: int, nnodes: int) -> dict[tuple[int, int], dict]:
    """(engine, node) -> the merged ``REHEARSAL-SERVER`` lines of that server's log, for the policy engines."""
    out = {}
    for e in range(engines):
        for k in range(nnodes):
            log = Path(run_dir) / (f"engine-{e}.log" + (f".node{k}" if k else ""))
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            merged: dict = {}
            for line in lines:
                if line.startswith(RECORD_PREFIX):
                    merged |= json.loads(line[len(RECORD_PREFIX):])
            if merged:
                out[(e, k)] = merged
    return out


async def rehearse_recipe(name: str, overrides: list[str], work: Path) -> dict:
    """One recipe's rehearsal (see the module docstring); its report."""
    base = load_config([f"recipe={name}", *overrides])
    why = not_rehearsable(base)
    if why is not None:
        return {"recipe": name, "skipped": why}
    scaled = scale(base)
    here = work / name
    checkpoint = stand_in_checkpoint(base, here / "checkpoint")
    os.chdir(here)  # the recipe's relative paths resolve here (load_config makes them absolute)
    cfg = load_config([f"recipe={name}", *overrides, *scaled.overrides, f"model.hf_path={checkpoint}"])
    report = {"recipe": name, "overrides": list(scaled.overrides), "nodes": scaled.nodes}
    Path(cfg.logging.run_dir).mkdir(parents=True, exist_ok=True)  # as megarl.pipeline.run_dir's open_run_dir
    async with contextlib.AsyncExitStack() as stack:
        placed = await place_run(cfg, checkpoint, Layout.from_config(cfg.parallel), stack, TARGET,
                                 secrets.token_urlsafe(16), Processes(StandInGroup, STAND_IN_SERVER))
        trainer = list(await asyncio.gather(*(r.recorded.remote() for r in placed.trainer.ranks)))
    topology = cfg.topology
    servers = server_records(cfg.logging.run_dir, topology.policy.num_engines,
                             nodes_of(topology.policy.tp, topology.gpus_per_node))
    records = Records(trainer, servers)
    report["problems"] = check_all(cfg, str(checkpoint_dir(cfg)), place(topology), records)
    report["records"] = {"trainer": trainer, "servers": {f"{e}/{k}": s for (e, k), s in servers.items()}}
    return report


async def main(work: Path, recipes: list[str], overrides: list[str]) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    for name in recipes:
        started = time.monotonic()
        try:
            report = await rehearse_recipe(name, overrides, work)
        except Exception as e:  # the start-up failed: that is the recipe's finding
            report = {"recipe": name, "problems": [f"start-up failed: {type(e).__name__}: {e}"],
                      "traceback": traceback.format_exc()}
        report["seconds"] = round(time.monotonic() - started, 1)
        print(REPORT_PREFIX + json.dumps(report), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    asyncio.run(main(Path(args[0]).resolve(), args[1:cut], args[cut + 1:]))
