"""Attacks on the peer tier from a client on the daemons' host (issue 23, points 1 and 4):
forged shards, unauthenticated requests, a wrong secret, a flood of idle and slow-loris
connections. Real daemon processes on 127.0.0.1, real SQLite, a real training pilot."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import stat
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from peerdaemons import KEY, SECRET_FILE, Daemon, call, revive, start, stop_all

from ckptpilot import CheckpointPilot, RecoverySource
from ckptpilot.capture.state import HostBufferPool
from ckptpilot.errors import IntegrityError
from ckptpilot.tiers.base import CheckpointImage
from ckptpilot.tiers.memory import MemoryTier
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.peer.auth import NO_TAG, PeerAuthError, hello_tag, load_secret
from ckptpilot.tiers.peer.calls import connect
from ckptpilot.tiers.peer.client import PeerCheckpointTier
from ckptpilot.tiers.peer.errors import PeerUnavailable
from ckptpilot.tiers.peer.protocol import Op, encode_head, read_frame, send_frame
from ckptpilot.vocab import Level

WRONG_KEY = b"not-the-jobs-secret-0123456789ab"


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    logs = tmp_path_factory.mktemp("peer-auth-logs")
    nodes = [Daemon(logs / f"peer{i}.log", "--mem-limit", "256MiB") for i in range(4)]
    try:
        yield start(nodes)
    finally:
        stop_all(nodes)


@pytest.fixture
def cluster(daemons: list[Daemon]) -> list[Daemon]:
    return revive(daemons)


def config(tmp: Path, cluster: list[Daemon]) -> Path:
    """Saves every 10 steps, every second one an organ (peers + remote), the others pulses
    (peers only)."""
    eps = ", ".join(f'"{d.endpoint}"' for d in cluster)
    cfg = tmp / "policy.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        scheduler: {{base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,
                    weights: {{loss: 1.0, grad: 0.0, system: 0.0}},
                    loss: {{slope_threshold: 1000.0}}, organ_every: 2}}
        tiers: {{peer: {{enabled: true, endpoints: [{eps}], data_shards: 2, parity: true,
                        lease_seconds: 60, timeout_seconds: 5, probe_interval: 0.2,
                        secret_file: "{SECRET_FILE}"}}}}
        observability: {{tensorboard: false, decision_log: false}}
        retention: {{auto: false}}
        """))
    return cfg


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))


def train_30_steps(cfg: Path, run_dir: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """Steps 10 (pulse), 20 (organ: peers + remote), 30 (pulse); the run's peer id and the
    state of step 20."""
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=run_dir)
    x = torch.randn(16, 32)
    at_20: dict[str, torch.Tensor] = {}
    for step in range(1, 31):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        pilot.observe()
        if step == 20:
            at_20 = {k: v.clone() for k, v in model.state_dict().items()}
    assert pilot.peers is not None
    run_id = pilot.peers.run_id
    pilot.close()
    return run_id, at_20


def handshake_with(sock: socket.socket, key: bytes) -> None:
    """Answer the daemon's HELLO with a tag made with ``key`` (the wrong one, here)."""
    greeting = read_frame(sock, max_payload=0)
    assert greeting is not None and greeting.op is Op.HELLO
    nonce = greeting.header["nonce"]
    send_frame(sock, Op.HELLO, {"nonce": "ab" * 16}, tag=lambda raw: hello_tag(key, raw, nonce))


def refusal(endpoint: str, frames: bytes, *, key: bytes | None = None) -> tuple[str, str]:
    """What the daemon answers ``frames`` (untagged) sent on a connection that skipped the
    handshake (``key`` None) or made it with ``key``: the ERR's code and text."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if key is None:
            greeting = read_frame(sock, max_payload=0)
            assert greeting is not None and greeting.op is Op.HELLO
        else:
            handshake_with(sock, key)
        sock.sendall(frames)
        answer = read_frame(sock, max_payload=0)
        assert answer is not None and answer.op is Op.ERR, answer
        assert read_frame(sock, max_payload=0) is None, "the daemon closes after refusing"
        return answer.header["code"], answer.header["error"]


def ended(sock: socket.socket) -> bool:
    """Whether the daemon closed ``sock`` (what it sent before is read and dropped)."""
    sock.setblocking(False)
    try:
        while chunk := sock.recv(1 << 16):
            del chunk
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return True


def wait_for(predicate: Callable[[], bool], seconds: float = 30.0) -> None:
    """A safety net only: eviction happens before the next connection is admitted."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def listing(endpoint: str, run_id: str) -> list[dict[str, object]]:
    return list(call(endpoint, Op.LIST, {"run_id": run_id}, timeout_seconds=5).header["shards"])


