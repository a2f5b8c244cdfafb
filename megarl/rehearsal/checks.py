"""What the placement rehearsal checks, from what its stand-ins recorded (:mod:`megarl.rehearsal.stand_ins`)
against the plan (:func:`megarl.planner.placement.place`): each check returns the problems it found, one
line each.

- placement: every trainer rank and engine rank on the node the plan says (the plan's node numbers are
  matched to the cluster's nodes one to one: the first rank seen on a node names it), trainer ranks on a
  GPU each (their ``CUDA_VISIBLE_DEVICES``), an engine rank's GPU (its server's ``--base-gpu-id`` within its
  ``CUDA_VISIBLE_DEVICES``) the one of the trainer rank it shares (colocated) or one no trainer rank and
  no other engine rank uses (disaggregated), the engine's ``--tp-size``, ``--nnodes`` and ``--node-rank``
  as planned and its nodes met at node 0's ``--dist-init-addr``;
- CUDA IPC: with ``sync.transport=tensor`` every engine rank fed by a trainer rank on its node and GPU
  (:func:`megarl.sync.transports.tensor.tensor_feeds`);
- NCCL: every trainer rank and engine server with the same ``NCCL_*`` environment (they meet in the
  weight-sync groups);
- paths: every path handed to a process on another node absolute (the run directory, the weight-sync
  work directory, the checkpoints, each server's model and log).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from megarl.config.topology import RunTopology
from megarl.engines.pinning import shared_trainer_rank
from megarl.engines.server import nodes_of
from megarl.planner.placement import PlacementPlan
from megarl.sync.transports.tensor import tensor_feeds


@dataclass
class Records:
    """What the stand-ins recorded: ``trainer[i]`` rank i's (:meth:`StandInRank.recorded`), ``servers[(e, k)]``
    the server of node ``k`` of policy engine ``e`` (its ``REHEARSAL-SERVER`` lines, merged)."""

    trainer: list[dict]
    servers: dict[tuple[int, int], dict] = field(default_factory=dict)


class NodeNames:
    """The plan's node numbers matched to the cluster's node addresses, one to one."""

    def __init__(self):
        self.of_plan: dict[int, str] = {}

    def check(self, plan_node: int, address: str, who: str) -> str | None:
        """A problem when ``who``, planned on ``plan_node``, runs on ``address`` while that plan node is another
        address, or that address another plan node (None when they match; the first one seen names it)."""
        known = self.of_plan.get(plan_node)
        if known is None:
            taken = [n for n, a in self.of_plan.items() if a == address]
            if taken:
                return (f"{who} runs on {address}, the node of planned node {taken[0]}, but the plan puts it on node "
                        f"{plan_node}")
            self.of_plan[plan_node] = address
            return None
        if known != address:
            return f"{who} runs on {address}, but the plan puts it on node {plan_node} ({known})"
        return None


def engine_rank_gpu(server: dict, local_rank: int) -> str | None:
    """The GPU id a server's node-local rank ``local_rank`` uses: SGLang's ``--base-gpu-id`` + the rank, counted
    within the server's ``CUDA_VISIBLE_DEVICES`` (unset: every GPU of the node, by its id; None when that
    names no such GPU)."""
    index = int(server["flags"].get("--base-gpu-id", 0)) + local_rank
    if server.get("cuda_visible_devices") is None:
        return str(index)
    visible = server["cuda_visible_devices"].split(",")
    return visible[index] if visible != [""] and index < len(visible) else None


def check_trainer(plan: PlacementPlan, records: Records, names: NodeNames) -> list[str]:
    problems = []
    for rank, (device, seen) in enumerate(zip(plan.trainer, records.trainer)):
        who = f"trainer rank {rank}"
        problems += [p for p in [names.check(device.node, seen["address"], who)] if p]
        if len(seen["gpus"]) != 1 or seen["cuda_visible_devices"] != seen["gpus"][0]:
            problems.append(f"{who}: Ray gave it GPUs {seen['gpus']}, CUDA_VISIBLE_DEVICES="
                            f"{seen['cuda_visible_devices']!r}: not one GPU of its own")
    held: dict[tuple[str, str], int] = {}
    for seen in records.trainer:
        for gpu in seen["gpus"]:
            other = held.setdefault((seen["address"], gpu), seen["rank"])
            if other != seen["rank"]:
                problems.append(f"trainer ranks {other} and {seen['rank']} share GPU {gpu} of {seen['address']}")
    return problems


def _server_flags(topology: RunTopology, engine: int, node: int, server: dict) -> list[str]:
    pool, flags = topology.policy, server["flags"]
    nnodes = nodes_of(pool.tp, topology.gpus_per_node)
    problems = []
    for flag, want in (("--tp-size", pool.tp), ("--nnodes", nnodes), ("--node-rank", node)):
        got = int(flags.get(flag, 1 if flag != "--node-rank" else 0))
        if got != want:
            problems.append(f"engine {engine} node {node}: {flag} {got}, the plan says {want}")
    if nnodes > 1 and node > 0 and not server.get("reached"):
        problems.append(f"engine {engine} node {node} did not reach node 0 at --dist-init-addr "
                        f"{flags.get('--dist-init-addr')}")
    return problems


def check_engines(topology: RunTopology, plan: PlacementPlan, records: Records, names: NodeNames) -> list[str]:
    pool = topology.policy
    per_node = pool.tp // nodes_of(pool.tp, topology.gpus_per_node)
    trainer_gpus = {(t["address"], g) for t in records.trainer for g in t["gpus"]}
    problems, used = [], {}
    for (engine, node), server in sorted(records.servers.items()):
        problems += _server_flags(topology, engine, node, server)
        for local in range(per_node):
            rank = node * per_node + local
            who = f"engine {engine} rank {rank}"
            problems += [p for p in [names.check(plan.engines[engine][rank].node, server["address"], who)] if p]
            gpu = engine_rank_gpu(server, local)
            if gpu is None:
                problems.append(f"{who}: --base-gpu-id {server['flags'].get('--base-gpu-id', 0)} + {local} is past its "
                                f"CUDA_VISIBLE_DEVICES={server.get('cuda_visible_devices')!r}")
                continue
            if pool.colocated:
                shared = records.trainer[shared_trainer_rank(engine, rank, pool.tp)]
                if (server["address"], gpu) != (shared["address"], shared["gpus"][0] if shared["gpus"] else None):
                    problems.append(f"{who} uses GPU {gpu} of {server['address']}, but shares trainer rank "
                                    f"{shared['rank']}'s device, GPU {shared['gpus']} of {shared['address']}")
            elif (server["address"], gpu) in trainer_gpus:
                problems.append(f"{who} uses GPU {gpu} of {server['address']}, a trainer rank's")
            other = used.setdefault((server["address"], gpu), who)
            if other != who:
                problems.append(f"{who} and {other} both use GPU {gpu} of {server['address']}")
    missing = {(e, k) for e in range(pool.num_engines) for k in range(nodes_of(pool.tp, topology.gpus_per_node))}
    problems += [f"engine {e} node {k}: no server started" for e, k in sorted(missing - set(records.servers))]
    return problems


def check_ipc(cfg: DictConfig, records: Records) -> list[str]:
    """With ``sync.transport=tensor``: every engine rank's feeding trainer rank on its node and GPU."""
    if cfg.sync.transport != "tensor":
        return []
    pool = cfg.topology.policy
    per_node = pool.tp // nodes_of(pool.tp, cfg.cluster.gpus_per_node)
    problems = []
    for rank, (engine, engine_rank) in sorted(tensor_feeds(pool.num_engines, pool.tp).items()):
        server = records.servers.get((engine, engine_rank // per_node))
        if server is None:
            continue
        feeder, gpu = records.trainer[rank], engine_rank_gpu(server, engine_rank % per_node)
        if (feeder["address"], feeder["gpus"][:1]) != (server["address"], [gpu]):
            problems.append(f"CUDA IPC: trainer rank {rank} (GPU {feeder['gpus']} of {feeder['address']}) feeds engine "
                            f"{engine} rank {engine_rank} on GPU {gpu} of {server['address']}: not its own GPU")
    return problems


def check_nccl(records: Records) -> list[str]:
    """Every process of the run's NCCL groups with the same NCCL environment."""
    seen = {f"trainer rank {t['rank']}": t["nccl"] for t in records.trainer}
    seen |= {f"engine {e} node {k}": s["nccl"] for (e, k), s in records.servers.items()}
    first_name, first = next(iter(seen.items()))
    return [f"NCCL environment of {name} {env} differs from {first_name}'s {first}"
            for name, env in seen.items() if env != first]


def check_paths(cfg: DictConfig, checkpoints: str, records: Records) -> list[str]:
    """Every path a process on another node is handed: absolute."""
    paths = {"logging.run_dir": cfg.logging.run_dir, "sync.work_dir": cfg.sync.work_dir, "checkpoints": checkpoints}
    for (e, k), server in records.servers.items():
        paths[f"engine {e} node {k} --model-path"] = server["flags"].get("--model-path", "")
        paths[f"engine {e} node {k} log"] = server.get("output", "")
    return [f"{name} is not an absolute path: {path!r}" for name, path in paths.items() if not Path(path).is_absolute()]


def check_all(cfg: DictConfig, checkpoints: str, plan: PlacementPlan, records: Records) -> list[str]:
    """Every check's problems, in order."""
    names = NodeNames()
    topology = cfg.topology
    return (check_trainer(plan, records, names) + check_engines(topology, plan, records, names)
            + check_ipc(cfg, records) + check_nccl(records) + check_paths(cfg, checkpoints, records))
