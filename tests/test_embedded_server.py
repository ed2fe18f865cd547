"""The harness's throwaway servers: a port taken between choosing and binding.

A port the OS said was free can be taken by anyone before the server binds
it (on a busy CI box an outgoing connection's ephemeral port, most often).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from taskiq_atomic_claim.harness import embedded_server
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    _pong,
    default_binary,
    ephemeral_ports,
)
from taskiq_atomic_claim.harness.embedded_server import free_port as real_free_port
from tests.topologies import cluster_port


@pytest.fixture
def squatter() -> Iterator[socket.socket]:
    """A listening socket on a port nobody asked it to leave."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(
    squatter: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    squatted = squatter.getsockname()[1]
    offered = iter([squatted, squatted])  # the race lost twice, then won
    monkeypatch.setattr(
        embedded_server, "free_port", lambda: next(offered, None) or real_free_port()
    )
    with LocalServer(default_binary()) as server:
        assert server.port != squatted
        assert _pong(server.port)


def test_a_port_the_caller_gave_is_never_swapped_for_another(
    squatter: socket.socket,
) -> None:
    squatted = squatter.getsockname()[1]
    with pytest.raises(RuntimeError, match=f"(?s)port {squatted}.*in use"):
        LocalServer(default_binary(), port=squatted).start()


def test_cluster_ports_and_their_bus_ports_stay_out_of_the_ephemeral_range() -> None:
    low, _high = ephemeral_ports()
    taken: set[int] = set()
    ports = [cluster_port(taken) for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(port + 10000 < low for port in ports)


def test_free_ports_stay_out_of_the_ephemeral_range() -> None:
    low, _high = ephemeral_ports()
    assert all(real_free_port() < low for _ in range(50))
