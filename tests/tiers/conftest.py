"""Backends of the tier conformance suite: how to open a fresh tier of each kind, where that
tier keeps its bytes (to corrupt them) and how to make a put of it fail half-way.

Every tier is built by the functions the pilot's assembly builds its own with
(``ckptpilot.assembly.memory_tier`` / ``peer_tier`` / ``remote_tier`` / ``sharded_tier``, the
remote one with the default policy's post-write validator and codecs, the sharded one as a
single process's DCP checkpoints, ``no_dist``, loading the saved tensors whole): the suite
certifies the objects training uses (``tests/test_layout.py`` checks that it does).

A test module adds tiers of its own by listing their classes in ``EXTRA_TIERS``: such a class
is built with no arguments and corrupts its own bytes with ``corrupt(step)``.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: peerdaemons

from peerdaemons import KEY, Daemon, call, revive, start, stop_all

from ckptpilot.assembly import (
    codec_selector,
    memory_tier,
    peer_tier,
    remote_tier,
    sharded_tier,
)
from ckptpilot.capture.state import HostBufferPool
from ckptpilot.dcp import dcp_name
from ckptpilot.policy import Policy
from ckptpilot.tiers.base import CheckpointTier, TierCapabilities
from ckptpilot.tiers.peer import PeerTier, PeerUnavailable
from ckptpilot.tiers.peer.protocol import Op
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator

PEERS = 3


@dataclass
class Backend:
    """One backend under test. ``open`` gives a fresh, empty tier; ``broken`` a tier over the
    same storage whose puts fail half-way (None where a put has no I/O to fail)."""

    open: Callable[[], CheckpointTier]
    corrupt: Callable[[CheckpointTier, int], None]
    capabilities: TierCapabilities
    broken: Callable[[], CheckpointTier] | None = None
    opened: list[CheckpointTier] = field(default_factory=list)

    def tier(self) -> CheckpointTier:
        tier = self.open()
        self.opened.append(tier)
        return tier

    def broken_tier(self) -> CheckpointTier | None:
        if self.broken is None:
            return None
        tier = self.broken()
        self.opened.append(tier)
        return tier


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1:]


def memory_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    def corrupt(t: Any, step: int) -> None:
        held = t.newest()
        assert held is not None and held.step == step
        held.snapshot.arena[held.snapshot.nbytes // 2] ^= 0xFF

    return Backend(lambda: memory_tier(1 << 30, HostBufferPool(2)), corrupt,
                   TierCapabilities(
                       durable=False, survives_node_loss=False, folds_deltas=False, speed=0,
                       keeps_older=False))


class _FullDisk(RemoteTier):
    """A remote tier whose storage fills up when the manifest, written last, is due."""

    def write_file(self, relpath: str, chunks: Any) -> tuple[int, str]:
        if relpath.endswith("manifest.json"):
            raise OSError(28, "No space left on device (injected)")
        return super().write_file(relpath, chunks)


@pytest.fixture(scope="session")
def validator() -> Iterator[PostWriteValidator]:
    """The default policy's post-write validator (a load test in another process), shared
    by every remote tier of the session: one worker process, not one per test."""
    checker = PostWriteValidator(Policy().validation)
    try:
        yield checker
    finally:
        checker.close()


def _storage_backend(url: str, build: Callable[[RemoteTier], CheckpointTier],
                     last_file: Callable[[int], tuple[str, str]]) -> Backend:
    """A tier on a ``RemoteTier`` at ``url``; its corruption flips the last byte of the file
    ``last_file(step)`` (directory, file name), and its broken twin's disk is full."""

    def corrupt(t: Any, step: int) -> None:
        path = t.remote.path(*last_file(step))
        data = t.remote.fs.cat_file(path)
        t.remote.fs.pipe_file(path, _flip(data, len(data) - 1))

    return Backend(lambda: build(RemoteTier(url)), corrupt,
                   TierCapabilities(durable=True, survives_node_loss=True, folds_deltas=False,
                                    speed=2, keeps_older=True),
                   broken=lambda: build(_FullDisk(url)))


