"""Peer tier under churn: N real daemons joining, draining and dying while a pilot saves and
restores (issue 27, item 4).

For each N of ``--daemons`` (ascending; the cluster grows, daemons already started are kept):

1. scaling: with all N daemons up, the time of one ``PeerTier.put`` and one ``fetch`` of a
   ``--image-mb`` image (3 data shards + parity, full shards) and of one ``list`` (LIST on
   every endpoint), medians of ``--repeats``, through a tier over all N endpoints watching the
   health registry, as the pilot builds it;
2. churn: a seeded schedule (``--seed``) of ``--events`` events, at most ``--seconds`` long,
   SIGKILLs, SIGTERMs (drain: "draining", then "down") and restarts (join: back empty on its
   port) daemons at random, never leaving fewer than ``data_shards + 2`` up; meanwhile a real
   :class:`~ckptpilot.CheckpointPilot` (memory + peer tier with the registry + the run
   directory as remote) trains, saves pulses (peers) and organs (peers + disk), and every
   ``--cycle-steps`` steps closes and is replaced by a fresh pilot that restores.

Checked, and counted in the output (a violation makes the exit status 1):

- every restore is bit-exact against the state saved at the step it returned (``torch.equal``
  on integer views of every model and optimizer tensor), and a restore of anything but the
  newest save from the peers is a *walk-back* with a stated reason: ``last_recovery.skipped``
  names what was passed over, or the newer saves' peer puts failed (logged by the writer);
- registry reads never mix two writes: a reader reads every node over and over; two synthetic
  writer nodes rewrite their state nonstop with a pause between its two keys, each write
  marking both keys with its number (a mix is visible in the state); for the daemons' nodes,
  versions never go back and one version always reads the same;
- placement keeps a parity group on distinct nodes: every put the pilot records, and every
  checkpoint the live daemons LIST, has each shard on its own daemon, and in the health
  registry's membership model one node is one daemon (``--node`` k), so distinct endpoints
  are distinct nodes.

Everything is on 127.0.0.1; each daemon is a ``ckptpilot peer serve --lazy-torch`` process
with ``--mem-limit`` ``--mem-limit-mib`` and a death signal tied to this process, so that none
outlives it (Ctrl-C, an exception or a SIGKILL of the benchmark). Each daemon costs one
Python interpreter without torch (it imports torch only to fold an ``xor_delta`` delta):
before growing, the benchmark checks that the memory it will need is available and otherwise
stops at the largest N that fits, saying so.

The daemons, the registry watch and the model live in ``bench/churn_parts.py``; this script
is the churn, the checks of each restore and the report.

Usage: ``.venv/bin/python bench/peer_churn.py [--daemons 8,32,64] [--events 40]
[--seconds 120] [--seed 1] [--image-mb 8] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import random
import signal
import sqlite3
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from churn_parts import (
    DATA_SHARDS,
    REPO,
    Cluster,
    HostFull,
    RegistryCheck,
    RegistryWatch,
    Timing,
    differing,
    make_model,
    state_of,
    time_put_fetch,
    train_step,
)

from ckptpilot import CheckpointPilot
from ckptpilot.tiers.peer.calls import call
from ckptpilot.tiers.peer.protocol import Op
from ckptpilot.tiers.peer.registry import connect_registry

log = logging.getLogger("peer_churn")


def policy_file(workdir: Path, cluster: Cluster, n: int) -> Path:
    eps = ", ".join(f'"{e}"' for e in cluster.endpoints(n))
    cfg = workdir / f"policy-{n}.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        scheduler: {{base_interval: 100000, min_interval: 1, max_interval: 100000,
                    young_daly: false}}
        tiers: {{peer: {{enabled: true, endpoints: [{eps}], data_shards: {DATA_SHARDS},
                        parity: true, registry: "{cluster.address}", lease_seconds: 120,
                        timeout_seconds: 5, probe_interval: 0.5,
                        secret_file: "{cluster.secret_file}"}}}}
        validation: {{load_test: none}}
        observability: {{tensorboard: false, decision_log: false}}
        """))
    return cfg


