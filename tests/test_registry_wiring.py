"""The health registry wired to real processes (SPEC §6): ``ckptpilot peer registry`` and four
``ckptpilot peer serve --registry`` daemons announce, heartbeat, drain and leave; a
:class:`PeerTier` with ``tiers.peer.registry`` never places shards on a node marked down, and
marks a peer it finds dead down for every other client. Tests run in file order: the later
ones kill daemons and, last, the registry itself.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from peerdaemons import SECRET_FILE, Daemon, Registry, call, session, start, stop_all

from ckptpilot.policy import PeerTierPolicy
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.peer.membership import RegistryView
from ckptpilot.tiers.peer.protocol import TRAILER_BYTES, Op, encode_head, read_frame
from ckptpilot.tiers.peer.registry import (
    HealthRegistry,
    NodeState,
    RegistryError,
    connect_registry,
    host_store,
)

NODES = 4
MEM_LIMIT = 32 * 2**20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, list[Daemon]]]:
    """A registry of 4 nodes, then 4 daemons announcing themselves in it (in parallel)."""
    logs = tmp_path_factory.mktemp("registry-logs")
    registry = Registry(logs / "registry.log", NODES)
    daemons = [Daemon(logs / f"peer{k}.log", "--mem-limit", str(MEM_LIMIT), "--registry",
                      registry.address, "--node", str(k)) for k in range(NODES)]
    try:
        start(daemons)
        yield registry, daemons
    finally:
        stop_all(daemons)
        registry.stop()


@pytest.fixture(scope="module")
def reader(cluster: tuple[Registry, list[Daemon]]) -> HealthRegistry:
    return connect_registry(cluster[0].address, timeout_seconds=10)


def policy(registry: str, daemons: list[Daemon], **kw: object) -> PeerTierPolicy:
    options: dict[str, object] = {"enabled": True, "endpoints": [d.endpoint for d in daemons],
                                  "data_shards": 2, "parity": True, "registry": registry,
                                  "probe_interval": 0.2, "timeout_seconds": 3.0,
                                  "lease_seconds": 60.0, "secret_file": str(SECRET_FILE), **kw}
    return PeerTierPolicy(**options)  # type: ignore[arg-type]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def state_of(reader: HealthRegistry, node: int) -> NodeState:
    state = reader.read(node)
    assert state is not None, f"node {node} never published"
    return state


def listing(endpoint: str, run: str) -> list[dict[str, object]]:
    return list(call(endpoint, Op.LIST, {"run_id": run}, timeout_seconds=5).header["shards"])


def image(seed: int, n_floats: int = 100_000) -> bytes:
    return np.random.default_rng(seed).standard_normal(n_floats).astype(np.float32).tobytes()


def test_daemons_announce_themselves_up_and_heartbeat(
        cluster: tuple[Registry, list[Daemon]], reader: HealthRegistry) -> None:
    _, daemons = cluster
    assert reader.num_nodes == NODES and reader.node is None
    wait_for(lambda: len(reader.read_all()) == NODES, 2.0, "4 nodes in the registry")
    states = reader.read_all()
    assert {k: (s.status, s.endpoint, s.mem_limit_bytes) for k, s in states.items()} == {
        k: ("up", d.endpoint, MEM_LIMIT) for k, d in enumerate(daemons)}
    wait_for(lambda: all(state_of(reader, k).seq > s.seq for k, s in states.items()), 2.5,
             "a heartbeat from every node")
    with pytest.raises(RegistryError, match=r"a reader \(node=None\) cannot publish"):
        reader.publish(NodeState(node=0, status="up"))


def test_a_node_marked_down_is_never_chosen(cluster: tuple[Registry, list[Daemon]],
                                            reader: HealthRegistry) -> None:
    registry, daemons = cluster
    down = daemons[0]
    with PeerTier.from_policy(policy(registry.address, daemons), run_id="marked") as t:
        view = t.registry_view
        assert view is not None and not view.is_down(down.endpoint)
        reader.mark_down(0, "test: taken out for maintenance")
        wait_for(lambda: view.is_down(down.endpoint), 2.0, "the tier to see the mark")
        previous = None
        for c in range(1, 4):
            base = None if previous is None else (c - 1, previous)
            put = t.put(c, image(c), b"m", base=base)
            assert down.endpoint not in put.endpoints and len(set(put.endpoints)) == 3
            previous = image(c)
        assert bytes(t.fetch().image) == image(3)
    assert listing(down.endpoint, "marked") == []
    assert all(listing(d.endpoint, "marked") for d in daemons[1:])
    # Only the node itself revives it; here the test speaks for node 0 (its daemon runs on).
    node0 = connect_registry(registry.address, node=0, timeout_seconds=10)
    node0.publish(NodeState(node=0, status="up", endpoint=down.endpoint,
                            mem_limit_bytes=MEM_LIMIT))
    assert not reader.is_down(down.endpoint)


def test_a_reported_failure_of_a_daemon_that_answers_is_not_written(
        cluster: tuple[Registry, list[Daemon]], reader: HealthRegistry) -> None:
    """By the time a report is written the daemon may have restarted and published "up":
    the tier PINGs it first, and a daemon that answers is not marked down (heartbeats would
    keep that mark, and its healthy new incarnation out of every client's placement)."""
    registry, daemons = cluster
    with PeerTier.from_policy(policy(registry.address, daemons), run_id="answers") as t:
        view = t.registry_view
        assert view is not None
        before = state_of(reader, 1)
        view.report_failure(daemons[1].endpoint, "PUT from run 'answers' failed: "
                            "connection refused")
        view.close()  # writes what was reported
    after = state_of(reader, 1)
    assert (before.status, after.status) == ("up", "up") and after.reason == ""


def test_a_failure_report_that_waited_past_a_restart_does_not_mark_the_node_down() -> None:
    """Two daemons fail, their reports wait on a slow registry, both nodes publish "up"
    again (restarted); then the reports are written: the node whose daemon answers stays
    up, the one that still does not answer is marked down."""
    store = host_store("127.0.0.1", 0)
    store.set("ckptpilot/health/num_nodes", "2")
    address = f"127.0.0.1:{store.port}"
    nodes = [connect_registry(address, node=k, timeout_seconds=10) for k in range(2)]
    endpoints = ["127.0.0.1:9000", "127.0.0.1:9001"]

    def up(k: int) -> None:
        nodes[k].publish(NodeState(node=k, status="up", endpoint=endpoints[k]))

    gate = threading.Event()

    def slow_registry(*args: object, **kw: object) -> HealthRegistry:
        gate.wait(30)
        return connect_registry(*args, **kw)  # type: ignore[arg-type]

    for k in range(2):
        up(k)
    view = RegistryView(address, connect=slow_registry, refresh_seconds=60,
                        answers=lambda endpoint: endpoint == endpoints[0])
    for e in endpoints:
        view.report_failure(e, "PUT failed: connection refused")
    for k in range(2):
        up(k)
    gate.set()
    view.close()
    assert nodes[0].heartbeat().status == "up"
    down = nodes[1].heartbeat()
    assert (down.status, down.reason) == ("down", "PUT failed: connection refused")


@pytest.mark.crash
def test_a_killed_daemon_is_failed_over_and_marked_down(
        cluster: tuple[Registry, list[Daemon]], reader: HealthRegistry) -> None:
    registry, daemons = cluster
    # Probes are rare here, so the put itself finds the victim dead.
    # deltas always: which shards can travel as deltas is the point, not whether they pay.
    with PeerTier.from_policy(policy(registry.address, daemons, probe_interval=60.0,
                                     deltas="always"), run_id="killed") as t:
        first = t.put(1, image(11), b"m")
        victim = next(d for d in daemons if d.endpoint == first.endpoints[0])
        node = daemons.index(victim)
        victim.kill()
        again = t.put(2, image(12), b"m", base=(1, image(11)))
        assert victim.endpoint not in again.endpoints and len(set(again.endpoints)) == 3
        assert again.full_shards == 1 and again.delta_shards == 2  # re-placed on the spare
        assert bytes(t.fetch().image) == image(12)
        wait_for(lambda: state_of(reader, node).status == "down", 5.0,
                 "the registry to mark the killed node down")
        view = t.registry_view
        assert view is not None and view.is_down(victim.endpoint)
    state = state_of(reader, node)
    assert state.endpoint == victim.endpoint
    assert "DELTA from run 'killed' failed: connection refused" in state.reason


def test_sigterm_publishes_draining_then_down(cluster: tuple[Registry, list[Daemon]],
                                              reader: HealthRegistry) -> None:
    daemons = cluster[1]
    leaving = next(d for d in daemons if d.proc is not None and d.proc.poll() is None)
    node = daemons.index(leaving)
    assert leaving.proc is not None
    # A request in flight holds the daemon in its shutdown long enough to see "draining".
    body = bytes(4096)
    conn = session(leaving.endpoint)
    with conn.sock as sock:
        head = {"run_id": "slow", "ckpt_id": 1, "shard_index": 0, "shard_count": 1,
                "data_shards": 1, "kind": "data", "image_len": len(body),
                "shard_size": len(body), "meta_len": 0, "meta_digest": "0" * 32,
                "lease_seconds": 5.0}
        raw = encode_head(Op.PUT, head, len(body) + TRAILER_BYTES)
        sock.sendall(raw + conn.session.sign(raw) + body[:100])
        time.sleep(0.2)
        leaving.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: state_of(reader, node).status == "draining", 3.0,
                 "the leaving node to drain")
        assert state_of(reader, node).reason == "stopping (SIGTERM)"
        assert leaving.proc.poll() is None, "it finishes the request in flight first"
        sock.sendall(body[100:] + bytes(TRAILER_BYTES))
        reply = read_frame(sock, max_payload=0)
        assert reply is not None  # an ERR: the test's digests are zeros
    assert leaving.proc.wait(10) == 0
    state = state_of(reader, node)
    assert (state.status, state.reason) == ("down", "stopped (SIGTERM)")


