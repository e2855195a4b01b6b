"""The peer tier against real daemon processes (SPEC §6, §9): bit-exact put/fetch, parity
rebuild after a SIGKILL or a corrupted shard, delta folding, leases, LRU eviction, hostile
frames, SIGTERM, and placement."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
from peerdaemons import (
    KEY,
    SECRET_FILE,
    Daemon,
    call,
    put_frame,
    reply,
    restart,
    revive,
    session,
    start,
    stop_all,
    tagged,
)

from ckptpilot.codecs import get_codec
from ckptpilot.policy import PeerTierPolicy
from ckptpilot.tiers.peer import PeerRequestError, PeerTier, PeerUnavailable
from ckptpilot.tiers.peer.auth import NO_TAG
from ckptpilot.tiers.peer.daemon import PeerDaemon
from ckptpilot.tiers.peer.deltas import (
    BLOCK_BYTES,
    MIN_SAMPLE_BLOCKS,
    SAMPLE_BLOCKS,
    SAMPLE_SHARE,
    Estimate,
    blocks_payload,
    changed_blocks,
    choose,
    fold_blocks,
    parity_blocks_payload,
    sample_ranges,
)
from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.tiers.peer.errors import NotEnoughPeers
from ckptpilot.tiers.peer.parity import parity_of, shard_size, split
from ckptpilot.tiers.peer.placement import (
    PeerReading,
    PeerStatus,
    Placement,
    rank_peers,
)
from ckptpilot.tiers.peer.placement import (
    ping as ping_with,
)
from ckptpilot.tiers.peer.protocol import (
    BLOCKS,
    PRELUDE,
    TRAILER_BYTES,
    VERSION,
    XOR_DELTA,
    Op,
    bitmap_bytes,
    read_frame,
    shard_tensor,
)

CLUSTER = 5
MiB = 2**20


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Daemon]]]:
    """Five shared daemons with fault injection, and one small one (3.5 MiB, no faults) for
    leases, LRU and SIGTERM. Started once, in parallel; stopped with SIGTERM at the end."""
    logs = tmp_path_factory.mktemp("peer-logs")
    cluster = [Daemon(logs / f"peer{i}.log", "--mem-limit", "64MiB", "--allow-fault-injection")
               for i in range(CLUSTER)]
    small = [Daemon(logs / "small.log", "--mem-limit", "3.5MiB")]
    try:
        start([*cluster, *small])
        yield {"cluster": cluster, "small": small}
    finally:
        stop_all([*cluster, *small])


@pytest.fixture
def cluster(daemons: dict[str, list[Daemon]]) -> list[Daemon]:
    """The five shared daemons, all serving: any an earlier test killed is restarted empty
    here (lazily, so the tests that kill run last and cost no restart afterwards)."""
    return revive(daemons["cluster"])


@pytest.fixture
def small(daemons: dict[str, list[Daemon]]) -> Daemon:
    return revive(daemons["small"])[0]


def endpoints(nodes: list[Daemon]) -> list[str]:
    return [d.endpoint for d in nodes]


def tier(nodes: list[Daemon], run_id: str, **kw: object) -> PeerTier:
    options: dict[str, object] = {"probe_interval": 0.2, "timeout_seconds": 3.0,
                                  "lease_seconds": 60.0, "deltas": "always", **kw}
    return PeerTier(endpoints(nodes), run_id=run_id, secret=KEY,
                    **options)  # type: ignore[arg-type]


def weights(n_floats: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n_floats).astype(np.float32)


def by_endpoint(nodes: list[Daemon], endpoint: str) -> Daemon:
    return next(d for d in nodes if d.endpoint == endpoint)


def ping(endpoint: str) -> dict[str, int]:
    return call(endpoint, Op.PING, {}, timeout_seconds=5).header


def one_shard_header(run: str, ckpt: int, shard: bytes, *, lease_seconds: float = 60.0
                     ) -> dict[str, object]:
    """The PUT header of a checkpoint stored as one shard without parity, meta ``{}``."""
    return {"run_id": run, "ckpt_id": ckpt, "shard_index": 0, "shard_count": 1,
            "data_shards": 1, "kind": "data", "image_len": len(shard),
            "shard_size": len(shard), "meta_len": 2, "meta_digest": digest_of(b"{}"),
            "lease_seconds": lease_seconds}


def commit(endpoint: str, run: str, ckpt: int, shard: bytes, lease_seconds: float = 60.0
           ) -> None:
    call(endpoint, Op.COMMIT, {"run_id": run, "ckpt_id": ckpt, "lease_seconds": lease_seconds,
                               "stripe": [digest_of(shard)]}, timeout_seconds=10)


def raw_put(endpoint: str, run: str, ckpt: int, body: bytes, *, commit_it: bool = False,
            lease_seconds: float = 60.0) -> None:
    """One single-shard checkpoint (no parity) straight through the protocol."""
    header = one_shard_header(run, ckpt, body, lease_seconds=lease_seconds)
    call(endpoint, Op.PUT, header, [b"{}", body], timeout_seconds=10)
    if commit_it:
        commit(endpoint, run, ckpt, body, lease_seconds)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# ------------------------------------------------------------------------- put and fetch

def test_put_fetch_is_bit_exact(cluster: list[Daemon]) -> None:
    image = np.random.default_rng(1).bytes(1_000_003)  # odd length: the tail is padded
    meta = json.dumps({"step": 1, "tensors": ["w"]}).encode()
    with tier(cluster, "exact") as t:
        put = t.put(1, image, meta)
        assert len(set(put.endpoints)) == 4 and put.full_shards == 4 and put.delta_shards == 0
        size = shard_size(len(image), 3)
        assert put.bytes_sent == 4 * size
        got = t.fetch()
        assert got.ckpt_id == 1 and bytes(got.image) == image and got.meta == meta
        assert got.rebuilt_shard is None and got.bytes_fetched == 3 * size
        assert bytes(t.fetch(1).image) == image
        assert t.list() == [1]
        with pytest.raises(PeerUnavailable, match="checkpoint 9 of run 'exact' is held by no"):
            t.fetch(9)


def test_a_fetch_lands_in_the_callers_buffer(cluster: list[Daemon]) -> None:
    image = np.random.default_rng(19).bytes(300_001)
    buffer = np.full(400_000, 7, dtype=np.uint8)
    with tier(cluster, "into") as t:
        t.put(1, image, b"m")
        got = t.fetch(into=buffer)
        assert np.shares_memory(got.image, buffer) and got.image.size == len(image)
        assert bytes(got.image) == image and not (buffer[len(image):] - 7).any()
        with pytest.raises(ValueError, match="into holds 300000 bytes; checkpoint 1 of run "
                                             "'into' is 300001 bytes"):
            t.fetch(into=np.empty(300_000, dtype=np.uint8))
        with pytest.raises(ValueError, match="writable, contiguous 1-D uint8"):
            t.fetch(into=np.empty(400_000, dtype=np.float32))


def test_a_fresh_tier_fetches_and_deltas_what_another_put(cluster: list[Daemon]) -> None:
    old = weights(300_000, seed=2)
    new = old.copy()
    new[::7] += np.float32(1e-3)
    with tier(cluster, "fresh") as first:
        first.put(4, old.tobytes(), b"old")
    with tier(cluster, "fresh") as second:  # a restarted training process
        got = second.fetch()
        assert got.ckpt_id == 4 and bytes(got.image) == old.tobytes() and got.meta == b"old"
        put = second.put(5, new.tobytes(), b"new", base=(4, old.tobytes()))
        assert put.delta_shards == 4 and put.full_shards == 0  # layout found through LIST
        assert bytes(second.fetch().image) == new.tobytes()
        assert second.list() == [5]


def test_concurrent_clients_are_served(cluster: list[Daemon]) -> None:
    images = {f"busy-{i}": np.random.default_rng(10 + i).bytes(300_000) for i in range(4)}
    tiers = {run: tier(cluster, run) for run in images}
    try:
        with ThreadPoolExecutor(len(tiers)) as pool:
            for _ in range(3):
                list(pool.map(lambda run: tiers[run].put(1, images[run], run.encode()), tiers))
                fetched = dict(zip(tiers, pool.map(lambda t: t.fetch(), tiers.values()),
                                   strict=True))
                for run, got in fetched.items():
                    assert bytes(got.image) == images[run] and got.meta == run.encode()
    finally:
        for t in tiers.values():
            t.close()


def test_no_checkpoint_raises_peer_unavailable(cluster: list[Daemon]) -> None:
    with tier(cluster, "nothing-here") as t, pytest.raises(PeerUnavailable,
                                                           match="no committed checkpoint of run"):
        t.fetch()


def test_corrupted_shard_is_detected_and_rebuilt(cluster: list[Daemon]) -> None:
    image = weights(250_000, seed=5).tobytes()
    with tier(cluster, "corrupt") as t:
        put = t.put(3, image, b"m")
        target = {"run_id": "corrupt", "ckpt_id": 3}
        call(put.endpoints[1], Op.CORRUPT, {**target, "shard_index": 1}, timeout_seconds=5)
        got = t.fetch()
        assert got.rebuilt_shard == 1 and bytes(got.image) == image
        assert "fault injection: flipped byte" in by_endpoint(cluster, put.endpoints[1]).log()
        call(put.endpoints[2], Op.CORRUPT, {**target, "shard_index": 2}, timeout_seconds=5)
        with pytest.raises(PeerUnavailable, match=r"shard 1 @\S+: digest mismatch .*; "
                                                  r"shard 2 @\S+: digest mismatch"):
            t.fetch()


def test_corrupt_is_refused_without_the_fault_injection_flag(small: Daemon) -> None:
    ep = small.endpoint
    raw_put(ep, "no-faults", 1, bytes(64))
    with pytest.raises(PeerRequestError, match="--allow-fault-injection") as info:
        call(ep, Op.CORRUPT, {"run_id": "no-faults", "ckpt_id": 1, "shard_index": 0},
             timeout_seconds=5)
    assert info.value.code == "refused"
    call(ep, Op.DROP, {"run_id": "no-faults"}, timeout_seconds=5)


# --------------------------------------------------------------------------------- deltas

def test_delta_puts_fold_into_one_state(cluster: list[Daemon]) -> None:
    rng = np.random.default_rng(6)
    state = weights(262_144, seed=6)  # 1 MiB of float32 weights
    meta = b'{"state": "weights"}'
    size = shard_size(state.nbytes, 3)
    with tier(cluster, "deltas") as t:
        first = t.put(0, state.tobytes(), meta)
        for step in range(1, 31):
            previous = state.tobytes()
            update = rng.standard_normal(state.size).astype(np.float32) * np.float32(1e-4)
            state = state - update * (rng.random(state.size) < 0.3)  # a training-like step
            put = t.put(step, state.tobytes(), meta, base=(step - 1, previous))
            assert put.delta_shards == 4 and put.full_shards == 0
            assert put.endpoints == first.endpoints
            assert put.bytes_sent < first.bytes_sent
            got = t.fetch()
            assert got.ckpt_id == step and bytes(got.image) == state.tobytes()
            assert got.bytes_fetched == 3 * size and got.rebuilt_shard is None  # no chain
        assert t.list() == [30]
        freed = [call(ep, Op.DROP, {"run_id": "deltas"}, timeout_seconds=5).header["freed"]
                 for ep in first.endpoints]
    assert freed == [size + len(meta)] * 4  # each holder kept exactly one state


def test_daemon_folds_verifies_and_supersedes(small: Daemon) -> None:
    ep, run = small.endpoint, "fold"
    base = weights(2048, seed=9)
    new = base.copy()
    new[::5] += np.float32(0.5)
    raw_put(ep, run, 1, base.tobytes(), commit_it=True)
    blob = get_codec("xor_delta").encode(shard_tensor(new.view(np.uint8)),
                                         base=shard_tensor(base.view(np.uint8)))
    delta = {**one_shard_header(run, 2, new.tobytes()), "base_id": 1, "encoding": XOR_DELTA,
             "digest": digest_of(new.tobytes()), "delta_digest": digest_of(blob)}
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x10
    with pytest.raises(PeerRequestError, match=r"digest mismatch on the received delta of "
                                               r"shard 0 of checkpoint 2 \(expected .*\); "
                                               r"resend it") as info:
        call(ep, Op.DELTA, delta, [b"{}", damaged], timeout_seconds=5)
    assert info.value.code == "digest_mismatch"
    assert call(ep, Op.DELTA, delta, [b"{}", blob], timeout_seconds=5).header["folding"]
    commit(ep, run, 2, new.tobytes())
    got = call(ep, Op.GET, {"run_id": run, "ckpt_id": 2, "shard_index": 0}, timeout_seconds=5,
               max_reply_payload=1 << 20)
    assert bytes(got.payload) == new.tobytes() and got.meta == b"{}"
    listed = call(ep, Op.LIST, {"run_id": run}, timeout_seconds=5).header["shards"]
    assert [(s["ckpt_id"], s["state"], s["committed"]) for s in listed] == [(2, "ready", True)]

    with pytest.raises(PeerRequestError, match="no base: checkpoint 1 shard 0") as info:
        call(ep, Op.DELTA, {**delta, "ckpt_id": 3}, [b"{}", blob], timeout_seconds=5)
    assert info.value.code == "no_base"  # 1 was superseded by the committed 2

    newer = new * np.float32(2)
    blob = get_codec("xor_delta").encode(shard_tensor(newer.view(np.uint8)),
                                         base=shard_tensor(new.view(np.uint8)))
    lying = {**one_shard_header(run, 3, newer.tobytes()), "base_id": 2, "digest": "ab" * 16,
             "encoding": XOR_DELTA, "delta_digest": digest_of(blob)}
    call(ep, Op.DELTA, lying, [b"{}", blob], timeout_seconds=5)  # accepted, folded later
    with pytest.raises(PeerRequestError, match="fold failed: digest mismatch") as info:
        call(ep, Op.GET, {"run_id": run, "ckpt_id": 3, "shard_index": 0}, timeout_seconds=5,
             max_reply_payload=1 << 20)
    assert info.value.code == "fold_failed"
    listed = call(ep, Op.LIST, {"run_id": run}, timeout_seconds=5).header["shards"]
    assert [(s["ckpt_id"], s["state"]) for s in listed] == [(2, "ready"), (3, "failed")]
    call(ep, Op.DROP, {"run_id": run}, timeout_seconds=5)
    assert ping(ep)["mem_used"] == 0


# ---------------------------------------------------------------------- memory and leases

def test_lease_expiry_frees_memory(small: Daemon) -> None:
    ep = small.endpoint
    with tier([small], "short-lease", data_shards=1, parity=False, lease_seconds=1.0) as t:
        t.put(1, bytes(100_000), b"m")
        assert ping(ep)["mem_used"] > 0 and ping(ep)["n_runs"] == 1
        time.sleep(1.3)  # longer than the lease: only the renewals keep it
        assert bytes(t.fetch().image) == bytes(100_000)
    wait_for(lambda: ping(ep)["mem_used"] == 0, 5, "the lease to expire")
    assert ping(ep)["n_runs"] == 0
    assert "lease of run short-lease expired" in small.log()


def test_lru_eviction_never_evicts_the_newest_committed(small: Daemon) -> None:
    node = small
    ep = node.endpoint
    shard = bytes(MiB)
    raw_put(ep, "a", 1, shard, commit_it=True)
    raw_put(ep, "b", 1, shard)  # uncommitted: evictable
    raw_put(ep, "e", 1, shard)  # uncommitted: evictable
    call(ep, Op.GET, {"run_id": "b", "ckpt_id": 1, "shard_index": 0}, timeout_seconds=5,
         max_reply_payload=2 * MiB)  # b is now used more recently than e
    raw_put(ep, "f", 1, shard, commit_it=True)  # 4 MiB > 3.5 MiB: e goes
    held = {run: call(ep, Op.LIST, {"run_id": run}, timeout_seconds=5).header["shards"]
            for run in "abef"}
    assert [bool(held[r]) for r in "abef"] == [True, True, False, True]
    assert "evicted run e checkpoint 1" in node.log()
    raw_put(ep, "b", 2, shard, commit_it=True)  # evicts b's uncommitted checkpoint 1
    with pytest.raises(PeerRequestError, match="out of memory") as info:
        raw_put(ep, "g", 1, shard)  # a, b, f are each their run's newest committed
    assert info.value.code == "out_of_memory"
    reply = call(ep, Op.GET, {"run_id": "a", "ckpt_id": 1, "shard_index": 0},
                 timeout_seconds=5, max_reply_payload=2 * MiB)
    assert bytes(reply.payload) == shard
    assert ping(ep)["mem_used"] <= 3.5 * MiB
    for run in "abfg":
        call(ep, Op.DROP, {"run_id": run}, timeout_seconds=5)


# ---------------------------------------------------------------- hostile frames, SIGTERM

def _put_head(payload_len: int) -> bytes:
    header = {"run_id": "x", "ckpt_id": 1, "shard_index": 0, "shard_count": 1,
              "data_shards": 1, "kind": "data", "image_len": 8, "shard_size": 8, "meta_len": 0,
              "meta_digest": "0" * 32, "lease_seconds": 1.0}
    raw = json.dumps(header).encode()
    return PRELUDE.pack(b"CKPP", VERSION, int(Op.PUT), len(raw), payload_len) + raw + NO_TAG


def _list_frame(run_id: bytes) -> bytes:
    raw = b'{"run_id": ' + run_id + b"}"
    return PRELUDE.pack(b"CKPP", VERSION, int(Op.LIST), len(raw), 0) + raw + NO_TAG


@pytest.mark.parametrize(("kind", "data", "reason"), [
    ("garbage", np.random.default_rng(8).bytes(4096), "bad magic"),
    ("truncated", _put_head(8 + 16)[:30], "truncated frame"),
    ("oversized", _put_head(2**40), "exceeds this side's limit"),
    ("huge-integer", _list_frame(b"1" + b"0" * 5000), "not valid UTF-8 JSON"),
    ("unquotable", _list_frame(json.dumps("\U0001F600" * 6000, ensure_ascii=False).encode()),
     "field 'run_id' is invalid"),
])
def test_hostile_frames_close_only_that_connection(cluster: list[Daemon], kind: str,
                                                   data: bytes, reason: str) -> None:
    node = cluster[0]
    host, port = "127.0.0.1", node.port
    idle = session(node.endpoint)
    with idle.sock, socket.create_connection((host, port), timeout=5) as bad:
        hello = read_frame(bad, max_payload=0)
        assert hello is not None and hello.op is Op.HELLO
        bad.sendall(data)
        if kind == "truncated":
            bad.shutdown(socket.SHUT_WR)
        err = read_frame(bad, max_payload=0)  # an ERR naming the fault, then EOF
        assert err is not None and err.op is Op.ERR and reason in err.header["error"]
        assert bad.recv(1) == b""
        idle.sock.sendall(tagged(idle, Op.PING, {}))  # the other connection is still served
        pong = reply(idle)
        assert pong is not None and pong.op is Op.OK
    assert "closing connection from 127.0.0.1" in node.log()
    with tier(cluster, f"after-{kind}") as t:
        t.put(1, b"still serving", b"m")
        assert bytes(t.fetch().image) == b"still serving"


@contextmanager
def local_daemon(port: int = 0) -> Iterator[PeerDaemon]:
    """A daemon serving on a thread of this process, so that a test can read its counters."""
    daemon = PeerDaemon("127.0.0.1", port, key=KEY, mem_limit=8 * MiB)
    thread = threading.Thread(target=daemon.serve_forever, name="test-peer-daemon")
    thread.start()
    try:
        yield daemon
    finally:
        daemon.shutdown()
        thread.join(30)


def local_endpoint(daemon: PeerDaemon) -> str:
    return f"127.0.0.1:{daemon.address[1]}"


def test_a_request_that_fails_on_a_daemon_bug_gets_an_internal_error_reply(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with local_daemon() as daemon:
        def broken(run: str) -> list[dict[str, object]]:
            raise RuntimeError(f"listing {run} is broken")

        monkeypatch.setattr(daemon.store, "listing", broken)
        endpoint = local_endpoint(daemon)
        with pytest.raises(PeerRequestError, match=r"internal error in the peer daemon "
                           r"\(RuntimeError: listing r is broken\)") as err:
            call(endpoint, Op.LIST, {"run_id": "r"}, timeout_seconds=10)
        assert err.value.code == "internal_error"
        assert call(endpoint, Op.PING, {}, timeout_seconds=10).op is Op.OK
    assert "after an internal error" in caplog.text


def test_the_daemon_queues_at_least_128_connects_before_it_accepts_one() -> None:
    """A backlog of 5 drops the SYNs of a burst of connects: each costs a retransmit (1 s).
    The daemon is constructed (listening) but not serving, so nothing is accepted; the
    timeout is only a safety net against a hang."""
    daemon = PeerDaemon("127.0.0.1", 0, key=KEY, mem_limit=MiB)
    connected: list[socket.socket] = []
    try:
        for _ in range(128):
            connected.append(socket.create_connection(daemon.address, timeout=10))
    finally:
        for sock in connected:
            sock.close()
        daemon.close()
    assert len(connected) == 128


def test_the_client_keeps_one_connection_per_peer_across_requests() -> None:
    image, meta = np.random.default_rng(3).bytes(10_000), b'{"step": 1}'
    with local_daemon() as daemon, PeerTier([local_endpoint(daemon)], run_id="reuse",
                                            secret=KEY, data_shards=1, parity=False,
                                            probe_interval=3600, lease_seconds=60,
                                            deltas="never") as t:
        for ckpt in (1, 2, 3):
            t.put(ckpt, image, meta)
            assert bytes(t.fetch().image) == image
        assert t.list() == [3]
        assert daemon.connections_accepted == 1


def test_a_daemon_restarted_on_the_same_port_is_reached_through_the_same_client() -> None:
    image, meta = np.random.default_rng(4).bytes(10_000), b'{"step": 1}'
    with local_daemon() as first:
        port = first.address[1]
        t = PeerTier([local_endpoint(first)], run_id="restart", secret=KEY, data_shards=1,
                     parity=False,
                     probe_interval=3600, lease_seconds=60, deltas="never")
    try:
        with local_daemon(port) as second:  # empty: the first one's shards are gone
            assert t.list() == []
            t.put(2, image, meta)
            assert bytes(t.fetch().image) == image
            assert second.connections_accepted == 1
    finally:
        t.close()


def test_sigterm_finishes_the_request_in_flight_and_exits_zero(small: Daemon) -> None:
    node = small
    body, meta = bytes(range(256)) * 64, b"{}"
    header = one_shard_header("t", 1, body, lease_seconds=5.0)
    conn = session(node.endpoint)
    with conn.sock as sock, socket.create_connection(("127.0.0.1", node.port), timeout=10):
        frame = put_frame(conn, header, meta, body, bytes.fromhex(digest_of(body)))
        cut = len(frame) - len(body) - TRAILER_BYTES + 100
        sock.sendall(frame[:cut])
        time.sleep(0.3)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        sock.sendall(frame[cut:])
        answer = reply(conn)
        assert answer is not None and answer.op is Op.OK
        assert node.proc.wait(10) == 0
    assert "received SIGTERM" in node.log() and "peer daemon stopped" in node.log()


# ------------------------------------------------------------------------------ placement

def test_rank_peers_prefers_low_rtt_then_low_memory() -> None:
    readings = [
        PeerReading("a:1", True, rtt_seconds=0.0050, mem_used=0),
        PeerReading("b:1", True, rtt_seconds=0.0001, mem_used=900),
        PeerReading("c:1", True, rtt_seconds=0.0002, mem_used=100),
        PeerReading("d:1", True, rtt_seconds=0.0001, mem_used=0, avoided=True),
        PeerReading("e:1", False, reason="connection refused"),
    ]
    assert rank_peers(readings, 2, rtt_tie_seconds=1e-9) == ["b:1", "c:1"]
    assert rank_peers(readings, 2, rtt_tie_seconds=0.001) == ["c:1", "b:1"]  # tie: memory
    assert rank_peers(readings, 4, rtt_tie_seconds=1e-9) == ["b:1", "c:1", "a:1", "d:1"]
    assert rank_peers(readings, 2, exclude=["b:1"], rtt_tie_seconds=1e-9) == ["c:1", "a:1"]
    with pytest.raises(NotEnoughPeers, match=r"need 5 peers but only 4 are usable; down: "
                                             r"e:1 \(connection refused\)"):
        rank_peers(readings, 5)


def test_placement_avoids_slow_peers_and_forgives_them() -> None:
    statuses = {"a:1": PeerStatus(0.001, 10, 100, 1), "b:1": PeerStatus(0.002, 0, 100, 0),
                "c:1": PeerStatus(0.003, 0, 100, 0)}
    now = [0.0]

    def probe(endpoint: str, timeout: float) -> PeerStatus:
        if endpoint not in statuses:
            raise ConnectionRefusedError
        return statuses[endpoint]

    down: set[str] = set()
    p = Placement(["a:1", "b:1", "c:1", "z:1"], probe=probe, clock=lambda: now[0],
                  timeout_seconds=1.0, rtt_tie_seconds=1e-9, forgive_seconds=30,
                  is_down=down.__contains__)
    try:
        p.probe_now()
        assert p.choose(2) == ["a:1", "b:1"]
        p.report("a:1", ok=True, seconds=2.5)  # slower than timeout_seconds
        assert p.choose(2) == ["b:1", "c:1"]
        assert p.choose(3) == ["b:1", "c:1", "a:1"]  # only as a last resort
        now[0] = 31.0
        assert p.choose(2) == ["a:1", "b:1"]  # forgiven
        p.report("b:1", ok=False, seconds=0.1)
        assert p.choose(2) == ["a:1", "c:1"]
        p.report("b:1", ok=True, seconds=0.1)
        down.add("a:1")  # the health registry says a is down
        assert p.choose(2) == ["b:1", "c:1"]
        with pytest.raises(NotEnoughPeers, match="z:1 \\(connection refused\\)"):
            p.choose(3)
    finally:
        p.close()


def test_placement_against_real_daemons(cluster: list[Daemon]) -> None:
    eps = endpoints(cluster)
    p = Placement(eps, probe_interval=60, timeout_seconds=0.5, rtt_tie_seconds=10.0,
                  probe=functools.partial(ping_with, key=KEY))
    p.start()
    try:
        raw_put(eps[0], "fat", 1, bytes(16 * MiB), commit_it=True)
        p.probe_now()
        assert eps[0] not in p.choose(4)  # every RTT ties here: memory decides
        assert p.choose(5)[-1] == eps[0]
        p.report(eps[1], ok=True, seconds=5.0)
        assert set(p.choose(3)) == set(eps[2:])
        assert cluster[2].proc is not None
        os.kill(cluster[2].proc.pid, signal.SIGSTOP)  # a hung peer: probes time out
        p.probe_now()
        chosen = p.choose(4)
        assert eps[2] not in chosen and chosen[-1] == eps[1]
        with pytest.raises(NotEnoughPeers, match=f"{eps[2]} \\(timed out\\)"):
            p.choose(5)
        os.kill(cluster[2].proc.pid, signal.SIGCONT)
        p.probe_now()
        assert eps[2] in p.choose(4)
    finally:
        p.close()
        call(eps[0], Op.DROP, {"run_id": "fat"}, timeout_seconds=5)


def test_peer_tier_from_policy(cluster: list[Daemon]) -> None:
    policy = PeerTierPolicy(enabled=True, endpoints=endpoints(cluster)[:3], data_shards=2,
                            lease_seconds=30.0, timeout_seconds=2.0, probe_interval=0.5,
                            secret_file=str(SECRET_FILE))
    with PeerTier.from_policy(policy, run_id="from-policy") as t:
        assert (t.shard_count, t.lease_seconds, t.timeout_seconds) == (3, 30.0, 2.0)
        assert len(t.put(1, b"x" * 1000, b"m").endpoints) == 3
        assert bytes(t.fetch().image) == b"x" * 1000


def test_peer_tier_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="4 shards need 4 distinct peers"):
        PeerTier(["127.0.0.1:1", "127.0.0.1:2"], run_id="r", secret=KEY)
    with pytest.raises(ValueError, match="host:port"):
        PeerTier(["nonsense"] * 4, run_id="r", secret=KEY)
    with pytest.raises(ValueError, match="run_id"):
        PeerTier(["127.0.0.1:1"], run_id="", secret=KEY, data_shards=1, parity=False)


def test_cli_rejects_bad_options_in_one_line(cluster: list[Daemon],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ckptpilot.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["peer", "serve", "--mem-limit", "lots"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "cannot read 'lots' as a byte size" in err
    assert len(err.strip().splitlines()) == 1
    root = logging.getLogger()
    level = root.level
    try:
        assert main(["peer", "serve"]) == 2  # never serves without a secret
        err = capsys.readouterr().err
        assert err.startswith("ckptpilot peer serve: error: no peer secret: set --secret-file "
                              "(a file, created with a random secret when missing) or "
                              "CKPTPILOT_PEER_SECRET; give every trainer and daemon of the "
                              "job the same secret")
        assert len(err.strip().splitlines()) == 1
        assert main(["peer", "serve", "--port", str(cluster[0].port),  # port taken
                     "--secret-file", str(SECRET_FILE)]) == 2
    finally:
        root.setLevel(level)
    err = capsys.readouterr().err
    assert err.startswith("ckptpilot peer serve: error: cannot listen on 127.0.0.1:")
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- integrity on the wire

class FlipProxy:
    """A TCP forwarder in front of one daemon that, once armed, flips one byte of the traffic
    in one direction: the ``at``-th byte (counted over its connections from the arming), as
    a bad NIC, switch or memory on the path would. Threads only; ``close`` stops it."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.armed: tuple[str, int] | None = None  # (direction, bytes left before the flip)
        self.flipped = 0
        self.socks: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def arm(self, direction: str, at: int) -> None:
        with self.lock:
            self.armed = (direction, at)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            host, port = self.target.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            with self.lock:
                self.socks += [client, server]
            for src, dst, direction in ((client, server, "to-peer"),
                                        (server, client, "to-client")):
                thread = threading.Thread(target=self._pump, args=(src, dst, direction),
                                          daemon=True)
                thread.start()
                self.threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := bytearray(src.recv(1 << 16)):
                with self.lock:
                    if self.armed is not None and self.armed[0] == direction:
                        left = self.armed[1]
                        if left < len(data):
                            data[left] ^= 0x01
                            self.armed, self.flipped = None, self.flipped + 1
                        else:
                            self.armed = (direction, left - len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            socks = list(self.socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextmanager
def proxied(nodes: list[Daemon]) -> Iterator[list[FlipProxy]]:
    proxies = [FlipProxy(d.endpoint) for d in nodes]
    try:
        yield proxies
    finally:
        for p in proxies:
            p.close()


def test_a_byte_flipped_on_the_wire_to_the_client_is_named_and_rebuilt_from_parity(
        cluster: list[Daemon], caplog: pytest.LogCaptureFixture) -> None:
    image = weights(250_000, seed=15).tobytes()  # shards of 333 KB
    with proxied(cluster[:4]) as proxies, PeerTier(
            [p.endpoint for p in proxies], run_id="wire-get", secret=KEY,
            probe_interval=0.2,
            timeout_seconds=5.0, lease_seconds=60.0) as t:
        put = t.put(1, image, b"m")
        bad = next(p for p in proxies if p.endpoint == put.endpoints[1])
        bad.arm("to-client", 64 << 10)  # past the LIST and GET headers: in shard 1's bytes
        with caplog.at_level(logging.WARNING, logger="ckptpilot.tiers.peer.client"):
            got = t.fetch(1)
        assert bad.flipped == 1
        assert got.rebuilt_shard == 1 and bytes(got.image) == image
    assert re.search(rf"rebuilt shard 1 of checkpoint 1 from parity \(@{bad.endpoint}: digest "
                     r"mismatch \(shard 1 of checkpoint 1: expected '[0-9a-f]{32}', received "
                     r"[0-9a-f]{32}\)\)", caplog.text)


def test_a_byte_flipped_on_the_wire_to_a_peer_is_refused_by_it_and_named(
        cluster: list[Daemon]) -> None:
    """Four peers for four shards: one shard is left without a peer (the damaged one, or
    another whose peer the damaged one was re-placed on), and its failure names the
    damage."""
    image = weights(250_000, seed=16).tobytes()
    with proxied(cluster[:4]) as proxies, PeerTier(
            [p.endpoint for p in proxies], run_id="wire-put", secret=KEY,
            probe_interval=0.2,
            timeout_seconds=5.0, lease_seconds=60.0, deltas="never") as t:
        proxies[2].arm("to-peer", 64 << 10)
        with pytest.raises(PeerUnavailable) as info:
            t.put(1, image, b"m")
        assert proxies[2].flipped == 1
        (reason,) = info.value.failures.values()
        assert "need 1 peers but only 0 are usable" in reason, reason
        assert re.search(rf"@{proxies[2].endpoint}: digest mismatch on the received shard "
                         r"\d of checkpoint 1 \(expected [0-9a-f]{32}, got "
                         r"[0-9a-f]{32}\); resend it", reason), reason
        again = t.put(2, image, b"m")  # the same peers take the next put, undamaged
        assert bytes(t.fetch().image) == image and sorted(again.endpoints) == sorted(
            p.endpoint for p in proxies)


def test_a_damaged_put_frame_gets_an_err_and_the_connection_carries_on(small: Daemon) -> None:
    body = bytes(range(256)) * 16
    header = one_shard_header("flip", 1, body)
    damaged = bytearray(body)
    damaged[1000] ^= 0x80
    conn = session(small.endpoint)
    with conn.sock as sock:
        sock.sendall(put_frame(conn, header, b"{}", bytes(damaged),
                               bytes.fromhex(digest_of(body))))
        err = reply(conn)
        assert err is not None and err.op is Op.ERR
        assert err.header["code"] == "digest_mismatch"
        assert err.header["error"] == (
            f"digest mismatch on the received shard 0 of checkpoint 1 (expected "
            f"{digest_of(body)}, got {digest_of(bytes(damaged))}); resend it")
        sock.sendall(tagged(conn, Op.PING, {}))
        pong = reply(conn)
        assert pong is not None and pong.op is Op.OK  # still in step
    assert ping(small.endpoint)["mem_used"] == 0  # nothing kept, the reservation released


# ------------------------------------------- losing peers (last: nothing restarts after them)

@pytest.mark.crash
def test_a_daemon_restarted_empty_gets_the_full_shard_again(cluster: list[Daemon]) -> None:
    old = weights(200_000, seed=7)
    new = old * np.float32(1.0001)
    with tier(cluster, "restarted") as t:
        put = t.put(1, old.tobytes(), b"m")
        victim = by_endpoint(cluster, put.endpoints[0])
        restart([victim])
        wait_for(lambda: t.placement.is_usable(victim.endpoint), 10, "the restarted peer")
        again = t.put(2, new.tobytes(), b"m", base=(1, old.tobytes()))
        assert again.full_shards == 1 and again.delta_shards == 3
        assert again.endpoints[0] == victim.endpoint  # it answered "no base": full shard
        got = t.fetch()
        assert got.rebuilt_shard is None and bytes(got.image) == new.tobytes()


@pytest.mark.crash
def test_one_peer_killed_is_rebuilt_from_parity_then_replaced(cluster: list[Daemon]) -> None:
    image = weights(400_000, seed=3)
    with tier(cluster, "one-down") as t:
        put = t.put(1, image.tobytes(), b"m")
        victim = by_endpoint(cluster, put.endpoints[1])
        victim.kill()
        got = t.fetch()
        assert got.rebuilt_shard == 1 and bytes(got.image) == image.tobytes()
        assert got.bytes_fetched == 3 * shard_size(image.nbytes, 3)  # 2 data + the parity

        newer = image + np.float32(1e-4)
        again = t.put(2, newer.tobytes(), b"m2", base=(1, image.tobytes()))
        assert again.endpoints[1] != victim.endpoint  # re-placed on the spare peer
        assert again.full_shards == 1 and again.delta_shards == 3
        assert len(set(again.endpoints)) == 4
        got = t.fetch()
        assert got.ckpt_id == 2 and got.rebuilt_shard is None
        assert bytes(got.image) == newer.tobytes()


@pytest.mark.crash
def test_two_peers_killed_raise_with_each_reason(cluster: list[Daemon]) -> None:
    with tier(cluster, "two-down") as t:
        put = t.put(1, weights(200_000, seed=4).tobytes(), b"m")
        for i in (0, 2):
            by_endpoint(cluster, put.endpoints[i]).kill()
        with pytest.raises(PeerUnavailable) as info:
            t.fetch()
    message = str(info.value)
    for i in (0, 2):
        assert f"shard {i} @{put.endpoints[i]}: connection refused" in message
    assert set(info.value.failures) == {0, 2}
    with tier(cluster, "two-down") as fresh, pytest.raises(
            PeerUnavailable, match=r"shard 0: held by no reachable peer \(unreachable: .*"
                                   r"connection refused"):
        fresh.fetch(1)


def test_auto_sends_a_delta_only_where_it_is_estimated_faster(
        cluster: list[Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire rate is pinned (a measured one depends on this machine); what the samples
    find does not: unchanged bytes are unchanged blocks, random bytes change every block."""
    frozen = weights(50_000, seed=11).tobytes()
    noise = np.random.default_rng(12).bytes(len(frozen))
    with tier(cluster, "auto-deltas", deltas="auto") as t:
        assert t.put(1, frozen, b"m").delta_shards == 0  # no base: full
        monkeypatch.setattr(t, "_wire_rate", lambda endpoint: 1e3)  # a slow link
        same = t.put(2, frozen, b"m", base=(1, frozen))
        assert (same.delta_shards, same.full_shards) == (4, 0)
        assert same.encodings == (BLOCKS,) * 4
        assert same.bytes_sent == 4 * bitmap_bytes(shard_size(len(frozen), 3), BLOCK_BYTES)
        changed = t.put(3, noise, b"m", base=(2, frozen))
        assert (changed.delta_shards, changed.full_shards) == (0, 4)
        monkeypatch.setattr(t, "_wire_rate", lambda endpoint: 1e15)  # faster than any compare
        again = t.put(4, noise, b"m", base=(3, noise))
        assert (again.delta_shards, again.full_shards) == (0, 4)
        assert again.endpoints == changed.endpoints == same.endpoints  # the base's holders
        assert bytes(t.fetch().image) == noise
    with pytest.raises(ValueError, match="deltas must be one of"):
        tier(cluster, "x", deltas="sometimes")


def test_auto_sends_full_shards_until_it_has_measured_the_wire(cluster: list[Daemon]) -> None:
    image = weights(50_000, seed=13).tobytes()
    with tier(cluster, "unmeasured", deltas="auto") as first:
        first.put(1, image, b"m")
    with tier(cluster, "unmeasured", deltas="auto") as second:  # a restarted process
        put = second.put(2, image, b"m", base=(1, image))
        assert (put.delta_shards, put.full_shards) == (0, 4)


def test_the_delta_rule_weighs_cpu_time_against_the_bytes_saved() -> None:
    gb = 10**9
    # A 1 GB shard, its 4 MB sample compared at 10 GB/s; nothing changed.
    frozen = Estimate(shard_bytes=gb, sample_bytes=4 * 10**6, changed_fraction=0.0,
                      compare_seconds=4e-4)
    one = {"concurrent": 1, "cores": 8}
    assert choose(frozen, 2e9, **one) == BLOCKS  # full 0.5 s; blocks 0.1 s
    assert choose(frozen, 20e9, **one) is None  # full 0.05 s: the compare alone is slower
    assert choose(frozen, 2e9, concurrent=10, cores=2) is None  # 10 compares, 2 cores: 0.5 s
    # Every block changed; the codec encodes the sample at 1 GB/s to 20 %.
    moved = Estimate(shard_bytes=gb, sample_bytes=4 * 10**6, changed_fraction=1.0,
                     compare_seconds=4e-4, xor_ratio=0.2, encode_seconds=5e-4,
                     xor_sample_bytes=5 * 10**5)
    assert choose(moved, 2e9, **one) is None  # full 0.5 s; xor_delta 1 s + 0.1 s
    assert choose(moved, 1e8, **one) == XOR_DELTA  # full 10 s; xor_delta 1 s + 2 s
    assert choose(moved, 4e8, concurrent=1, cores=2) == XOR_DELTA  # 2.5 s; 1 s + 0.5 s
    assert choose(moved, 4e8, concurrent=4, cores=2) is None  # 4 encoders: 2 s + 0.5 s
    # Within the margin: 10 % faster is not enough for the CPU it costs on both sides.
    close = Estimate(shard_bytes=gb, sample_bytes=4 * 10**6, changed_fraction=0.85,
                     compare_seconds=4e-4)
    assert choose(close, 1e9, **one) is None  # full 1 s; blocks 0.1 s + 0.85 s
    for est in (frozen, moved):
        assert choose(est, None, **one) is None  # the wire was never measured: full
    # deltas: always: the fewer bytes, whatever the time.
    assert choose(moved, 20e9, forced=True, **one) == XOR_DELTA
    assert choose(frozen, 20e9, forced=True, **one) == BLOCKS
    assert choose(close, None, forced=True, **one) == BLOCKS


def test_a_shard_is_sampled_in_whole_blocks_spread_over_it() -> None:
    assert sample_ranges(4096) == [(0, 4096)]
    small = MIN_SAMPLE_BLOCKS * BLOCK_BYTES
    assert sample_ranges(small) == [(b, b + BLOCK_BYTES) for b in range(0, small, BLOCK_BYTES)]
    assert len(sample_ranges(small + 8)) == MIN_SAMPLE_BLOCKS
    assert len(sample_ranges(20 * SAMPLE_SHARE * BLOCK_BYTES)) == 20  # 1 block in 64
    size = 300 * MiB + 8
    ranges = sample_ranges(size)
    assert len(ranges) == SAMPLE_BLOCKS and ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(lo % BLOCK_BYTES == 0 and hi - lo <= BLOCK_BYTES for lo, hi in ranges)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))


def test_a_blocks_delta_carries_the_changed_blocks_and_folds_back() -> None:
    rng = np.random.default_rng(17)
    old_image = rng.bytes(3 * 5 * BLOCK_BYTES + 1000)  # the last shard padded
    new_image = bytearray(old_image)
    for at in (0, 7 * BLOCK_BYTES + 3, len(new_image) - 1):  # shard 0, shard 1, the tail
        new_image[at] ^= 0xFF
    new, old = split(new_image, 3), split(old_image, 3)
    for i in range(3):
        changed = changed_blocks(new[i], old[i])
        bitmap, views = blocks_payload(new[i], changed)
        payload = np.frombuffer(bitmap + b"".join(v.tobytes() for v in views), np.uint8)
        folded = fold_blocks(old[i].contiguous(), payload, BLOCK_BYTES)
        assert folded.tobytes() == new[i].contiguous().tobytes()
        assert sum(v.size for v in views) == BLOCK_BYTES * int(changed.sum()) - (
            i == 2) * (6 * BLOCK_BYTES - new[2].size)  # the last block is short
    assert [int(changed_blocks(n, o).sum()) for n, o in zip(new, old, strict=True)] == [1, 1, 1]
    union = np.logical_or.reduce([changed_blocks(n, o) for n, o in zip(new, old, strict=True)])
    digest, bitmap, kept = parity_blocks_payload(new, union)
    new_parity, old_parity = parity_of(new).contiguous(), parity_of(old).contiguous()
    assert digest == digest_of(new_parity)
    payload = np.frombuffer(bitmap + b"".join(k.tobytes() for k in kept), np.uint8)
    assert fold_blocks(old_parity, payload, BLOCK_BYTES).tobytes() == new_parity.tobytes()
    with pytest.raises(ValueError, match="marks 65536 bytes of changed blocks, it carries 3"):
        fold_blocks(old[0].contiguous(), np.frombuffer(b"\x01" + b"abc", np.uint8),
                    BLOCK_BYTES)
    with pytest.raises(ValueError, match="marks blocks past the shard's 6"):
        fold_blocks(old[0].contiguous(), np.frombuffer(b"\x80", np.uint8), BLOCK_BYTES)


def test_always_sends_blocks_where_they_carry_fewer_bytes(cluster: list[Daemon]) -> None:
    """Shards of 80 blocks (sampled); a quarter of each rewritten with random bytes, which no
    codec shrinks: every shard, the parity too, goes as its changed blocks."""
    rng = np.random.default_rng(18)
    shard = 80 * BLOCK_BYTES
    old = rng.bytes(3 * shard)
    new = bytearray(old)
    for i in range(3):
        new[i * shard:i * shard + 20 * BLOCK_BYTES] = rng.bytes(20 * BLOCK_BYTES)
    with tier(cluster, "blocks-deltas") as t:
        t.put(1, old, b"m")
        put = t.put(2, bytes(new), b"m", base=(1, old))
        assert (put.delta_shards, put.full_shards) == (4, 0)
        assert put.encodings == (BLOCKS,) * 4
        assert put.bytes_sent == 4 * (20 * BLOCK_BYTES + bitmap_bytes(shard, BLOCK_BYTES))
        got = t.fetch()
        assert got.ckpt_id == 2 and bytes(got.image) == bytes(new)


def test_always_sends_xor_deltas_where_every_block_moved_a_little(
        cluster: list[Daemon]) -> None:
    """Shards of 100+ blocks (sampled), every float nudged: the codec's delta, encoded where
    it is sent, the parity's against the XOR of the base's data shards."""
    old = weights(3 * 100 * BLOCK_BYTES // 4 + 999, seed=14)
    new = old.copy()
    new[::3] += np.float32(1e-3)
    with tier(cluster, "xor-deltas") as t:
        first = t.put(1, old.tobytes(), b"m")
        put = t.put(2, new.tobytes(), b"m", base=(1, old.tobytes()))
        assert put.encodings == (XOR_DELTA,) * 4 and first.encodings == ("full",) * 4
        assert put.bytes_sent < first.bytes_sent
        got = t.fetch()
        assert got.ckpt_id == 2 and bytes(got.image) == new.tobytes()
