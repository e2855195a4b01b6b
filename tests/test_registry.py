"""The health registry against a real TCPStore: torn-read stress with real processes, a control
run proving the torn-read detector works, dead writers, malformed store contents.

The store server runs in the test process (``host_store`` on port 0); writers and readers are
separate Python processes (tests/registryjob.py), each with its own store client: torch's, or
the torch-free one the daemons use, mixed in one stress run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptpilot.tiers.peer.registry import (
    BITMAP_KEY,
    HealthRegistry,
    NodeState,
    RegistryError,
    RegistryFormatError,
    RegistryTimeoutError,
    connect_store,
    host_store,
)

JOB = Path(__file__).with_name("registryjob.py")
WRITERS = 3
READERS = 2
CLIENTS = ("torch", "python")  # torch's store client and the daemons' (storeclient), mixed


@pytest.fixture
def server():
    store = host_store("127.0.0.1", 0, timeout_seconds=10)
    yield store
    del store


def registry(server, node: int, num_nodes: int = 4, **kwargs) -> HealthRegistry:
    return HealthRegistry(connect_store("127.0.0.1", server.port, timeout_seconds=10),
                          node=node, num_nodes=num_nodes, **kwargs)


@pytest.fixture(scope="module")
def stress() -> tuple[list[dict], list[dict]]:
    """3 writer and 2 reader processes: a guarded phase (1.5 s, longer until each reader has
    read 20 states, at most 15 s), then a control phase (0.5 s)."""
    store = host_store("127.0.0.1", 0, timeout_seconds=30)
    common = ["--port", str(store.port), "--num-nodes", str(WRITERS + READERS),
              "--writers", str(WRITERS), "--parties", str(WRITERS + READERS)]
    procs = [subprocess.Popen([sys.executable, str(JOB), "writer", "--node", str(n), *common,
                               "--seconds", "1.5", "--max-seconds", "15", "--min-reads", "20",
                               "--control-seconds", "0.5", "--gap-seconds", "0.001",
                               "--client", CLIENTS[n % 2]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(WRITERS)]
    procs += [subprocess.Popen([sys.executable, str(JOB), "reader", "--node", str(WRITERS + r),
                                *common, "--client", CLIENTS[r % 2]],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for r in range(READERS)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print("\nregistry stress: writers", results[:WRITERS], "readers", results[WRITERS:])
    return results[:WRITERS], results[WRITERS:]


@pytest.mark.slow
def test_concurrent_multi_key_writes_are_never_read_torn(stress) -> None:
    writers, readers = stress
    assert all(w["guarded"] > 50 for w in writers), writers
    guarded = [r["guarded"] for r in readers]
    assert all(r["reads"] >= 20 for r in guarded), guarded
    assert sum(r["torn"] for r in guarded) == 0, guarded
    assert sum(r["regressions"] for r in guarded) == 0, guarded


@pytest.mark.slow
def test_control_writers_ignoring_the_protocol_are_read_torn(stress) -> None:
    """The same readers, while the writers skip the bit and the version: the torn-state check
    must fire, or the test above would prove nothing."""
    writers, readers = stress
    assert all(w["control"] > 20 for w in writers), writers
    assert sum(r["control"]["torn"] for r in readers) > 0, readers


def test_unknown_node_reads_as_none_and_out_of_range_is_refused(server) -> None:
    reg = registry(server, 0)
    assert reg.read(3) is None
    assert reg.read_all() == {}
    assert reg.is_down("127.0.0.1:9000") is False
    with pytest.raises(ValueError, match=r"node must be in \[0, 4\), got 4"):
        reg.read(4)
    with pytest.raises(ValueError, match="only publish its own state"):
        reg.publish(NodeState(node=1, status="up"))


def test_publish_read_heartbeat_round_trip(server) -> None:
    clock = iter([100.0, 101.5]).__next__
    a = registry(server, 0, clock=clock)
    b = registry(server, 1)
    stored = a.publish(NodeState(node=0, status="up", endpoint="10.0.0.1:7000",
                                 mem_limit_bytes=8 << 30))
    assert (stored.seq, stored.updated_at) == (1, 100.0)
    assert b.read(0) == stored
    beat = a.heartbeat(mem_used_bytes=123)
    assert (beat.seq, beat.updated_at, beat.mem_used_bytes, beat.status) == (2, 101.5, 123, "up")
    assert b.read_all() == {0: beat}
    with pytest.raises(RegistryError, match="node 1: nothing to heartbeat"):
        b.heartbeat()


def test_mark_down_is_visible_to_is_down_and_survives_heartbeats(server) -> None:
    a = registry(server, 0)
    b = registry(server, 1)
    a.publish(NodeState(node=0, status="up", endpoint="10.0.0.1:7000"))
    b.publish(NodeState(node=1, status="draining", endpoint="10.0.0.2:7000"))
    assert a.is_down("10.0.0.1:7000") is False
    assert a.is_down("10.0.0.2:7000") is False, "draining is not down"

    down = b.mark_down(0, "peer daemon unreachable")
    assert (down.status, down.reason, down.endpoint) == ("down", "peer daemon unreachable",
                                                         "10.0.0.1:7000")
    assert a.is_down("10.0.0.1:7000") is True
    assert a.heartbeat().status == "down", "a heartbeat must not revive a node marked down"
    assert b.is_down("10.0.0.1:7000") is True
    a.publish(NodeState(node=0, status="up", endpoint="10.0.0.1:7000"))
    assert b.is_down("10.0.0.1:7000") is False


def test_malformed_store_contents_raise_errors_naming_the_key(server) -> None:
    a = registry(server, 0)
    a.publish(NodeState(node=0, status="up", endpoint="h:1"))
    server.set("ckptpilot/health/node/0/info", "{not json")
    with pytest.raises(RegistryFormatError, match=r"ckptpilot/health/node/0/info: not JSON"):
        a.read(0)
    server.set("ckptpilot/health/node/0/info", json.dumps(
        {"v": 1, "endpoint": "h:1", "mem_used_bytes": -5, "mem_limit_bytes": 0,
         "updated_at": 0.0}))
    with pytest.raises(RegistryFormatError,
                       match=r"node/0/info: NodeState\.mem_used_bytes must be an integer >= 0"):
        a.read(0)
    server.set("ckptpilot/health/node/0/status", json.dumps({"v": 1, "state": "up"}))
    with pytest.raises(RegistryFormatError, match=r"node/0/status: expected the fields"):
        a.read(0)

    repaired = registry(server, 1).mark_down(0, "garbage in the store")
    assert (repaired.status, repaired.endpoint) == ("down", "")
    assert a.read(0) == repaired

    server.set(BITMAP_KEY, "zero:abc")
    with pytest.raises(RegistryFormatError, match=r"ckptpilot/health/bitmap: malformed entry"):
        a.read(0)


def test_node_state_json_round_trip_and_validation() -> None:
    state = NodeState(node=2, status="draining", endpoint="h:9", mem_used_bytes=1,
                      mem_limit_bytes=2, updated_at=3.5, seq=4, reason="leaving")
    assert NodeState.from_json(state.to_json()) == state
    with pytest.raises(RegistryFormatError, match="k: unknown field"):
        NodeState.from_json('{"node": 1, "status": "up", "colour": "red"}', key="k")
    with pytest.raises(RegistryFormatError, match=r"k: NodeState\.status must be one of"):
        NodeState.from_json('{"node": 1, "status": "sleepy"}', key="k")
    with pytest.raises(RegistryFormatError, match="k: expected a JSON object"):
        NodeState.from_json("[1]", key="k")


@pytest.mark.crash
def test_writer_killed_mid_write_times_readers_out_then_is_marked_down(server) -> None:
    """SIGKILL a writer holding its bit: readers time out naming the node; is_down takes the
    stale bit over and marks it down; the node can come back with a publish."""
    proc = subprocess.Popen([sys.executable, str(JOB), "hold", "--port", str(server.port),
                             "--node", "1", "--num-nodes", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "holding", proc.stderr.read() if proc.stderr else line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    reader = registry(server, 0, num_nodes=3, retry_timeout_seconds=0.5)
    start = time.monotonic()
    with pytest.raises(RegistryTimeoutError, match=r"node 1: no consistent state after 0\.\d s: "
                       r"bit 1 of the master bitmap is held.*probably died") as info:
        reader.read(1)
    assert info.value.stalled and info.value.node == 1
    assert time.monotonic() - start < 2.0

    start = time.monotonic()
    assert reader.is_down("127.0.0.1:9001") is True
    assert time.monotonic() - start < 2.0, "is_down must not wait a second timeout to take over"
    state = reader.read(1)
    assert state is not None
    assert (state.status, state.endpoint) == ("down", "127.0.0.1:9001")
    assert "stale write" in state.reason
    assert server.compare_set(BITMAP_KEY, "", "") == b""

    restarted = registry(server, 1, num_nodes=3, retry_timeout_seconds=0.5)
    restarted.publish(NodeState(node=1, status="up", endpoint="127.0.0.1:9001"))
    assert reader.is_down("127.0.0.1:9001") is False


@pytest.mark.crash
def test_writers_take_over_a_dead_writers_bit_after_the_timeout(server) -> None:
    proc = subprocess.Popen([sys.executable, str(JOB), "hold", "--port", str(server.port),
                             "--node", "2", "--num-nodes", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "holding"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    restarted = registry(server, 2, num_nodes=3, retry_timeout_seconds=0.3)
    start = time.monotonic()
    stored = restarted.publish(NodeState(node=2, status="up", endpoint="127.0.0.1:9002"))
    assert 0.3 <= time.monotonic() - start < 2.0
    assert registry(server, 0, num_nodes=3).read(2) == stored


def test_a_writer_presumed_dead_that_writes_on_is_never_read_as_part_of_a_state(server) -> None:
    """A slow writer (not dead) loses its bit to mark_down, then finishes its write: the
    stamps keep readers from accepting the mix, the slow writer is told, is_down repairs."""
    slow = registry(server, 0, retry_timeout_seconds=0.2)
    slow.publish(NodeState(node=0, status="up", endpoint="h:1", mem_used_bytes=1))
    slow._between_keys = lambda: time.sleep(1.0)
    errors: list[BaseException] = []

    def write_slowly() -> None:
        try:
            slow.publish(NodeState(node=0, status="draining", endpoint="h:1", mem_used_bytes=2))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=write_slowly)
    thread.start()
    other = registry(server, 1, retry_timeout_seconds=0.2)
    down = other.mark_down(0, "looked dead")  # takes the bit over after 0.2 s without progress
    assert (down.status, down.mem_used_bytes, down.seq) == ("down", 1, 3)
    thread.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], RegistryError)
    assert "taken over" in str(errors[0])

    # Now status is stamped 3 (down) and info 2 (the slow writer's late key): not one state.
    with pytest.raises(RegistryTimeoutError, match=r"node 0: .*stamped \[3, 2\], not seq 3"):
        other.read(0)
    assert other.is_down("h:1") is True
    state = other.read(0)
    assert state is not None and (state.status, state.seq) == ("down", 4)
