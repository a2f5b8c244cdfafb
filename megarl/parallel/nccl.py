"""The NCCL settings every process of a run takes alike: trainer ranks and SGLang engines meet in
NCCL communicators (the weight-sync groups), and NCCL needs the peers of one communicator on a node
to agree on how their buffers are allocated.

``NCCL_CUMEM_ENABLE``: SGLang's engine sets it to 0 in its own process unless it is already set
(``_set_envs_and_config`` in ``sglang/srt/entrypoints/engine.py``; 1 only for its symmetric-memory
and KV-shard options, which megarl does not pass), while a process that sets nothing runs with
NCCL's default (cuMem on since NCCL 2.19). Peers of one weight-update group on a node that disagree
have failed with ``transport/p2p.cc ... invalid argument`` elsewhere. Every trainer rank
(:func:`megarl.trainer.distributed.init_rank`) and every engine server
(:meth:`megarl.engines.server.SGLangEngine.environment`) therefore sets each variable of
:data:`PINNED` to the value of the process's environment, else its default here (SGLang's):
processes that inherit one environment (a Ray node's, the same on every node of a SLURM job) agree.
With cuMem off NCCL also leaves NVLS out (it needs cuMem buffers), on both sides.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

PINNED: dict[str, str] = {"NCCL_CUMEM_ENABLE": "0"}  # variable -> the value used when the environment has none


def nccl_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The value of each :data:`PINNED` variable for a process whose environment is ``environ``
    (default: this process's): the environment's own, else the default."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name, default) for name, default in PINNED.items()}


def pin_nccl_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :func:`nccl_environment` in ``environ`` (default: this process's, before its first NCCL
    communicator); what was set."""
    environ = os.environ if environ is None else environ
    values = nccl_environment(environ)
    environ.update(values)
    return values
