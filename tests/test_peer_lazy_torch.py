"""A peer daemon without torch (``ckptpilot peer serve --lazy-torch``): it stores, serves and
announces itself in the health registry with numpy, memoryviews and the plain-Python store
client, and imports torch only to fold its first ``xor_delta`` delta. Many daemons on one
host (bench/peer_churn.py) cannot afford torch's few hundred MB each.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from peerdaemons import KEY, Daemon, call, start, stop_all

from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.peer.deltas import BLOCK_BYTES
from ckptpilot.tiers.peer.protocol import XOR_DELTA, Op
from ckptpilot.tiers.peer.registry import NodeState, connect_registry, host_registry

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(),
                                reason="reads /proc/PID/maps")


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_daemon_and_its_command_import_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, ckptpilot.tiers.peer.daemon, "
         "ckptpilot.tiers.peer.command, ckptpilot.tiers.peer.membership, ckptpilot.cli; "
         "print('torch' in sys.modules)"],
        capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_lazy_daemon_serves_and_announces_without_torch_until_an_xor_delta(
        tmp_path: Path) -> None:
    store = host_registry("127.0.0.1", 0, num_nodes=2)
    lazy = Daemon(tmp_path / "lazy.log", "--registry", f"127.0.0.1:{store.port}", "--node", "1",
                  "--mem-limit", "16MiB", "--log-level", "WARNING", "--lazy-torch")
    eager = Daemon(tmp_path / "eager.log", "--mem-limit", "16MiB", "--log-level", "WARNING")
    start([lazy, eager])
    try:
        reader = connect_registry(f"127.0.0.1:{store.port}", timeout_seconds=10)
        deadline = time.monotonic() + 30
        state: NodeState | None = None
        while time.monotonic() < deadline:
            state = reader.read(1)
            if state is not None and state.status == "up":
                break
            time.sleep(0.05)
        assert state is not None and state.endpoint == lazy.endpoint
        assert lazy.proc is not None and eager.proc is not None
        assert _maps_torch(eager.proc.pid)  # the default: no fold waits for the import
        pid = lazy.proc.pid
        assert not _maps_torch(pid)
        info = psutil.Process(pid).memory_full_info()
        print(f"\nlazy peer daemon, announced: RSS {info.rss / 2**20:.1f} MiB, unique "
              f"{info.uss / 2**20:.1f} MiB (eager: unique "
              f"{psutil.Process(eager.proc.pid).memory_full_info().uss / 2**20:.1f} MiB)")

        old = np.random.default_rng(0).standard_normal(100 * BLOCK_BYTES // 4).astype(np.float32)
        new = old.copy()
        new[::3] += np.float32(1e-3)  # every block moves a little: the codec's delta
        with PeerTier([lazy.endpoint], run_id="lazy", secret=KEY, data_shards=1, parity=False,
                      deltas="always", timeout_seconds=120, lease_seconds=60) as tier:
            tier.put(1, old.tobytes(), b"m")
            assert not _maps_torch(pid)  # a full shard is stored with numpy
            put = tier.put(2, new.tobytes(), b"m", base=(1, old.tobytes()))
            assert put.encodings == (XOR_DELTA,)
            assert bytes(tier.fetch(2).image) == new.tobytes()
        assert _maps_torch(pid)
        assert call(lazy.endpoint, Op.PING, {}, timeout_seconds=10).header["mem_used"] > 0
    finally:
        stop_all([lazy, eager])
        del store
