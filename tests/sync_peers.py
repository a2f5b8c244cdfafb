"""The two sides of a weight-sync group as small processes, driven line by line (JSON) on stdin.

``python tests/sync_peers.py sender`` is a trainer stage's sending rank: the real
:class:`megarl.sync.transports.distributed.DistributedSender` (group formation, bounded broadcasts).
``python tests/sync_peers.py receiver`` is an engine rank: it joins through
:func:`megarl.engine_process.update_group.join`, what SGLang's ``/init_weights_update_group`` runs in a
megarl engine, and receives each bucket with the broadcast SGLang's receive path makes. Every
command is answered by one JSON line per event (``ready`` first, once imported; ``joined``, ``sent``,
``received``, ``closed``,
``error`` with the exception's type and message), each with ``t``, the wall-clock time it happened;
``recv`` and ``send`` run in a thread of their own (one per stage), so a receiver serves several
groups at once. Buckets hold :func:`pattern` bytes, which the receiver checks.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import types

import torch


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """The bytes of bucket ``seed`` (uint8 [nbytes])."""
    return ((torch.arange(nbytes, dtype=torch.int64) * (2 * seed + 1) + seed) % 251).to(torch.uint8)


_out = threading.Lock()


def reply(**event) -> None:
    with _out:
        print(json.dumps({**event, "t": time.time()}), flush=True)


def guarded(method):
    """``method(self, command)`` answering an exception with an ``error`` event."""
    def run(self, command: dict) -> None:
        try:
            method(self, command)
        except Exception as e:
            reply(op="error", stage=command.get("stage"), error=type(e).__name__, message=str(e)[:400])
    return run


class Sender:
    def __init__(self):
        self.senders = {}

    @guarded
    def join(self, c: dict) -> None:
        from megarl.sync.transports.distributed import DistributedSender, DistributedSpec

        time.sleep(c.get("delay_s", 0.0))
        spec = DistributedSpec(group_prefix=c["prefix"], engine_ranks=c["ranks"], timeout_s=c["timeout_s"])
        self.senders[c["stage"]] = DistributedSender(spec, c["stage"], c["host"], c["port"])
        reply(op="joined", stage=c["stage"])

    @guarded
    def send(self, c: dict) -> None:
        sender = self.senders[c["stage"]]
        for seq in range(c["count"]):
            seed = c["seed"] + seq
            bucket = types.SimpleNamespace(buffer=pattern(c["nbytes"], seed), index=types.SimpleNamespace(seq=seq))
            sender.transfer(bucket)
            reply(op="sent", stage=c["stage"], seed=seed)

    @guarded
    def close(self, c: dict) -> None:
        self.senders.pop(c["stage"]).close()
        reply(op="closed", stage=c["stage"])


class Receiver:
    def __init__(self):
        self.groups = {}

    @guarded
    def join(self, c: dict) -> None:
        from megarl.engine_process.update_group import join
        from megarl.sync.transports.distributed import group_name

        time.sleep(c.get("delay_s", 0.0))
        name = group_name(c["prefix"], c["stage"], c["timeout_s"])
        self.groups[c["stage"]] = join(c["host"], c["port"], c["rank"], c["world"], name, "gloo")
        reply(op="joined", stage=c["stage"])

    @guarded
    def recv(self, c: dict) -> None:
        group = self.groups[c["stage"]]
        for seq in range(c["count"]):
            seed = c["seed"] + seq
            buffer = torch.empty(c["nbytes"], dtype=torch.uint8)
            torch.distributed.broadcast(buffer, src=0, group=group)
            intact = bool(torch.equal(buffer, pattern(c["nbytes"], seed)))
            reply(op="received", stage=c["stage"], seed=seed, intact=intact)

    @guarded
    def close(self, c: dict) -> None:
        torch.distributed.destroy_process_group(self.groups.pop(c["stage"]))
        reply(op="closed", stage=c["stage"])


def main(role: str) -> None:
    import sglang.srt.utils.common  # noqa: F401  (the joins' imports, before the peer says it is ready)

    import megarl.engine_process.update_group  # noqa: F401
    import megarl.sync.transports.distributed  # noqa: F401

    peer = Sender() if role == "sender" else Receiver()
    reply(op="ready")
    threads = []
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        if command["op"] in ("send", "recv"):
            threads.append(threading.Thread(target=getattr(peer, command["op"]), args=(command,), daemon=True))
            threads[-1].start()
        else:
            getattr(peer, command["op"])(command)
    reply(op="exit")


if __name__ == "__main__":
    main(sys.argv[1])
