"""Addresses and ports for the rendezvous of trainer ranks, weight-sync groups and engines.

On one machine everything meets on the loopback interface. In a Ray cluster of more than one node
a listener that others must reach (rank 0's TCP store, a weight-sync group's sender, an SGLang
server) uses its node's routable address, :func:`node_address` (:func:`rendezvous_host` picks
between the two), and whoever connects is told that address through Ray.

Placement: a Ray node started with the custom resource ``megarl_trainer`` (or ``megarl_engine``),
e.g. ``ray start --resources='{"megarl_engine": 1}'``, takes that many trainer ranks (engines);
when some node of the cluster offers the resource, every trainer rank (engine) asks for one unit
of it, so the ranks and the engines land on the nodes meant for them (:func:`role_resources`).
Without such nodes Ray places them by CPUs and GPUs alone.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
ROLES = ("trainer", "engine")


def _ray():
    """The ray module when this process is a Ray driver or worker, else None."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    return ray if ray.is_initialized() else None


def _routable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.version == 4 and not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


def _source_toward(host: str) -> str | None:
    """The local address that traffic to ``host`` leaves from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            address = s.getsockname()[0]
    except OSError:
        return None
    return address if _routable(address) else None


def _head_host() -> str | None:
    """The cluster head this process was told about: MASTER_ADDR, else the host of RAY_ADDRESS."""
    head = os.environ.get("MASTER_ADDR")
    if head:
        return head
    ray_address = os.environ.get("RAY_ADDRESS", "")
    if ray_address and "://" not in ray_address and ray_address != "auto":
        return ray_address.rsplit(":", 1)[0]
    return None


def _interface_address() -> str | None:
    """The hostname's address when routable, else the first routable IPv4 address of an interface."""
    try:
        address = socket.gethostbyname(socket.gethostname())
        if _routable(address):
            return address
    except OSError:
        pass
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and _routable(a.address):
                return a.address
    return None


def node_address() -> str:
    """This node's routable IPv4 address.

    In a Ray driver or worker: the address Ray knows the node by (``ray.util.get_node_ip_address``).
    Elsewhere: the address that routes toward the head (``MASTER_ADDR``, or the host of
    ``RAY_ADDRESS``, as ``slurm/megarl.sbatch`` exports them), else the hostname's address, else
    the first routable interface address; the loopback address when there is none. Nothing is sent.
    """
    ray = _ray()
    if ray is not None:
        return ray.util.get_node_ip_address()
    head = _head_host()
    address = _source_toward(head) if head else None
    return address or _interface_address() or LOOPBACK


def cluster_nodes() -> int:
    """Alive nodes of the Ray cluster this process belongs to (1 outside Ray)."""
    ray = _ray()
    if ray is None:
        return 1
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def rendezvous_host() -> str:
    """Where this process's listeners should bind and be reached: this node's routable address in
    a Ray cluster of more than one node, the loopback address otherwise."""
    return node_address() if cluster_nodes() > 1 else LOOPBACK


LISTEN_PORTS_FLOOR = 20000  # above Ray's worker ports (10002-19999), below the kernel's ephemeral range


def _ephemeral_floor() -> int:
    """The lowest local port the kernel gives outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago, for a listener that starts a little later.

    Drawn at random between Ray's worker ports and the kernel's ephemeral range: a port the kernel
    hands out (``bind(0)``) is also the local port of the next outgoing connection, and a busy
    machine makes many (Ray, HTTP), so between this call and the listener's ``bind`` such a port is
    sometimes taken (``EADDRINUSE``, seen in the test suite). Falls back to the kernel's choice when
    that range is too small or full."""
    import random

    low = _ephemeral_floor()
    rng = random.SystemRandom()
    for _ in range(64 if low - LISTEN_PORTS_FLOOR >= 1024 else 0):
        port = rng.randrange(LISTEN_PORTS_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def interface_of(address: str) -> str | None:
    """The name of the network interface that carries ``address`` (None when none does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def role_resources(role: str) -> dict[str, float]:
    """The Ray custom resources one trainer rank (``role="trainer"``) or engine (``"engine"``)
    asks for: ``{"megarl_<role>": 1}`` when some node of the cluster offers it, else none."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    ray = _ray()
    name = f"megarl_{role}"
    if ray is None or name not in ray.cluster_resources():
        return {}
    return {name: 1.0}


def pin_gloo_interface() -> str | None:
    """In a Ray cluster of more than one node, point gloo at the interface of :func:`node_address`
    (``GLOO_SOCKET_IFNAME``, unless it is set): gloo otherwise binds to the address the hostname
    resolves to, often a loopback address no other node can reach. The interface, or None."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or cluster_nodes() <= 1:
        return os.environ.get("GLOO_SOCKET_IFNAME")
    iface = interface_of(node_address())
    if iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    return iface