def test_cli_rejects_bad_input_in_one_line(cluster: tuple[Registry, list[Daemon]],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from ckptpilot.cli import main

    registry, daemons = cluster
    busy_port = str(next(d.port for d in daemons if d.proc and d.proc.poll() is None))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    exits = [
        (["peer", "registry", "--nodes", "0"], "expected an integer >= 1, got 0"),
        (["peer", "registry"], "the following arguments are required: --nodes"),
        (["peer", "serve", "--registry", "nowhere", "--node", "0"], "expected a peer endpoint"),
        (["peer", "serve", "--registry", registry.address, "--node", "-1"],
         "expected an integer >= 0, got -1"),
    ]
    for argv, message in exits:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
    returns = [
        (["peer", "registry", "--port", busy_port, "--nodes", "2"],
         f"ckptpilot peer registry: error: cannot listen on 127.0.0.1:{busy_port}: "),
        (["peer", "registry", "--host", "999.1.1.1", "--nodes", "2"],
         "999.1.1.1 is no address of this machine"),
        (["peer", "serve", "--node", "1"], "--registry and --node go together"),
        (["peer", "serve", "--registry", registry.address, "--node", "9"],
         f"node 9 is out of range: the health registry at {registry.address} holds 4 nodes"),
        (["peer", "serve", "--registry", closed, "--node", "0", "--registry-timeout-seconds",
          "0.3"], f"cannot reach the health registry at {closed} within 0.3 s"),
        (["peer", "serve", "--host", "0.0.0.0", "--registry", registry.address, "--node", "0"],
         "give --advertise-host"),
    ]
    root = logging.getLogger()
    level = root.level
    try:
        for args, message in returns:
            # serve: past the secret, to the registry's checks
            argv = [*args, "--secret-file", str(SECRET_FILE)] if args[1] == "serve" else args
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    finally:
        root.setLevel(level)


def test_connect_registry_refuses_a_store_that_is_no_registry() -> None:
    store = host_store("127.0.0.1", 0, timeout_seconds=5)
    with pytest.raises(RegistryError, match=r"not a ckptpilot health registry; start one with"):
        connect_registry(f"127.0.0.1:{store.port}", timeout_seconds=5)


@pytest.mark.crash
def test_daemons_and_tiers_carry_on_when_the_registry_dies(
        cluster: tuple[Registry, list[Daemon]], caplog: pytest.LogCaptureFixture) -> None:
    registry, daemons = cluster
    alive = [d for d in daemons if d.proc is not None and d.proc.poll() is None]
    assert len(alive) >= 2
    registry.proc.kill()
    registry.proc.wait()
    time.sleep(2.5)  # two heartbeats fail
    for d in alive:
        assert call(d.endpoint, Op.PING, {}, timeout_seconds=5).op is Op.OK
        assert d.proc is not None and d.proc.poll() is None
        warnings = [line for line in d.log().splitlines() if "still serving shards" in line]
        assert len(warnings) == 1, d.log()  # once per outage, not once per heartbeat
    with caplog.at_level(logging.WARNING), PeerTier.from_policy(
            policy(registry.address, alive, data_shards=1, timeout_seconds=0.5),
            run_id="no-registry") as t:
        put = t.put(1, image(21), b"m")
        assert set(put.endpoints) <= {d.endpoint for d in alive}
        assert bytes(t.fetch().image) == image(21)
    assert f"cannot reach the health registry at {registry.address}" in caplog.text
