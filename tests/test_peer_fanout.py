"""How many peers one put and one fetch talk to: its parity group (and the previous put's),
not every peer, so that their time stays flat per shard as the peers grow; and the stale
copies that COMMIT to every peer used to drop are dropped still.

Every daemon logs each request it answers (``--log-level DEBUG``); the tests read those logs.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from peerdaemons import KEY, SECRET_FILE, Daemon, call, start, stop_all

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.peer.client import recorded_holders
from ckptpilot.tiers.peer.protocol import Op

PEERS = 10
_REQUEST = re.compile(r"ckptpilot\.tiers\.peer\.daemon: (\w+) (\{.*\})$")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    root = tmp_path_factory.mktemp("fanout")
    daemons = [Daemon(root / f"d{i}.log", "--mem-limit", "8MiB", "--log-level", "DEBUG",
                      "--lazy-torch") for i in range(PEERS)]
    start(daemons)
    try:
        yield daemons
    finally:
        stop_all(daemons)


def requests(daemon: Daemon, run: str) -> list[tuple[str, dict[str, object]]]:
    """(op, header) of every request of run ``run`` that ``daemon`` answered so far."""
    out = []
    for line in daemon.log().splitlines():
        match = _REQUEST.search(line)
        if match is not None:
            header = ast.literal_eval(match.group(2))
            if header.get("run_id") == run:
                out.append((match.group(1), header))
    return out


def saw(cluster: list[Daemon], run: str, op: str, ckpt: int | None = None) -> set[str]:
    return {d.endpoint for d in cluster for o, h in requests(d, run)
            if o == op and (ckpt is None or h.get("ckpt_id") == ckpt)}


def held(cluster: list[Daemon], run: str) -> dict[str, set[int]]:
    """Endpoint -> the checkpoints of ``run`` it lists (only endpoints holding any)."""
    out: dict[str, set[int]] = {}
    for d in cluster:
        shards = call(d.endpoint, Op.LIST, {"run_id": run}, timeout_seconds=10).header["shards"]
        if shards:
            out[d.endpoint] = {int(s["ckpt_id"]) for s in shards}
    return out


def image(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, 3 << 16, dtype=np.uint8).tobytes()


def tier(cluster: list[Daemon], run: str) -> PeerTier:
    return PeerTier([d.endpoint for d in cluster], run_id=run, secret=KEY, probe_interval=0.2,
                    timeout_seconds=10.0, lease_seconds=60.0, deltas="never")


def test_a_put_commits_on_its_group_and_the_previous_one_and_a_fetch_lists_nothing(
        cluster: list[Daemon]) -> None:
    run = "fanout"
    with tier(cluster, run) as t:
        puts = {c: t.put(c, image(c), b"m") for c in (1, 2, 3)}
        assert bytes(t.fetch(3).image) == image(3)
    groups = {c: set(p.endpoints) for c, p in puts.items()}
    assert saw(cluster, run, "COMMIT", 1) == {d.endpoint for d in cluster}  # see the next test
    assert saw(cluster, run, "COMMIT", 2) == groups[1] | groups[2]
    assert saw(cluster, run, "COMMIT", 3) == groups[2] | groups[3]
    assert saw(cluster, run, "GET", 3) == set(puts[3].endpoints[:3])  # the data shards'
    assert saw(cluster, run, "LIST") == set()
    assert held(cluster, run) == {e: {3} for e in groups[3]}  # nothing stale anywhere


def test_a_fresh_tier_commits_everywhere_first_and_so_drops_a_previous_process_copies(
        cluster: list[Daemon]) -> None:
    run = "restarted"
    with tier(cluster, run) as first:
        first.put(1, image(1), b"m")
    with tier(cluster, run) as second:  # a restarted process: it never saw checkpoint 1
        put = second.put(2, image(2), b"m")
        assert saw(cluster, run, "COMMIT", 2) == {d.endpoint for d in cluster}
        assert held(cluster, run) == {e: {2} for e in put.endpoints}
        assert bytes(second.fetch().image) == image(2)  # no id: every peer is asked
    assert saw(cluster, run, "LIST") == {d.endpoint for d in cluster}


def test_a_fetch_falls_back_to_asking_every_peer_when_its_group_lost_two_shards(
        cluster: list[Daemon]) -> None:
    run = "fallback"
    with tier(cluster, run) as t:
        put = t.put(1, image(1), b"m")
        for endpoint in put.endpoints[:2]:  # two shards gone: parity cannot cover it
            call(endpoint, Op.DROP, {"run_id": run}, timeout_seconds=10)
        with pytest.raises(Exception, match="cannot be recovered"):
            t.fetch(1)
    assert saw(cluster, run, "LIST") == {d.endpoint for d in cluster}


def test_a_fresh_process_fetches_from_the_recorded_holders_alone(
        cluster: list[Daemon]) -> None:
    """A restore in a new process knows where the save went only from its own record (the
    peer row's location): it asks those peers, not all of them."""
    run = "recorded"
    with tier(cluster, run) as first:
        put = first.put(1, image(1), b"m")
    with tier(cluster, run) as second:  # a restarted process: it never put checkpoint 1
        fetched = second.fetch(1, holders=put.endpoints)
        assert bytes(fetched.image) == image(1)
    assert saw(cluster, run, "LIST") == set(put.endpoints)
    assert saw(cluster, run, "GET", 1) <= set(put.endpoints)


def test_recorded_holders_that_lost_it_make_the_fetch_ask_every_peer(
        cluster: list[Daemon]) -> None:
    run = "recorded-stale"
    others = [d.endpoint for d in cluster]
    with tier(cluster, run) as first:
        put = first.put(1, image(1), b"m")
    wrong = [e for e in others if e not in put.endpoints][:2]
    with tier(cluster, run) as second:
        assert bytes(second.fetch(1, holders=wrong).image) == image(1)
    assert saw(cluster, run, "LIST") == set(others)


def test_a_restore_in_a_fresh_process_asks_the_daemons_its_row_names(
        cluster: list[Daemon], tmp_path: Path) -> None:
    """End to end: a pilot saves to the peers; a new pilot (a restarted process) restores
    from them through the location its metadata row recorded, listing no other daemon."""
    endpoints = [d.endpoint for d in cluster]
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "tiers: {memory: {enabled: false}, peer: {enabled: true, endpoints: ["
        + ", ".join(f'"{e}"' for e in endpoints) + "], data_shards: 2, parity: true, "
        f'timeout_seconds: 30, secret_file: "{SECRET_FILE}"}}}}\n')
    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with CheckpointPilot(load_policy(policy, run_dir=run_dir), model=model,
                         run_dir=run_dir) as pilot:
        pilot.observe()
        pilot.save(level="pulse", reason="test")
        pilot.flush()
        saved = pilot.saves[-1]
    assert saved.tier.value == "peer"
    holders = set(recorded_holders(saved.location))
    assert len(holders) == 3
    restored = torch.nn.Linear(64, 64)
    with CheckpointPilot(load_policy(policy, run_dir=run_dir), model=restored,
                         run_dir=run_dir) as pilot:
        assert pilot.restore() == saved.step
        assert pilot.last_recovery is not None
        assert pilot.last_recovery.source.value == "peer"
    assert torch.equal(restored.weight.view(torch.int32), model.weight.view(torch.int32))
    peer_run = saved.location.removeprefix("peer:").split("/", 1)[0]
    assert saw(cluster, peer_run, "LIST") == holders
