"""Fake nodes for the placement rehearsal and the multi-node tests: one Linux network namespace per
node, joined by a bridge.

Each node has its own network stack: its own loopback (what one node binds on 127.0.0.1 no other
node reaches) and one interface, ``eth0``, a veth pair whose other end is a port of a bridge in the
root namespace; the nodes have the addresses ``<subnet>.2``, ``<subnet>.3``, ... of a private /24
and no other route (nothing outside the bridge is reachable from a node; the root namespace gets no
address on the bridge). Processes run in a node through ``ip netns exec``; they share the file
system and the process table with everything else, as the nodes of a cluster with a shared file
system would, but not /dev/shm: each node's is a directory of its own (``/dev/shm/<namespace>``,
bind-mounted on /dev/shm in every process started in the node), as each machine has its own shared
memory (SGLang, for one, decides which ranks share a node by opening a shared-memory segment).

Names carry the owning process's pid (``mrl<pid><seq>n<i>`` for namespaces, ``...b`` for the
bridge, ``...v<i>`` for the root-side veth ends), so :func:`clean_stale` can remove what a crashed
run left behind without touching the nodes of a run still going (two pytest workers may each hold
a cluster). Needs root and iproute2: :func:`missing_prerequisite` says what is missing.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megarl.lifetime import die_with_parent

PREFIX = "mrl"
SUBNET = "10.213.0"  # private /24 of the fake nodes: node i is SUBNET.(i + 2)
IFACE = "eth0"  # the node's side of its veth pair
SHM_ROOT = "/dev/shm"  # node <namespace>'s /dev/shm is SHM_ROOT/<namespace>
_NAME = re.compile(rf"^{PREFIX}(\d+)([a-z])(?:[nbv]\d*)$")
_sequence = itertools.count()


def missing_prerequisite() -> str | None:
    """Why fake nodes cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "fake nodes need root (network namespaces, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "fake nodes need iproute2's `ip`"
    probe = f"{PREFIX}{os.getpid()}zprobe"[:15]
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _ip("-o", "link", "show").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(namespace: str) -> list[int]:
    """Processes running in ``namespace``."""
    result = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def kill_namespace_processes(namespace: str | list[str], grace_s: float = 5.0, hard: bool = False) -> list[int]:
    """SIGTERM every process in ``namespace`` (one, or several at once: one grace period for all),
    SIGKILL what is left after ``grace_s``; their pids. ``hard``: SIGKILL at once (a node that dies,
    rather than one shut down)."""
    namespaces = [namespace] if isinstance(namespace, str) else list(namespace)

    def running() -> list[int]:
        return [pid for name in namespaces for pid in namespace_pids(name)]

    pids = running()
    signals = ((signal.SIGKILL, 5.0),) if hard else ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0))
    for sig, wait in signals:
        for pid in running():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while running() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not running():
            break
    return pids


def _shm_dirs() -> list[str]:
    return [p.name for p in Path(SHM_ROOT).iterdir() if _NAME.match(p.name) and p.is_dir()]


def _remove(namespaces: list[str], links: list[str], shm: list[str] = ()) -> None:
    for ns in namespaces:
        kill_namespace_processes(ns)
    for link in links:
        _ip("link", "del", link, check=False)  # a veth takes its peer along
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    for name in {*namespaces, *shm}:
        shutil.rmtree(Path(SHM_ROOT) / name, ignore_errors=True)


def clean_stale() -> list[str]:
    """Remove the namespaces and links of fake nodes whose owning process is gone; their names."""
    stale_ns = [n for n in _namespaces() if (m := _NAME.match(n)) and not _alive(int(m.group(1)))]
    stale_links = [n for n in _links() if (m := _NAME.match(n)) and not _alive(int(m.group(1)))]
    # veth ends first, the bridges last
    stale_links.sort(key=lambda n: n.endswith("b"))
    stale_shm = [n for n in _shm_dirs() if not _alive(int(_NAME.match(n).group(1))) and n not in stale_ns]
    _remove(stale_ns, stale_links, stale_shm)
    return stale_ns + stale_links + stale_shm