def test_forged_peer_shards_with_recomputed_digests_are_skipped_and_restore_walks_on(
        tmp_path: Path, cluster: list[Daemon]) -> None:
    cfg, run_dir = config(tmp_path, cluster), tmp_path / "run"
    run_id, at_20 = train_30_steps(cfg, run_dir)
    endpoints = [d.endpoint for d in cluster]

    # Without the secret, a client gets nowhere: no daemon greets it as one of the job's.
    outsider = PeerTier(endpoints, run_id=run_id, secret=WRONG_KEY, data_shards=2,
                        timeout_seconds=5)
    with contextlib.closing(outsider), pytest.raises(
            PeerUnavailable, match=r"held by no reachable peer .unreachable: "
            r"127.0.0.1:.*the daemon's greeting fails its HMAC check"):
        outsider.fetch(30)

    # With the secret (leaked, or a compromised peer), the attacker puts other bytes for
    # step 30, every stripe digest computed for the forged bytes.
    with contextlib.closing(PeerCheckpointTier(
            PeerTier(endpoints, run_id=run_id, secret=KEY, data_shards=2, timeout_seconds=5),
            rank=0)) as attacker:
        real = attacker.get(30)  # no recorded digest: the peers' own digests agree
        forged = real.arena.clone()
        forged[: forged.numel() // 2] ^= 0x5A
        attacker.put(dataclasses.replace(real, arena=forged))
        assert torch.equal(attacker.get(30).arena, forged), "the peers now serve the forgery"

    fresh = mlp(1)
    again = CheckpointPilot(cfg, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()),
                            run_dir=run_dir)
    try:
        assert again.restore() == 20
        rec = again.last_recovery
        assert rec is not None and rec.source is RecoverySource.REMOTE
        for k, v in fresh.state_dict().items():
            assert torch.equal(v.view(torch.uint8), at_20[k].view(torch.uint8)), k
        (location, reason), = [(s.location, s.reason) for s in rec.skipped]
        assert location == f"peer:{run_id}/30"
        assert "the peers' copy is not the one this trainer put" in reason
        assert "digest mismatch against the stripe recorded in its metadata row" in reason
    finally:
        again.close()


def test_peer_copies_with_no_metadata_row_are_not_trusted_and_the_remote_is_read(
        tmp_path: Path, cluster: list[Daemon]) -> None:
    """The metadata lost: nothing recorded what this trainer put, so the peers' step 30
    (which only their own digests prove) is skipped, and the remote tier's step 20 read."""
    cfg, run_dir = config(tmp_path, cluster), tmp_path / "run"
    run_id, at_20 = train_30_steps(cfg, run_dir)
    for p in run_dir.glob("metadata.sqlite*"):
        p.unlink()
    fresh = mlp(1)
    again = CheckpointPilot(cfg, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()),
                            run_dir=run_dir)
    try:
        assert again.restore() == 20
        rec = again.last_recovery
        assert rec is not None and rec.source is RecoverySource.REMOTE
        for k, v in fresh.state_dict().items():
            assert torch.equal(v.view(torch.uint8), at_20[k].view(torch.uint8)), k
        skipped = {s.location: s.reason for s in rec.skipped}
        assert "no metadata row records what this trainer put" in skipped[f"peer:{run_id}/30"]
    finally:
        again.close()


def test_unauthenticated_drop_is_refused_by_the_daemon(cluster: list[Daemon]) -> None:
    endpoint = cluster[0].endpoint
    with contextlib.closing(PeerTier([endpoint], run_id="victim", secret=KEY, data_shards=1,
                                     parity=False, timeout_seconds=5)) as owner:
        owner.put(1, torch.arange(64, dtype=torch.uint8).numpy(), b"{}")
        drop = encode_head(Op.DROP, {"run_id": "victim"}, 0) + NO_TAG
        code, text = refusal(endpoint, drop)
        assert code == "unauthenticated"
        assert "DROP on a connection that is not authenticated" in text
        code, text = refusal(endpoint, drop, key=WRONG_KEY)
        assert code == "unauthenticated"
        assert "the client's HELLO fails its HMAC check" in text
        assert [s["ckpt_id"] for s in listing(endpoint, "victim")] == [1]
        assert bytes(owner.fetch(1).image) == bytes(range(64))