class WarningLog(logging.Handler):
    """Every warning the pilot and the peer tier log, to give walk-backs their reasons."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@dataclass
class Restore:
    newest: int  # the newest step saved before the restart
    step: int
    source: str
    skipped: list[str]
    bit_exact: bool
    reason: str  # why it is not the newest save from the peers ("" when it is)
    forced: bool = False  # after two holders of the newest checkpoint were killed

    @property
    def kind(self) -> str:
        if self.step == self.newest and self.source == "peer":
            return "exact, peers"
        return "walk-back" if self.step < self.newest else f"exact, {self.source}"


@dataclass
class ChurnResult:
    n: int
    restores: list[Restore] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    saves: int = 0
    failed_puts: int = 0
    placements: int = 0
    bad_placements: list[str] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    registry: RegistryCheck = field(default_factory=RegistryCheck)
    warnings: list[str] = field(default_factory=list)
    marked_down_alive: list[int] = field(default_factory=list)
    seconds: float = 0.0


def peer_rows(run_dir: Path) -> dict[int, tuple[str, str]]:
    """step -> (status, location) of the run's newest peer row: ``valid``, ``expired`` once
    a newer put superseded it on the peers, ``corrupted`` when its put failed."""
    with contextlib.closing(sqlite3.connect(run_dir / "metadata.sqlite")) as db:
        rows = db.execute("select step, status, location from checkpoints "
                          "where tier = 'peer' order by id").fetchall()
    return {int(s): (st, loc) for s, st, loc in rows}


def check_listing(cluster: Cluster, n: int, run_id: str, result: ChurnResult) -> None:
    """Every checkpoint the live daemons hold has each shard index on one daemon only and
    no daemon holding two of its shards."""
    holders: dict[tuple[str, int], dict[int, set[str]]] = {}
    for s in cluster.slots[:n]:
        if not s.up:
            continue
        try:
            reply = call(s.endpoint, Op.LIST, {"run_id": run_id}, key=cluster.key,
                         timeout_seconds=5)
        except OSError:
            continue  # died meanwhile
        for shard in reply.header.get("shards", []):
            by_index = holders.setdefault((run_id, int(shard["ckpt_id"])), {})
            by_index.setdefault(int(shard["shard_index"]), set()).add(s.endpoint)
    for (_, ckpt), by_index in holders.items():
        per_endpoint: dict[str, int] = {}
        for endpoints in by_index.values():
            for e in endpoints:
                per_endpoint[e] = per_endpoint.get(e, 0) + 1
        doubled = {e: c for e, c in per_endpoint.items() if c > 1}
        if doubled:
            result.bad_placements.append(f"checkpoint {ckpt}: daemons holding several of its "
                                         f"shards: {doubled}")


class Churn(threading.Thread):
    """Fires the seeded kill / drain / join events, each after a random pause, until
    ``events`` fired or ``seconds`` passed, or :meth:`stop`."""

    def __init__(self, cluster: Cluster, n: int, rng: random.Random, events: int,
                 seconds: float) -> None:
        super().__init__(daemon=True, name="churn")
        self.cluster, self.n, self.rng = cluster, n, rng
        self.events, self.seconds = events, seconds
        self.log: list[str] = []
        self._halt = threading.Event()
        self._done = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        while len(self.log) < self.events and time.monotonic() < deadline:
            if self._halt.wait(self.rng.uniform(0.2, 1.0)):
                break
            self.log.append(f"{time.monotonic() - deadline + self.seconds:.1f}s "
                            + churn_event(self.cluster, self.n, self.rng, DATA_SHARDS + 2))
        self._done.set()

    def finished(self) -> bool:
        return self._done.is_set()

    def stop(self) -> list[str]:
        self._halt.set()
        self.join()
        return self.log


def churn_event(cluster: Cluster, n: int, rng: random.Random, floor: int) -> str:
    """One seeded event among the first ``n`` slots: SIGKILL, drain (SIGTERM: the daemon
    publishes "draining", finishes in-flight requests, then "down") or join (restart empty
    on its port); kills and drains only while more than ``floor`` daemons are up."""
    up = [s for s in cluster.slots[:n] if s.up]
    down = [s for s in cluster.slots[:n] if not s.up]
    kinds = (["kill", "drain"] if len(up) > floor else []) + (["join"] if down else [])
    kind = rng.choice(kinds)
    slot = rng.choice(down if kind == "join" else up)
    if kind == "join":
        try:
            cluster.start([slot])
        except RuntimeError as e:  # its port was taken meanwhile: it stays out
            return f"join {slot.node} failed: {e}"
    else:
        cluster.stop(slot, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
    return f"{kind} {slot.node}"


def run_churn(cluster: Cluster, workdir: Path, n: int, *, events: int, seconds: float,
              seed: int, cycle_steps: int, save_every: int) -> ChurnResult:
    """The pilot trains, saves and restarts (a fresh pilot restores) while the churn thread
    hurts and heals daemons, until the schedule is done (and at least two restores)."""
    result = ChurnResult(n)
    run_dir = workdir / f"run-{n}"
    cfg = policy_file(workdir, cluster, n)
    warnings = WarningLog()
    logging.getLogger().addHandler(warnings)
    watch = RegistryWatch(cluster.address, cluster.capacity,
                          {s.node: s.endpoint for s in cluster.slots})
    churn = Churn(cluster, n, random.Random(seed * 1000 + n), events, seconds)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    levels = ("pulse", "pulse", "organ")
    step, newest, cycle = 0, 0, 0
    t0 = time.perf_counter()
    churn.start()
    try:
        while not churn.finished() or cycle < 3:
            model, opt = make_model(seed=1000 + cycle)  # other bits than any saved state
            pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=run_dir)
            try:
                if cycle:
                    step = pilot.restore()
                    assert pilot.last_recovery is not None
                    result.restores.append(judge(step, newest, pilot.last_recovery, expected,
                                                 state_of(model, opt), peer_rows(run_dir)))
                for _ in range(cycle_steps):
                    step += 1
                    pilot.observe(train_step(model, opt, step))
                    if step % save_every == 0:
                        pilot.save(levels[(step // save_every) % 3], reason="churn bench")
                        expected[step] = state_of(model, opt)
                        newest = step
                        result.saves += 1
                pilot.flush()
            finally:
                pilot.close(save=False)
            check_listing(cluster, n, peer_run_id(run_dir), result)
            cycle += 1
        result.events = churn.stop()
        result.marked_down_alive = alive_but_down(cluster, n)
        result.restores.append(lose_two_holders(cluster, n, cfg, run_dir, newest, expected,
                                                result))
    finally:
        churn.stop()
        result.registry = watch.stop()
        logging.getLogger().removeHandler(warnings)
    result.warnings = list(warnings.lines)
    nodes = {s.endpoint: s.node for s in cluster.slots}
    for st, (status, location) in sorted(peer_rows(run_dir).items()):
        if status == "corrupted" or "@" not in location:  # the put failed
            result.failed_puts += 1
            continue
        placed = location.rsplit("@", 1)[1].split(",")
        result.placements += 1
        if len({nodes.get(e, e) for e in placed}) != len(placed):
            result.bad_placements.append(f"step {st}: {placed}")
    result.unexplained = [f"restore after step {r.newest} -> {r.step} from {r.source}: "
                          + ("not bit-exact" if not r.bit_exact else "no reason found")
                          for r in result.restores if not r.bit_exact or r.reason == "?"]
    result.seconds = time.perf_counter() - t0
    return result


def lose_two_holders(cluster: Cluster, n: int, cfg: Path, run_dir: Path, newest: int,
                     expected: dict[int, dict[str, torch.Tensor]], result: ChurnResult
                     ) -> Restore:
    """SIGKILL two daemons holding shards of the newest checkpoint on the peers (one more
    than parity covers), then restore in a fresh pilot: it must walk back, or fetch the
    step from another tier, and say why."""
    run_id = peer_run_id(run_dir)
    held = holdings(cluster, n, run_id)
    newest_held = max(held, default=None)
    victims = sorted(held.get(newest_held, {}).values())[:2] if newest_held is not None else []
    for slot in cluster.slots[:n]:
        if slot.endpoint in victims and slot.up:
            cluster.stop(slot, signal.SIGKILL)
    result.events.append(f"end: kill {[nodes_of(cluster)[e] for e in victims]}, holders of "
                         f"checkpoint {newest_held}")
    model, opt = make_model(seed=999)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=run_dir)
    try:
        step = pilot.restore()
        assert pilot.last_recovery is not None
        return judge(step, newest, pilot.last_recovery, expected, state_of(model, opt),
                     peer_rows(run_dir), forced=True)
    finally:
        pilot.close(save=False)


def nodes_of(cluster: Cluster) -> dict[str, int]:
    return {s.endpoint: s.node for s in cluster.slots}


def holdings(cluster: Cluster, n: int, run_id: str) -> dict[int, dict[int, str]]:
    """checkpoint -> shard index -> endpoint, as the live daemons LIST them."""
    out: dict[int, dict[int, str]] = {}
    for s in cluster.slots[:n]:
        if not s.up:
            continue
        with contextlib.suppress(OSError):
            reply = call(s.endpoint, Op.LIST, {"run_id": run_id}, key=cluster.key,
                         timeout_seconds=5)
            for shard in reply.header.get("shards", []):
                out.setdefault(int(shard["ckpt_id"]), {})[int(shard["shard_index"])] = s.endpoint
    return out


def alive_but_down(cluster: Cluster, n: int, settle_seconds: float = 3.0) -> list[int]:
    """Nodes whose daemon is alive yet still marked down in the registry after
    ``settle_seconds`` (clients then never place shards there again until it restarts)."""
    time.sleep(settle_seconds)
    reg = connect_registry(cluster.address, timeout_seconds=30)
    states = reg.read_all()
    return [s.node for s in cluster.slots[:n]
            if s.up and states.get(s.node) is not None and states[s.node].status == "down"]


def peer_run_id(run_dir: Path) -> str:
    """The peers' run id of the pilot (its rows' location is ``peer:<run id>/<step>@...``)."""
    rows = peer_rows(run_dir)
    if not rows:
        return ""
    location = rows[max(rows)][1]
    return location.split(":", 1)[1].rsplit("/", 1)[0]


def judge(restored: int, newest: int, rec: Any, expected: dict[int, dict[str, torch.Tensor]],
          state: dict[str, torch.Tensor], rows: dict[int, tuple[str, str]], *,
          forced: bool = False) -> Restore:
    """Compare the restored state with the one saved at its step, and find the stated
    reason for anything but the newest save from the peers: what the restore skipped, or
    the peer rows of the newer saves (a failed put is recorded as ``corrupted``)."""
    skipped = [f"{s.location}: {s.reason}" for s in rec.skipped]
    want = expected.get(restored)
    exact = want is not None and not differing(want, state)
    source = rec.source.value
    reason = ""
    if restored != newest or source != "peer":
        newer = [s for s in expected if restored < s <= newest]
        lost = {s: rows[s][0] if s in rows else "no row" for s in
                (newer if restored < newest else [newest])}
        if skipped:
            reason = "skipped " + "; ".join(skipped)
        elif lost and all(status in ("corrupted", "no row") for status in lost.values()):
            reason = "peer puts failed: " + ", ".join(f"step {s} ({st})"
                                                      for s, st in sorted(lost.items()))
        else:
            reason = "?"
    return Restore(newest, restored, source, skipped, exact, reason, forced)


# ----------------------------------------------------------------------------- report

def report(timings: list[Timing], churns: list[ChurnResult], skipped: list[str],
           startup: dict[int, float], args: argparse.Namespace) -> bool:
    print("\n## put / fetch / list with all N daemons up (medians of "
          f"{args.repeats}; image {args.image_mb} MB = {DATA_SHARDS} data shards + parity)\n")
    print("| N up | tier's endpoints | start (s, new daemons) | put (s) | fetch (s) | list (s) "
          "| put per shard (ms) | fetch per shard (ms) | put vs first N | fetch vs first N "
          "| groups on distinct nodes |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base = timings[0] if timings else None
    for t in timings:
        assert base is not None
        print(f"| {t.n} | {t.endpoints} | {startup[t.n]:.1f} | {t.put:.3f} | {t.fetch:.3f} | "
              f"{t.listing:.3f} | "
              f"{t.put / (DATA_SHARDS + 1) * 1e3:.1f} | {t.fetch / DATA_SHARDS * 1e3:.1f} | "
              f"{t.put / base.put:.2f}x | {t.fetch / base.fetch:.2f}x | {t.groups_ok} |")
    ok = all(t.groups_ok for t in timings)
    print("\n## churn (seeded; events fire between training steps)\n")
    print("| N | events | seconds | saves | peer puts failed | restores | exact from peers "
          "| other tier, same step | walk-backs | not bit-exact | unexplained | bad placements "
          "| registry reads | torn | version regressions | other registry faults |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in churns:
        kinds = [r.kind for r in c.restores]
        reg = c.registry
        print(f"| {c.n} | {len(c.events)} | {c.seconds:.0f} | {c.saves} | {c.failed_puts} | "
              f"{len(c.restores)} | {kinds.count('exact, peers')} | "
              f"{sum(k.startswith('exact, ') and k != 'exact, peers' for k in kinds)} | "
              f"{kinds.count('walk-back')} | {sum(not r.bit_exact for r in c.restores)} | "
              f"{len(c.unexplained)} | {len(c.bad_placements)} | {reg.reads} | {reg.torn} | "
              f"{reg.regressions} | {reg.changed_same_version + reg.wrong_endpoint} |")
        forced = [r for r in c.restores if r.forced]
        ok &= (not c.unexplained and not c.bad_placements and reg.ok
               and not c.marked_down_alive
               and all(r.kind != "exact, peers" for r in forced))
    for c in churns:
        print(f"\nN={c.n} events: " + "; ".join(c.events))
        for r in c.restores:
            if r.kind != "exact, peers" or r.forced:
                print(f"N={c.n} restore{' (two holders killed)' if r.forced else ''} after "
                      f"step {r.newest} -> step {r.step} from {r.source}: {r.reason}")
        if c.marked_down_alive:
            print(f"N={c.n} FAULT: daemons alive but marked down in the registry: "
                  f"nodes {c.marked_down_alive}")
        for line in c.unexplained + c.bad_placements + c.registry.errors[:5]:
            print(f"N={c.n} FAULT: {line}")
    for line in skipped:
        print(f"skipped: {line}")
    full = [t for t in timings if t.endpoints == t.n]
    if len(full) > 1:
        first, last = full[0], full[-1]
        print(f"\nscaling: from N={first.n} to N={last.n} ({last.n / first.n:.0f}x the daemons) "
              f"one put took {last.put / first.put:.2f}x and one fetch "
              f"{last.fetch / first.fetch:.2f}x the time, one list "
              f"{last.listing / first.listing:.2f}x; "
              "a put talks to its parity group and the previous one, a fetch of what the tier "
              "put to its group only; list asks every endpoint")
        few = [t for t in timings if t.endpoints == first.n and t.n == last.n]
        if few:
            print(f"with N={last.n} daemons up but a tier over {first.n} of them, one put took "
                  f"{few[0].put / first.put:.2f}x and one fetch "
                  f"{few[0].fetch / first.fetch:.2f}x the N={first.n} time: what the extra "
                  "daemons cost this host, without the fan-out")
    print(f"\nresult: {'all invariants held' if ok else 'INVARIANT VIOLATED'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--daemons", default="8,32,64",
                        help="comma-separated daemon counts, ascending (default 8,32,64)")
    parser.add_argument("--events", type=int, default=40, help="churn events per N")
    parser.add_argument("--seconds", type=float, default=120.0, help="churn time per N")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--image-mb", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mem-limit-mib", type=int, default=32)
    parser.add_argument("--cycle-steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--churn-at", default="all",
                        help="'all', or comma-separated N to run churn at (others: timing only)")
    parser.add_argument("--dir", type=Path, default=REPO / ".bench-tmp")
    args = parser.parse_args()
    counts = sorted(int(c) for c in args.daemons.split(","))
    churn_at = set(counts) if args.churn_at == "all" else {int(c) for c in
                                                          args.churn_at.split(",")}
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; torch {torch.__version__}, python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"daemons: `ckptpilot peer serve --mem-limit {args.mem_limit_mib}MiB --registry ...` "
          "on 127.0.0.1 (loopback), sharing this host's CPUs with the trainer")
    ok = False
    with scratch(args.dir) as workdir:
        cluster = Cluster(workdir, counts[-1], args.mem_limit_mib)
        try:
            ok = run_all(cluster, workdir, counts, churn_at, args)
        finally:
            cluster.close()
    sys.exit(0 if ok else 1)


def run_all(cluster: Cluster, workdir: Path, counts: list[int], churn_at: set[int],
            args: argparse.Namespace) -> bool:
    timings: list[Timing] = []
    churns: list[ChurnResult] = []
    skipped: list[str] = []
    startup: dict[int, float] = {}
    for n in counts:
        for s in cluster.slots:  # the previous churn left some out: bring all back
            if not s.up:
                cluster.start([s])
        try:
            startup[n] = cluster.grow(n)
        except HostFull as e:
            skipped.append(f"N={n} and above: {e}")
            break
        print(f"N={n}: daemons listening ({startup[n]:.1f} s for the new ones); "
              f"{cluster.per_daemon_bytes() / 2**20:.0f} MiB unique memory per daemon",
              flush=True)
        time.sleep(1.5)  # a registry refresh: every node announced before the first put
        timings.append(time_put_fetch(cluster, n, args.image_mb, args.repeats))
        if n != counts[0]:
            timings.append(time_put_fetch(cluster, n, args.image_mb, args.repeats, counts[0]))
        for t in timings[-2 if n != counts[0] else -1:]:
            print(f"N={n}, tier over {t.endpoints}: put {t.put:.3f} s, fetch {t.fetch:.3f} s, "
                  f"list {t.listing:.3f} s", flush=True)
        if n in churn_at:
            churns.append(run_churn(cluster, workdir, n, events=args.events,
                                    seconds=args.seconds, seed=args.seed,
                                    cycle_steps=args.cycle_steps, save_every=args.save_every))
            c = churns[-1]
            print(f"N={n}: churn done: {len(c.events)} events, {len(c.restores)} restores, "
                  f"{c.failed_puts} failed puts, {len(c.unexplained)} unexplained", flush=True)
    return report(timings, churns, skipped, startup, args)


@contextlib.contextmanager
def scratch(parent: Path) -> Iterator[Path]:
    sys.path.insert(0, str(REPO / "bench"))
    from scratch import scratch_dir

    with scratch_dir(parent, "peer-churn-") as workdir:
        yield workdir


if __name__ == "__main__":
    main()
