"""The placement rehearsal's stand-in for an SGLang server: ``python -m megarl.rehearsal.stand_in_server``
with the command line megarl gives SGLang (:meth:`megarl.engines.server.SGLangEngine.command`).

It loads nothing. It prints one line, ``REHEARSAL-SERVER {json}``, to its output (the engine's log): its
flags, the node it runs on, ``CUDA_VISIBLE_DEVICES``, its ``NCCL_*`` variables and where its output goes;
node 0 of an engine over several nodes listens at its ``--dist-init-addr`` and records the node ranks that
reached it there, as SGLang's ranks meet, and every other node records whether it reached it. It then
answers what megarl asks of a starting server (``/health``; ``/model_info`` and ``/freeze_gc`` with the
engine's API key, as SGLang's ``--api-key`` does) until it is terminated.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megarl.parallel.network import node_address
from megarl.rehearsal.stand_ins import nccl_variables
from megarl.wire.launch import API_KEY_ENV

RECORD_PREFIX = "REHEARSAL-SERVER "
REACH_TIMEOUT_S = 60.0  # how long a node of an engine tries to reach node 0's --dist-init-addr


def flags_of(argv: list[str]) -> dict[str, str]:
    """``--name value`` pairs of ``argv`` (a flag without a value maps to "")."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out[argv[i]] = argv[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def meet(flags: dict[str, str], record: dict) -> None:
    """Node ranks of an engine over several nodes meet at node 0's ``--dist-init-addr``: node 0 listens there
    (recording who arrives, in ``record["joined"]``, on a thread), the others connect and say their rank
    (``record["reached"]``)."""
    nnodes, rank = int(flags.get("--nnodes", 1)), int(flags.get("--node-rank", 0))
    if nnodes == 1:
        return
    host, port = flags["--dist-init-addr"].rsplit(":", 1)
    if rank == 0:
        listener = socket.create_server((host, int(port)))
        record["joined"] = []

        def accept() -> None:
            while True:
                conn, _ = listener.accept()
                with conn:
                    record["joined"].append(int(conn.recv(16).decode() or -1))
                    print(RECORD_PREFIX + json.dumps({"joined": record["joined"]}), flush=True)

        threading.Thread(target=accept, daemon=True).start()
        return
    deadline, record["reached"] = time.monotonic() + REACH_TIMEOUT_S, False
    while time.monotonic() < deadline and not record["reached"]:
        try:
            with socket.create_connection((host, int(port)), timeout=3) as conn:
                conn.sendall(str(rank).encode())
            record["reached"] = True
        except OSError:
            time.sleep(0.2)


class Handler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        key = os.environ.get(API_KEY_ENV)
        return not key or self.headers.get("Authorization") == f"Bearer {key}"

    def do_GET(self):
        if self.path == "/health":
            self._answer(200, {})
        elif not self._authorised():
            self._answer(401, {"error": "unauthorised"})
        else:
            self._answer(200, {"weight_version": "0"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(200 if self._authorised() else 401, {})

    def log_message(self, *args):
        pass


def main(argv: list[str]) -> None:
    flags = flags_of(argv)
    record = {"argv": argv, "flags": flags, "address": node_address(),
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "nccl": nccl_variables(),
              "output": os.path.realpath("/proc/self/fd/1"), "cwd": os.getcwd()}
    meet(flags, record)
    print(RECORD_PREFIX + json.dumps(record), flush=True)
    ThreadingHTTPServer((flags["--host"], int(flags["--port"])), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
