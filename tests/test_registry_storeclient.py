"""The torch-free store client (``storeclient``) against a real ``TCPStore`` server, side by
side with torch's own client (the peer daemons announce themselves with it)."""

from __future__ import annotations

import socket
import threading

import pytest

from ckptpilot.tiers.peer.registry import (
    RegistryError,
    connect_registry,
    connect_store,
    host_store,
)
from ckptpilot.tiers.peer.storeclient import StoreClient


@pytest.fixture
def server():
    store = host_store("127.0.0.1", 0, timeout_seconds=10)
    yield store
    del store


def test_every_request_sees_the_same_keys_and_values_as_torchs_client(server) -> None:
    ours = StoreClient("127.0.0.1", server.port, timeout_seconds=10)
    theirs = connect_store("127.0.0.1", server.port, timeout_seconds=10)
    try:
        ours.set("a", "ünï")
        theirs.set("b", b"\x00\xff")
        assert theirs.get("a") == ours.get("a") == "ünï".encode()
        assert ours.multi_get(["b", "a"]) == theirs.multi_get(["b", "a"]) == [
            b"\x00\xff", "ünï".encode()]
        assert ours.add("n", 5) == 5 and theirs.add("n", 2) == 7 and ours.add("n", -10) == -3
        assert ours.check(["a", "b"]) and theirs.check(["a", "b"])
        assert not ours.check(["a", "missing"]) and not theirs.check(["a", "missing"])
        assert ours.compare_set("cas", "", "") == b""  # creates it empty: a read that never blocks
        assert ours.compare_set("cas", "", "x") == b"x"
        assert theirs.compare_set("cas", "y", "z") == ours.compare_set("cas", "y", "z") == b"x"
        assert theirs.compare_set("cas", "x", "t") == b"t" and ours.get("cas") == b"t"
    finally:
        ours.close()


def test_a_get_of_a_missing_key_times_out_and_the_connection_is_dropped(server) -> None:
    ours = StoreClient("127.0.0.1", server.port, timeout_seconds=0.5)
    with pytest.raises(TimeoutError):
        ours.get("never-set")
    with pytest.raises(ConnectionError, match="reconnect"):
        ours.add("n", 1)
    later = StoreClient("127.0.0.1", server.port, timeout_seconds=5)
    server.set("never-set", "now")
    assert later.get("never-set") == b"now"
    later.close()


def test_a_server_that_is_no_store_is_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def answer() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP")  # four bytes, not the PING's echo

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(ConnectionError, match=r"not a torch\.distributed TCPStore"):
            StoreClient("127.0.0.1", port, timeout_seconds=5)
        t.join()


def test_connect_registry_names_the_address_when_the_store_goes_silent() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:  # accepts, never answers
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(RegistryError, match=f"health registry at {address}: timed out"):
            connect_registry(address, timeout_seconds=0.5)
