"""The torch-free store client (``storeclient``) against a real ``TCPStore`` server, side by
side with torch's own client; and the peer daemon's process, which must not load torch.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from peerdaemons import Daemon, call, stop_all
from peerdaemons import start as start_daemons

from ckptpilot.tiers.peer.protocol import Op
from ckptpilot.tiers.peer.registry import (
    NodeState,
    RegistryError,
    connect_registry,
    connect_store,
    host_registry,
    host_store,
)
from ckptpilot.tiers.peer.storeclient import StoreClient

ROOT = Path(__file__).resolve().parents[1]


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


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_daemon_module_imports_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, ckptpilot.tiers.peer.daemon, "
         "ckptpilot.tiers.peer.command, ckptpilot.tiers.peer; print('torch' in sys.modules)"],
        capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_a_serving_daemon_announced_in_the_registry_has_no_torch_mapped(
        tmp_path: Path) -> None:
    """A daemon stores bytes and announces itself; torch would cost every daemon hundreds of
    MB and seconds of CPU to start, which a host of many daemons cannot afford."""
    store = host_registry("127.0.0.1", 0, num_nodes=2)
    daemon = Daemon(tmp_path / "d.log", "--registry", f"127.0.0.1:{store.port}", "--node", "1",
                    "--mem-limit", "16MiB", "--log-level", "WARNING")
    start_daemons([daemon])
    try:
        reader = connect_registry(f"127.0.0.1:{store.port}", timeout_seconds=10)
        deadline = time.monotonic() + 30
        state: NodeState | None = None
        while time.monotonic() < deadline:
            state = reader.read(1)
            if state is not None and state.status == "up":
                break
            time.sleep(0.05)
        assert state is not None and state.endpoint == daemon.endpoint
        pong = call(daemon.endpoint, Op.PING, {}, timeout_seconds=10)
        assert pong.header["mem_limit"] == 16 * 2**20
        assert daemon.proc is not None
        pid = daemon.proc.pid
        assert not _maps_torch(pid)
        info = psutil.Process(pid).memory_full_info()
        print(f"\npeer daemon with a registry: RSS {info.rss / 2**20:.1f} MiB, "
              f"unique {info.uss / 2**20:.1f} MiB")
    finally:
        stop_all([daemon])
        del store
