"""The pilot on the peer tier: real daemons, a real training process SIGKILLed and restarted
(tests/crashjob.py), daemons killed, corrupted and restarted empty."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peerdaemons import SECRET_FILE, Daemon, call, revive, start, stop_all

from ckptpilot import CheckpointPilot, RecoverySource
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.peer.protocol import Op

JOB = Path(__file__).with_name("crashjob.py")
STEPS = 50
pytestmark = pytest.mark.crash


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    """Five daemons (3 data shards + parity take four): one can die and saves still land."""
    logs = tmp_path_factory.mktemp("pilot-peer-logs")
    nodes = [Daemon(logs / f"peer{i}.log", "--mem-limit", "256MiB", "--allow-fault-injection")
             for i in range(5)]
    try:
        yield start(nodes)
    finally:
        stop_all(nodes)


@pytest.fixture
def cluster(daemons: list[Daemon]) -> list[Daemon]:
    return revive(daemons)


def config(tmp: Path, cluster: list[Daemon], *, organ_every: int = 2) -> Path:
    """Saves every 10 steps; every ``organ_every``-th is an organ (peers + remote), the others
    pulses (peers only). Short lease, fast probes."""
    eps = ", ".join(f'"{d.endpoint}"' for d in cluster)
    cfg = tmp / "policy.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        scheduler: {{base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,
                    weights: {{loss: 1.0, grad: 0.0, system: 0.0}},
                    loss: {{slope_threshold: 1000.0}}, organ_every: {organ_every}}}
        tiers: {{peer: {{enabled: true, endpoints: [{eps}], data_shards: 3, parity: true,
                        lease_seconds: 60, timeout_seconds: 5, probe_interval: 0.2,
                        deltas: always, secret_file: "{SECRET_FILE}"}}}}
        observability: {{tensorboard: false, decision_log: false}}
        retention: {{auto: false}}
        """))  # every save stays on disk to be inspected; see test_autoprune.py
    return cfg


def run_job(run_dir: Path, cfg: Path, losses: Path, final: Path, *extra: str
            ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(JOB), "--run-dir", str(run_dir), "--steps", str(STEPS),
           "--config", str(cfg), "--losses", str(losses), "--final", str(final), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def resumed(proc: subprocess.CompletedProcess[str]) -> tuple[list[str], dict[str, object]]:
    lines = proc.stdout.splitlines()
    head = next(ln for ln in lines if ln.startswith("RESUMED")).split()[1:]
    rec = json.loads(next(ln for ln in lines if ln.startswith("RECOVERY")).split(" ", 1)[1])
    return head, rec


def peer_holders(run_dir: Path, step: int) -> list[str]:
    with sqlite3.connect(run_dir / "metadata.sqlite") as db:
        (location,) = db.execute("select location from checkpoints where step = ? and "
                                 "tier = 'peer' and status = 'valid'", (step,)).fetchone()
    return location.rsplit("@", 1)[1].split(",")


def mlp(width: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Tanh(),
                               torch.nn.Linear(4 * width, width))


def restored_into_fresh(cfg: Path, run_dir: Path, width: int, expected_step: int,
                        expected: dict[str, torch.Tensor]) -> CheckpointPilot:
    """A new process's view: a fresh model restored from the run, compared bit for bit."""
    fresh = mlp(width, seed=1)
    again = CheckpointPilot(cfg, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()),
                            run_dir=run_dir)
    assert again.restore() == expected_step
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.view(torch.uint8), expected[k].view(torch.uint8)), k
    return again