@dataclass
class Node:
    """One fake node: a network namespace with ``address`` on its ``eth0``."""

    index: int
    namespace: str
    address: str
    iface: str = IFACE
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def shm(self) -> str:
        """The directory that is this node's /dev/shm."""
        return f"{SHM_ROOT}/{self.namespace}"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node (``ip netns exec`` gives it a mount namespace of its own, where
        the node's /dev/shm is mounted)."""
        return ["ip", "netns", "exec", self.namespace, "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"',
                self.shm, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in this node (in a session of its own); it is killed at teardown, and by the kernel
        when the thread that started it ends (:func:`megarl.lifetime.die_with_parent`: a killed test worker's
        Ray nodes and drivers end with it)."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("preexec_fn", die_with_parent)
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in this node to its end (``subprocess.run`` arguments)."""
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        return namespace_pids(self.namespace)


class FakeNodes:
    """``count`` fake nodes on one bridge; a context manager (``up`` on enter, ``down`` on exit)."""

    def __init__(self, count: int, subnet: str = SUBNET):
        if not 1 <= count <= 200:
            raise ValueError(f"count must be in [1, 200], got {count}")
        self.count, self.subnet = count, subnet
        tag = f"{PREFIX}{os.getpid()}{chr(ord('a') + next(_sequence) % 26)}"
        self.bridge = f"{tag}b"
        self.nodes = [Node(i, f"{tag}n{i}", f"{subnet}.{i + 2}") for i in range(count)]
        self._veths = [f"{tag}v{i}" for i in range(count)]
        if max(len(n) for n in [self.bridge, *self._veths]) > 15:
            raise ValueError(f"interface names too long for pid {os.getpid()}")

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self.nodes)

    def up(self) -> FakeNodes:
        """Create the bridge and the nodes (after removing stale ones of crashed runs)."""
        clean_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for node, veth in zip(self.nodes, self._veths):
                os.makedirs(node.shm)
                _ip("netns", "add", node.namespace)
                _ip("-n", node.namespace, "link", "set", "lo", "up")
                _ip("link", "add", veth, "type", "veth", "peer", "name", node.iface, "netns", node.namespace)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.iface)
                _ip("-n", node.namespace, "link", "set", node.iface, "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process in the nodes, remove the veths, the namespaces and the bridge."""
        for node in self.nodes:
            for process in node.processes:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            node.processes.clear()
        existing = set(_namespaces())
        _remove([n.namespace for n in self.nodes if n.namespace in existing], [*self._veths, self.bridge],
                [n.namespace for n in self.nodes])

    def set_link(self, index: int, up: bool) -> None:
        """Bring node ``index``'s link to the bridge (the root-side end of its veth) up or down: down,
        the node is cut off as by a pulled cable (packets dropped, no reset); up, it is back."""
        _ip("link", "set", self._veths[index], "up" if up else "down")

    def limit_rate(self, index: int, mbit: float | None) -> None:
        """Shape what the bridge sends into node ``index`` to ``mbit`` Mbit/s (a token bucket); None: unshaped."""
        if mbit is None:
            subprocess.run(["tc", "qdisc", "del", "dev", self._veths[index], "root"], capture_output=True)
            return
        subprocess.run(["tc", "qdisc", "replace", "dev", self._veths[index], "root", "tbf", "rate", f"{mbit}mbit",
                        "burst", "16kb", "latency", "1s"], check=True, capture_output=True)

    def bytes_into(self, index: int) -> int:
        """Bytes the bridge has sent into node ``index`` so far (its veth's counter)."""
        return int(Path(f"/sys/class/net/{self._veths[index]}/statistics/tx_bytes").read_text())

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (namespaces, links, shared-memory directories); [] after
        :meth:`down`."""
        names = {n.namespace for n in self.nodes} | {self.bridge, *self._veths}
        return sorted(names & (set(_namespaces()) | set(_links()) | set(_shm_dirs())))

    def __enter__(self) -> FakeNodes:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def node_of_pid(pid: int, nodes: FakeNodes) -> Node | None:
    """The fake node whose namespace ``pid`` runs in (None: another namespace, or gone)."""
    try:
        ns_inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    for node in nodes:
        if os.stat(Path("/run/netns") / node.namespace).st_ino == ns_inode:
            return node
    return None