def test_wrong_secret_client_gets_a_clear_error(cluster: list[Daemon], tmp_path: Path) -> None:
    endpoint = cluster[0].endpoint
    with pytest.raises(PeerAuthError) as err:
        connect(endpoint, WRONG_KEY, 5)
    assert str(err.value).startswith(f"{endpoint}: the daemon's greeting fails its HMAC check: "
                                     "that daemon does not have this client's peer secret")
    assert "give every trainer and daemon of the job the same secret" in str(err.value)
    # A daemon started with another secret is named the same way to a trainer.
    other = Daemon(tmp_path / "other.log", "--mem-limit", "16MiB",
                   secret_file=tmp_path / "other.secret")
    start([other])
    try:
        with pytest.raises(PeerAuthError, match="fails its HMAC check"):
            call(other.endpoint, Op.PING, {}, timeout_seconds=5)
    finally:
        stop_all([other])


def test_the_secret_file_is_created_0600_on_first_start(tmp_path: Path) -> None:
    secret = tmp_path / "job" / "peer.secret"
    secret.parent.mkdir()
    node = Daemon(tmp_path / "d.log", "--mem-limit", "16MiB", secret_file=secret)
    start([node])
    try:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        key = load_secret(secret, what="test")
        assert len(key) == 64 and key != KEY
        with connect(node.endpoint, key, 5).sock:
            pass
    finally:
        stop_all([node])
    secret.chmod(0o644)
    with pytest.raises(Exception, match=r"may be read by others \(mode 0644\); run `chmod 600"):
        load_secret(secret, what="tiers.peer.secret_file")


def test_memory_tier_get_detects_a_changed_held_arena() -> None:
    arena = torch.arange(256, dtype=torch.uint8)
    img = CheckpointImage(7, {"rank": 0, "world_size": 1}, arena,
                          (("model/w", torch.uint8, (256,)),), level=Level.PULSE)
    tier = MemoryTier(1 << 20, HostBufferPool(2))
    assert tier.put(img).kept
    assert torch.equal(tier.get(7).arena, arena)
    held = tier.newest()
    assert held is not None
    held.snapshot.arena[3] ^= 0xFF
    with pytest.raises(IntegrityError, match=r"memory:step 7 \(the held arena changed after it "
                                             "was kept\\)"):
        tier.get(7)


def test_idle_and_slow_loris_connections_beyond_the_limit_do_not_lock_out_the_trainer(
        tmp_path: Path) -> None:
    nodes = [Daemon(tmp_path / f"p{i}.log", "--mem-limit", "64MiB", "--max-connections", "12",
                    "--max-per-client", "8", "--header-timeout-seconds", "30",
                    "--idle-timeout-seconds", "60") for i in range(3)]
    start(nodes)
    flood: list[socket.socket] = []
    try:
        for d in nodes:
            for i in range(40):  # idle (never answer HELLO) and slow-loris (half a HELLO)
                sock = socket.create_connection(("127.0.0.1", d.port), timeout=10)
                if i % 2:
                    sock.sendall(b"CKPP\x03")
                flood.append(sock)
            for _ in range(6):  # authenticated, then idle
                flood.append(connect(d.endpoint, KEY, 5).sock)
        data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).numpy()
        with contextlib.closing(PeerTier([d.endpoint for d in nodes], run_id="trainer",
                                         secret=KEY, data_shards=2, timeout_seconds=10)) as t:
            t.put(5, data, b"{}")
            assert bytes(t.fetch(5).image) == data.tobytes()
        # All from one address: at most 8 per daemon stay open (the trainer's among them);
        # the unauthenticated went first, then the idle ones.
        per_daemon = len(flood) // len(nodes)
        for i in range(len(nodes)):
            mine = flood[i * per_daemon:(i + 1) * per_daemon]
            wait_for(lambda mine=mine: sum(map(ended, mine)) >= per_daemon - 8)
    finally:
        for sock in flood:
            sock.close()
        stop_all(nodes)
