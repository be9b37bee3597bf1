"""The rendezvous store's socket is bound to the rendezvous address, never to every interface."""

from __future__ import annotations

import socket

import pytest

from towers.cluster.rendezvous import bound_listener


def test_a_local_address_gets_a_listening_socket_bound_to_it_alone():
    listener = bound_listener("127.0.0.1", 0)
    assert listener is not None
    fd, address = listener
    sock = socket.socket(fileno=fd)
    try:
        assert address == "127.0.0.1"
        assert sock.getsockname()[0] == "127.0.0.1"
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    finally:
        sock.close()


def test_an_address_of_another_host_or_an_unknown_name_gives_none():
    assert bound_listener("192.0.2.1", 0) is None  # TEST-NET-1: never an address of this host
    assert bound_listener("no-such-host.invalid", 0) is None


def test_a_busy_port_is_reported():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            bound_listener("127.0.0.1", busy.getsockname()[1])
