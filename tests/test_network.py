"""Listening ports (megarl/parallel/network.py): drawn where outgoing connections and Ray's workers do not
take them, free when drawn, and the kernel's choice when that range is unusable."""
import socket

import pytest

from megarl.parallel import network

pytestmark = pytest.mark.unit


def test_free_ports_are_outside_ray_and_the_ephemeral_range_and_bindable():
    low = network._ephemeral_floor()
    ports = {network.free_port() for _ in range(20)}
    assert all(network.LISTEN_PORTS_FLOOR <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind((network.LOOPBACK, port))
            s.listen()


def test_a_range_too_small_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(network, "_ephemeral_floor", lambda: network.LISTEN_PORTS_FLOOR + 10)
    port = network.free_port()
    assert not network.LISTEN_PORTS_FLOOR <= port < network.LISTEN_PORTS_FLOOR + 10
    with socket.socket() as s:
        s.bind((network.LOOPBACK, port))