def losses_of(path: Path) -> dict[int, str]:
    return {int(s): v for s, v in (line.split() for line in path.read_text().splitlines())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The same training, never interrupted, no peers."""
    tmp = tmp_path_factory.mktemp("peer-reference")
    cfg = tmp / "policy.yaml"
    cfg.write_text("scheduler: {base_interval: 1000, young_daly: false, max_interval: 5000,\n"
                   "  weights: {loss: 1.0, grad: 0.0, system: 0.0},\n"
                   "  loss: {slope_threshold: 1000.0}}\n"
                   "observability: {tensorboard: false, decision_log: false}\n")
    proc = run_job(tmp / "run", cfg, tmp / "losses.txt", tmp / "final")
    assert proc.returncode == 0, proc.stderr
    return {"losses": losses_of(tmp / "losses.txt"),
            "final": safetensors.torch.load_file(tmp / "final")}


def assert_same_run(reference: dict[str, object], losses: Path, final: Path) -> None:
    ref_losses = reference["losses"]
    assert isinstance(ref_losses, dict)
    seen = [(int(s), v) for s, v in (ln.split() for ln in losses.read_text().splitlines())]
    assert {s for s, _ in seen} == set(range(STEPS))
    assert [s for s, v in seen if ref_losses[s] != v] == []
    got, want = safetensors.torch.load_file(final), reference["final"]
    assert isinstance(want, dict) and got.keys() == want.keys()
    for k, t in want.items():
        assert torch.equal(t.reshape(-1).view(torch.uint8),
                           got[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_killed_training_resumes_from_the_peers(
        tmp_path: Path, cluster: list[Daemon], reference: dict[str, object], lost: int) -> None:
    """Saves at 10 (pulse), 20 (organ), 30 (pulse); killed after step 34. With every peer
    alive, or one holder lost (rebuilt from parity), the pulse of step 30 comes back from the
    peers; with two holders lost, the organ of step 20 from the remote tier, and the report
    says why the peers could not serve step 30."""
    cfg = config(tmp_path, cluster)
    run_dir, losses, final = tmp_path / "run", tmp_path / "losses.txt", tmp_path / "final"
    first = run_job(run_dir, cfg, losses, final, "--kill-after-step", "33")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert not any(p.name.startswith("step_00000030") for p in (run_dir / "checkpoints")
                   .iterdir()), "a pulse goes to the peers only"
    holders = peer_holders(run_dir, 30)
    for d in cluster:
        if d.endpoint in holders[:lost]:
            d.kill()

    second = run_job(run_dir, cfg, losses, final)
    assert second.returncode == 0, second.stderr
    head, rec = resumed(second)
    if lost < 2:
        assert head == ["30", "peer", "4", "pulse"]
        rebuilt = "rebuilt from parity" in str(rec["location"])
        assert rebuilt == (lost == 1)
        assert rec["bytes_read"] > 0 and rec["skipped"] == []
    else:
        assert head == ["20", "remote", "14", "organ"]
        skipped = rec["skipped"]
        assert isinstance(skipped, list) and skipped[0][0].endswith("/30")
        assert skipped[0][1].count("connection refused") >= 2, skipped
    assert_same_run(reference, losses, final)


def test_a_corrupted_shard_is_rebuilt_on_restore(tmp_path: Path, cluster: list[Daemon]) -> None:
    cfg = config(tmp_path, cluster, organ_every=100)
    model = mlp(64, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=tmp_path / "run")
    x = torch.randn(32, 64)
    for _ in range(10):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        pilot.observe()
    pilot.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    holders = peer_holders(tmp_path / "run", 10)
    call(holders[0], Op.CORRUPT, {"run_id": pilot.peers.run_id if pilot.peers else "",
                                  "ckpt_id": 10, "shard_index": 0}, timeout_seconds=5)

    again = restored_into_fresh(cfg, tmp_path / "run", 64, 10, expected)
    rec = again.last_recovery
    assert rec is not None and rec.source is RecoverySource.PEER
    assert rec.location is not None and "shard 0 rebuilt from parity" in rec.location
    again.close()


def test_thirty_pulses_fold_on_the_peers_and_restore_reads_one_state(
        tmp_path: Path, cluster: list[Daemon]) -> None:
    """Deltas after the first put; a daemon restarted empty gets its full shard again; a
    restore in a new process reads the N data shards of one state, no chain."""
    cfg = tmp_path / "policy.yaml"
    config(tmp_path, cluster, organ_every=1000)
    cfg.write_text(cfg.read_text().replace("base_interval: 10", "base_interval: 1"))
    model = mlp(128, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=tmp_path / "run")
    x = torch.randn(64, 128)
    for step in range(1, 31):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        pilot.observe()
        # A real step outlasts a 2 MB put; were the next capture to come while the put is in
        # flight, it would take the memory tier's buffers (the base) and the next put would
        # be full (see ckptpilot/tiers/memory.py).
        time.sleep(0.05)
        if step == 15:
            pilot.flush()
            holder = peer_holders(tmp_path / "run", 15)[1]
            victim = next(d for d in cluster if d.endpoint == holder)
            victim.kill()
            revive([victim])  # back, empty, on the same port
    pilot.close()
    state_bytes = pilot.saves[-1].bytes_raw
    assert all(r.tier == "peer" for r in pilot.saves) and len(pilot.saves) == 30
    # Deltas after the first put (AdamW moments change everywhere each step, so a delta is
    # ~0.73 of a full put here; frozen or slow weights cost almost nothing).
    full = pilot.saves[0].bytes  # N data shards + parity: 4/3 of the state
    assert full >= pilot.saves[0].bytes_raw * 4 / 3
    deltas = [r for r in pilot.saves[1:] if r.bytes < full * 0.9]
    assert len(deltas) >= 27, [r.bytes for r in pilot.saves]
    with MetadataStore(tmp_path / "run" / "metadata.sqlite", read_only=True) as store:
        codecs = {row.step: row.codec for row in store.rows(pilot.run_id)}
    assert codecs[pilot.saves[0].step] == "raw"  # the first put: no base on the peers
    assert sum(1 for r in deltas if codecs[r.step] == "xor_delta") == len(deltas), codecs
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    again = restored_into_fresh(cfg, tmp_path / "run", 128, 30, expected)
    rec = again.last_recovery
    assert rec is not None and rec.source is RecoverySource.PEER
    assert state_bytes <= rec.bytes_read <= state_bytes + 3 * 8  # one state (shard padding)
    again.close()


def test_a_restore_to_an_earlier_step_never_comes_back_to_the_abandoned_peer_states(
        tmp_path: Path, cluster: list[Daemon]) -> None:
    """Saves 1-6, every third an organ (peers + remote); the peers keep only the newest.
    Rolling back to step 3 in process expires everything after it: a later restore (as
    after a crash) loads step 3, not the step 6 the peers still hold."""
    cfg = tmp_path / "policy.yaml"
    config(tmp_path, cluster, organ_every=3)
    cfg.write_text(cfg.read_text().replace("base_interval: 10", "base_interval: 1"))
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=tmp_path / "run")
    x = torch.randn(8, 32)
    at = {}
    for step in range(1, 7):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        pilot.observe()
        pilot.flush()
        at[step] = model.weight.detach().clone()
    with sqlite3.connect(tmp_path / "run" / "metadata.sqlite") as db:
        valid = db.execute("select step from checkpoints where tier = 'peer' and "
                           "status = 'valid'").fetchall()
    assert valid == [(6,)], "the peers hold one state per run; older peer rows expire"
    assert pilot.restore(step=3) == 3
    assert pilot.last_recovery is not None
    assert pilot.last_recovery.source is RecoverySource.REMOTE  # the organ of step 3
    pilot.close()
    with sqlite3.connect(tmp_path / "run" / "metadata.sqlite") as db:
        later = db.execute("select step, tier, status from checkpoints where step > 3 and "
                           "status = 'valid'").fetchall()
    assert later == []
    fresh = torch.nn.Linear(32, 32)
    again = CheckpointPilot(cfg, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(),
                                                                        lr=0.1),
                            run_dir=tmp_path / "run")
    assert again.restore() == 3, "the peers still hold step 6, which the run abandoned"
    assert torch.equal(fresh.weight.detach().view(torch.int32), at[3].view(torch.int32))
    again.close()