def _remote_backend(request: pytest.FixtureRequest, url: str) -> Backend:
    checker = request.getfixturevalue("validator")
    codecs = codec_selector(Policy())
    return _storage_backend(
        url, lambda remote: remote_tier(remote, rank=0, validator=checker, codecs=codecs),
        lambda step: (f"step_{step:08d}_rank_00000", "tensors.safetensors"))  # last tensor byte


def remote_file_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return _remote_backend(request, f"file://{tmp_path}/remote")


def remote_memory_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    root = f"/conformance-{uuid.uuid4().hex}"
    request.addfinalizer(lambda: fsspec.filesystem("memory").rm(root, recursive=True)
                         if fsspec.filesystem("memory").exists(root) else None)
    return _remote_backend(request, f"memory://{root}")


def sharded_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The DCP-backed tier of one process (``no_dist``): each image one DCP checkpoint."""
    policy = Policy().with_run_dir(tmp_path / "run")
    url = f"file://{tmp_path}/sharded"
    codecs = codec_selector(policy)
    return _storage_backend(
        url, lambda remote: sharded_tier(policy, remote, rank=0, world_size=1, group=None,
                                         codecs=codecs),
        lambda step: (dcp_name(step), "__0_0.distcp"))  # in the last item


@pytest.fixture(scope="session")
def peer_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    logs = tmp_path_factory.mktemp("tier-peer-logs")
    daemons = [Daemon(logs / f"peer{i}.log", "--mem-limit", "64MiB", "--allow-fault-injection")
               for i in range(PEERS)]
    try:
        yield start(daemons)
    finally:
        stop_all(daemons)


class _LostCommit(PeerTier):
    """Every shard reaches its peer, then the COMMIT is lost: the put fails half-way."""

    def _commit(self, ckpt_id: int, holders: Any, stripe: Any) -> None:
        raise PeerUnavailable(f"checkpoint {ckpt_id}: COMMIT lost (injected)")


def peer_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    daemons = revive(request.getfixturevalue("peer_daemons"))
    endpoints = [d.endpoint for d in daemons]
    run_id = f"conformance-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {"run_id": run_id, "secret": KEY, "data_shards": 2, "parity": True,
                               "probe_interval": 0.2, "timeout_seconds": 5.0,
                               "lease_seconds": 60.0, "deltas": "always"}

    def corrupt(t: Any, step: int) -> None:
        """Flip a byte of two of the three shards: more than parity can rebuild."""
        for endpoint in endpoints:
            held = call(endpoint, Op.LIST, {"run_id": run_id}, timeout_seconds=5).header
            for shard in held["shards"]:
                if shard["ckpt_id"] == step and shard["shard_index"] < 2:
                    call(endpoint, Op.CORRUPT, {"run_id": run_id, "ckpt_id": step,
                                                "shard_index": shard["shard_index"]},
                         timeout_seconds=5)

    return Backend(lambda: peer_tier(PeerTier(endpoints, **options), rank=0), corrupt,
                   TierCapabilities(durable=False, survives_node_loss=True, folds_deltas=True,
                                    speed=1, keeps_older=False),
                   broken=lambda: peer_tier(_LostCommit(endpoints, **options), rank=0))


def _self_backend(cls: type) -> Callable[[pytest.FixtureRequest, Path], Backend]:
    """A test's own tier class: it corrupts itself and declares what it promises."""
    def make(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
        return Backend(cls, lambda t, step: t.corrupt(step), cls.capabilities)
    return make


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "memory": memory_backend,
    "peer": peer_backend,
    "remote-file": remote_file_backend,
    "remote-memory": remote_memory_backend,
    "sharded": sharded_backend,
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        extra = {cls.__name__: _self_backend(cls)
                 for cls in getattr(metafunc.module, "EXTRA_TIERS", ())}
        makers = {**BACKENDS, **extra}
        metafunc.parametrize("backend_maker", list(makers.values()), ids=list(makers))


@pytest.fixture
def backend(backend_maker: Callable[[pytest.FixtureRequest, Path], Backend],
            request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    made = backend_maker(request, tmp_path)
    try:
        yield made
    finally:
        for tier in made.opened:
            tier.close()
