"""Operations on a run's checkpoints from outside training: ls, recover, prune, validate.

Each function takes a resolved policy (its ``run_dir`` names the run), prints what it does,
and returns an exit status. Bad input raises :class:`OpError` (the CLI prints it on one line,
exit 2). ``ls`` and every ``dry_run`` open the metadata read-only: they write nothing (not the
checkpoints, not the metadata, not the audit table, no lease) and work in a run directory the
user cannot write. This module owns no format: archives, the metadata store, the retention
planner and the post-write validator do the work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ckptpilot.catalog import Moves, write_pin
from ckptpilot.dcp.format import parse_dcp_name
from ckptpilot.dcp.storage import check_published, list_dcp, rows_of, verify_dcp
from ckptpilot.dcp.storage import read_manifest as read_dcp_manifest
from ckptpilot.errors import CheckpointFormatError, CkptPilotError, LineageError
from ckptpilot.policy import Policy
from ckptpilot.retention.auto import remote_remover, sweep_removals
from ckptpilot.retention.plan import BestPolicy, execute_plan, plan_retention, repair
from ckptpilot.rundir import (
    aside_path,
    every_lease,
    lineage_path,
    metadata_path,
    read_run_id,
    run_identity,
)
from ckptpilot.storage.damaged import set_aside
from ckptpilot.storage.lineage import Lineage, UnknownContinuationError, fork, read_lineage
from ckptpilot.storage.metadata import CheckpointRow, MetadataCorruptError, MetadataStore
from ckptpilot.tiers.remote.archive import parse_checkpoint_name, read_manifest, verify_organ
from ckptpilot.tiers.remote.entries import is_debris
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator
from ckptpilot.vocab import CheckpointKey, Status, Tier

_DB_SUFFIXES = ("", "-wal", "-shm")


class OpError(CkptPilotError):
    """Bad input to a run operation; the message names what is wrong."""


def _table(rows: Sequence[Sequence[object]], header: Sequence[str], out: TextIO) -> None:
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


class Run:
    """The run directory, its remote tier and (when it exists) its metadata store.

    ``run_id`` is the key of the run's rows: the id in the directory's ``run_id`` file, so a
    copied or renamed directory keeps its history; the folder's name for a directory that has
    no id yet, or whose rows are still keyed by its name (its pilot re-keys them on its next
    start). Settled by :meth:`store`, which also records in ``other_run_ids`` the rows the
    database holds under any other id.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.dir = Path(policy.run_dir)
        if not self.dir.is_dir():
            raise OpError(f"run directory {self.dir} does not exist (check --run-dir)")
        self.run_id = read_run_id(self.dir) or self.dir.name
        self.other_run_ids: dict[str, int] = {}
        self.db_path = metadata_path(self.dir)
        self.remote = RemoteTier(policy.tiers.remote.url, policy.tiers.remote.storage_options,
                                 retries=policy.tiers.remote.retries)

    def store(self, *, read_only: bool = False) -> MetadataStore:
        if not os.path.lexists(self.db_path):
            raise OpError(f"no metadata database at {self.db_path}; rebuild it from the "
                          "checkpoints with `ckptpilot validate --rebuild`")
        store = MetadataStore(self.db_path, read_only=read_only)
        try:
            counts = store.run_ids()
        except BaseException:
            store.close()
            raise
        if self.run_id not in counts and self.dir.name in counts:
            self.run_id = self.dir.name
        self.other_run_ids = {k: n for k, n in counts.items() if k != self.run_id}
        return store

    def published(self) -> list[tuple[int, int, str]]:
        """(step, rank, name) of every published checkpoint, oldest first."""
        found = []
        for name in self.remote.list():
            parsed = parse_checkpoint_name(name)
            if parsed is not None and self.remote.committed(name):
                found.append((parsed[0], parsed[1], name))
        return sorted(found)

    def unfinished(self) -> list[str]:
        """Saves a killed writer left: staging directories, and on an object store the
        checkpoint directories (archives, DCP) whose manifest was never written; and what a
        removal cut short left (``*.removing-*``)."""
        return [name for name in self.remote.list() if is_debris(name) or (
            (parse_checkpoint_name(name) is not None or parse_dcp_name(name) is not None)
            and not self.remote.committed(name))]

    @staticmethod
    def entry(row: CheckpointRow) -> str:
        return row.location.rstrip("/").rsplit("/", 1)[-1]


def ls(policy: Policy, out: TextIO) -> int:
    run = Run(policy)
    with run.store(read_only=True) as store:
        rows = store.rows(run.run_id)
    now = time.time()
    table = [(r.step, r.rank, r.level.value, r.tier.value, r.status.value,
              r.retention_class.value, "-" if r.score is None else f"{r.score:.2f}",
              _size(r.bytes_encoded), _age(now - r.created_at),
              "-" if r.metric_name is None else f"{r.metric_name}={r.metric_value:.4g}")
             for r in rows]
    if not table and run.other_run_ids:
        others = ", ".join(f"{k} ({n} rows)" for k, n in run.other_run_ids.items())
        print(f"no checkpoints recorded for run id {run.run_id}; {run.db_path} has rows "
              f"recorded under run id {others}: it holds another run's history (a copy made "
              "before the run had an id?); `ckptpilot validate --rebuild` records this run's "
              "published checkpoints under its own id", file=out)
    elif not table:
        print(f"no checkpoints recorded for run {run.run_id}", file=out)
    else:
        _table(table, ("step", "rank", "level", "tier", "status", "class", "score", "size",
                       "age", "metric"), out)
    known = {(r.step, r.rank) for r in rows}
    missing = [n for s, rk, n in run.published() if (s, rk) not in known]
    located = {Run.entry(r) for r in rows}  # every rank's row of a DCP save points at it
    missing += [n for _, n in list_dcp(run.remote) if n not in located]
    if missing:
        print(f"{len(missing)} published checkpoint(s) have no metadata row (e.g. "
              f"{missing[0]}); `ckptpilot validate --rebuild` adds them", file=out)
    return 0


def recover(policy: Policy, *, step: int, dry_run: bool, force: bool, out: TextIO) -> int:
    """Make ``step`` the recovery point: the next ``restore()`` of the run loads it.

    Checkpoints of later steps belong to the continuation being abandoned; they are set
    aside (renamed, kept for inspection until the next prune) and their rows expired, so
    that a restart does not mistake them for the newest state. First, every rank's lineage
    record gets a reset fork at ``step`` (``storage.lineage``): the abandonment holds for
    copies no row lists (the peers') and survives a lost database, and continuations a lost
    record no longer knows are adopted up to ``step``. With ``force`` a pin file makes the
    next ``restore()`` load exactly this step whatever its metadata status, and a damaged
    lineage record is set aside (kept) instead of refused.
    """
    run = Run(policy)
    with run.store(read_only=dry_run) as store:
        published = run.published()
        dcps = list_dcp(run.remote)
        targets = [(rk, n) for s, rk, n in published if s == step]
        dcp_target = dict(dcps).get(step)
        if not targets and dcp_target is None:
            raise OpError(f"no published checkpoint of step {step} in {run.remote.url}")
        plan = [] if dcp_target is None else _dcp_plan(store, run, step, dcp_target, force)
        for rank, name in targets:
            row = store.get(CheckpointKey(run.run_id, step, rank, Tier.REMOTE))
            status = row.status.value if row is not None else "unknown"
            try:
                manifest = read_manifest(run.remote, name)
                verify_organ(run.remote, name)
                check = "verified"
            except CheckpointFormatError as e:
                raise OpError(f"step {step}, rank {rank}: {name} cannot be loaded: {e}") from e
            if status not in ("valid", "unknown") and not force:
                raise OpError(f"step {step}, rank {rank} is {status} in the metadata; "
                              "use --force to recover it anyway")
            plan.append((step, rank, manifest["level"], status, check, run.remote.path(name)))
        later = [(s, rk, n) for s, rk, n in published if s > step]
        later_dcp = [(s, n) for s, n in dcps if s > step]
        print(f"{'would load' if dry_run else 'will load'} on the next restore():", file=out)
        _table(plan, ("step", "rank", "level", "status", "check", "location"), out)
        if later or later_dcp:
            names = [n for _, _, n in later] + [n for _, n in later_dcp]
            print(f"{'would set' if dry_run else 'setting'} aside {len(names)} later "
                  f"checkpoint(s): {', '.join(names)}", file=out)
        damaged = _damaged_lineages(run, {rk for _, rk, _ in published}, force)
        for path in damaged:
            print(f"{'would set' if dry_run else 'setting'} aside the damaged lineage record "
                  f"{path}", file=out)
        if dry_run:
            print("dry run: nothing changed", file=out)
            return 0
        for path, problem in damaged.items():
            set_aside(path, problem, f"`ckptpilot recover --step {step} --force` starts a "
                      "new record there")
        for path in _lineage_paths(run, {rk for _, rk, _ in published}).values():
            fork(path, step, f"ckptpilot recover --step {step}", reset=True)
        abandoned = []
        moves = Moves(store)
        for s, rank, name in later:
            aside = run.remote.set_aside(name, f"abandoned-by-recover-{step}")
            abandoned.append(aside)
            row = store.get(CheckpointKey(run.run_id, s, rank, Tier.REMOTE))
            if row is not None and row.status is not Status.EXPIRED:
                moves.abandon(row.key, f"abandoned by `ckptpilot recover --step {step}`",
                              location=run.remote.path(aside))
        for s, name in later_dcp:
            rows = rows_of(store, run.run_id, s, name)
            aside = run.remote.set_aside(name, f"abandoned-by-recover-{step}")
            abandoned.append(aside)
            for row in rows:
                if row.status is not Status.EXPIRED:
                    moves.abandon(row.key, f"abandoned by `ckptpilot recover --step {step}`",
                                  location=run.remote.path(aside))
        for row in store.rows(run.run_id, tier=Tier.PEER):
            # Peer copies of the abandoned continuation: their rows are what makes a restore
            # consider them, and the peers drop them as newer saves supersede them.
            if row.step > step and row.status in (Status.VALID, Status.PENDING):
                moves.abandon(row.key, f"abandoned by `ckptpilot recover --step {step}`")
                abandoned.append(row.location)
        if force:
            write_pin(run.dir, step, force=True)
        store.audit("recover-force" if force else "recover",
                    {"step": step, "ranks": [rk for rk, _ in targets], "abandoned": abandoned})
    print(f"recovery point set to step {step}" + (" (forced)" if force else ""), file=out)
    return 0


def _lineage_paths(run: Run, ranks: set[int]) -> dict[int, Path]:
    """The lineage record of every rank with a checkpoint or a record, by rank."""
    found = set(ranks)
    for path in run.dir.glob("lineage_rank_*.jsonl"):
        rank = path.stem.rsplit("_", 1)[1]
        if rank.isdigit():
            found.add(int(rank))
    return {rank: lineage_path(run.dir, rank) for rank in sorted(found)}


def _damaged_lineages(run: Run, ranks: set[int], force: bool) -> dict[Path, str]:
    """The lineage records that cannot be read, with why; raises the first one's
    ``LineageError`` unless ``force``."""
    damaged = {}
    for path in _lineage_paths(run, ranks).values():
        try:
            read_lineage(path)
        except LineageError as e:
            if not force:
                raise
            damaged[path] = str(e)
    return damaged


def _dcp_plan(store: MetadataStore, run: Run, step: int, name: str,
              force: bool) -> list[tuple[object, ...]]:
    """The plan rows of recovering to the DCP checkpoint ``name``: verified, every rank."""
    if force:
        raise OpError(f"step {step} is a DCP checkpoint ({name}): --force pins a step for the "
                      "pilot's restore(), which does not read DCP checkpoints; load it with "
                      f"ckptpilot.dcp.Reader(run_dir, step={step}), which reads any verified step")
    rows = {row.rank: row for row in rows_of(store, run.run_id, step, name)}
    try:
        manifest = read_dcp_manifest(run.remote, name)
        verify_dcp(run.remote, name, manifest, ranks={rk: r.sha256 for rk, r in rows.items()})
    except CheckpointFormatError as e:
        raise OpError(f"step {step}: {name} cannot be loaded: {e}") from e
    plan: list[tuple[object, ...]] = []
    for rank in range(int(manifest["world_size"])):
        status = rows[rank].status.value if rank in rows else "unknown"
        if status not in ("valid", "unknown"):
            raise OpError(f"step {step}, rank {rank} is {status} in the metadata; a DCP "
                          f"checkpoint can still be read with ckptpilot.dcp.Reader(run_dir, "
                          f"step={step})")
        plan.append((step, rank, manifest["level"], status, "verified", run.remote.path(name)))
    return plan


def prune(policy: Policy, *, dry_run: bool, out: TextIO) -> int:
    """Apply the retention classes. A row whose location is not a checkpoint the tier may
    delete (``tiers.remote.entries``) is refused: one line names it and why, nothing of it is
    deleted, the prune goes on with the other rows and exits 1."""
    run = Run(policy)
    best = policy.retention.best
    best_policy = None if best is None else BestPolicy(best.metric, best.mode, best.keep)
    refused: list[tuple[int, str]] = []
    sweep_failed: list[str] = []
    with run.store(read_only=dry_run) as store:
        remover = remote_remover(run.remote)
        if not dry_run:
            fixed = repair(Moves(store), remover.exists, remover.remove,  # type: ignore[arg-type]
                           vet=remover.vet)  # type: ignore[arg-type]
            refused += fixed.refused
            if fixed.removed:
                print(f"repaired {len(fixed.removed)} interrupted removal(s)", file=out)
            swept, sweep_failed = sweep_removals(run.remote)
            if swept:
                print(f"removed {len(swept)} leftover(s) of interrupted removals", file=out)
            for line in sweep_failed:
                print(f"  {line}", file=out)
        plan = plan_retention(store.rows(run.run_id), policy.retention, best=best_policy)
        table = [(r.step, r.rank, r.level.value, r.tier.value, r.status.value,
                  r.retention_class.value, _size(r.bytes_encoded), action, why)
                 for action, items in (("keep", plan.keep), ("remove", plan.remove))
                 for r, why in items]
        table.sort(key=lambda t: (t[1], t[0]))
        _table(table, ("step", "rank", "level", "tier", "status", "class", "size", "action",
                       "reason"), out)
        if dry_run:
            freed = sum(r.bytes_encoded or 0 for r, _ in plan.remove)
            print(f"dry run: would remove {len(plan.remove)} checkpoint(s), "
                  f"{_size(freed)}; nothing changed", file=out)
            return 0
        report = execute_plan(plan, Moves(store), remover.remove,  # type: ignore[arg-type]
                              vet=remover.vet)  # type: ignore[arg-type]
        refused += report.refused
    gone = set(report.removed)
    freed = sum(r.bytes_encoded or 0 for r, _ in plan.remove if r.id in gone)
    print(f"removed {len(report.removed)} checkpoint(s), {_size(freed)}; skipped "
          f"{len(report.skipped)}, failed {len(report.failed)}, refused {len(refused)}",
          file=out)
    for row_id, why in (*report.skipped, *report.failed, *refused):
        print(f"  row {row_id}: {why}", file=out)
    return 1 if report.failed or refused or sweep_failed else 0


def _set_aside(db_path: Path, label: str) -> Path:
    """Rename the database (with its ``-wal`` and ``-shm`` files) to a name no file has yet;
    returns the new name. A damaged file is evidence, so it is never deleted."""
    aside = aside_path(db_path, label, _DB_SUFFIXES)
    for suffix in _DB_SUFFIXES:
        if os.path.lexists(f"{db_path}{suffix}"):
            os.rename(f"{db_path}{suffix}", f"{aside}{suffix}")
    return aside


def _is_damaged(db_path: Path) -> bool:
    try:
        with MetadataStore(db_path, read_only=True) as store:
            store.rows()  # a file may open cleanly and fail on the first page a query reads
            store.audit_log()
    except MetadataCorruptError:
        return True
    except CkptPilotError:  # readable, only not usable here (a newer schema, say): kept as is
        return False
    return False


def validate(policy: Policy, *, rebuild: bool, out: TextIO, dry_run: bool = False) -> int:
    """Re-verify every published checkpoint (hashes, and the load test unless the policy
    disables it); mark failures ``corrupted``; exit status 1 when any is corrupted.

    ``rebuild`` first recreates the metadata database from the manifests, keyed by the run's
    id (created if the directory has none); an existing file is renamed, never deleted:
    ``.damaged-<unix time>`` when it cannot be read, ``.before-rebuild-<unix time>``
    otherwise. A checkpoint its rank's lineage record says a restore abandoned
    (``storage.lineage``) gets an ``expired`` row, as the original database had: a restore
    does not resume it and a prune removes it. ``dry_run`` reports the same results and marks
    nothing.
    """
    if rebuild and dry_run:
        raise OpError("--rebuild writes a new database; it cannot be combined with --dry-run")
    run = Run(policy)
    if not rebuild:
        return _validate(policy, run, rebuild=False, out=out, dry_run=dry_run)
    with every_lease(run.dir):  # never beside a live pilot that has the database open
        return _validate(policy, run, rebuild=True, out=out, dry_run=False)


def _validate(policy: Policy, run: Run, *, rebuild: bool, out: TextIO, dry_run: bool) -> int:
    lineages: dict[int, Lineage] = {}
    unknown: list[str] = []
    if rebuild:
        run.run_id = run_identity(run.dir)
        # Before anything moves: a damaged record stops the rebuild. Every record there is,
        # so also those of the ranks of the sharded checkpoints; a rank without one has
        # never restored (its record reads as no fork).
        lineages = {rank: read_lineage(path) for rank, path in
                    _lineage_paths(run, {rk for _, rk, _ in run.published()}).items()}
        if os.path.lexists(run.db_path):
            label = "damaged" if _is_damaged(run.db_path) else "before-rebuild"
            aside = _set_aside(run.db_path, label)
            print(f"kept the previous database as {aside}", file=out)
    store = MetadataStore(run.db_path) if rebuild else run.store(read_only=dry_run)
    # Checking stored checkpoints for rot is re-reading them: always the paranoid mode.
    validator = PostWriteValidator(policy.validation.model_copy(update={"paranoid": True}))
    table = []
    bad = 0
    would_mark = {Status.VALID: 0, Status.CORRUPTED: 0}
    try:
        for step, rank, name in run.published():
            key = CheckpointKey(run.run_id, step, rank, Tier.REMOTE)
            try:
                manifest = read_manifest(run.remote, name)
            except CheckpointFormatError as e:
                manifest, result_ok, reason = None, False, str(e)
            else:
                result = validator.validate(run.remote, name, manifest, {})
                result_ok, reason = result.ok, result.reason
            row = store.get(key)
            if row is None and rebuild and manifest is not None:
                row = _row_from_manifest(store, run, manifest, name)
                row, reason = _expire_abandoned(store, row, run, lineages,
                                                manifest.get("branch"), name, reason, unknown)
            _settle(store, row, result_ok, reason, dry_run, would_mark)
            bad += not result_ok
            table.append((step, rank, "-" if manifest is None else manifest["level"],
                          "ok" if result_ok else "CORRUPTED", reason))
        for check in check_published(store, run.run_id, run.remote, rebuild=rebuild):
            row = store.get(CheckpointKey(run.run_id, check.step, check.rank, Tier.REMOTE))
            reason = check.reason
            if row is not None and Run.entry(row) == check.name:  # not another save's row
                if rebuild and check.branch is not None and row.status is Status.PENDING:
                    row, reason = _expire_abandoned(store, row, run, lineages, check.branch,
                                                    f"{check.name} rank {check.rank}", reason,
                                                    unknown)
                _settle(store, row, check.ok, reason, dry_run, would_mark)
            bad += not check.ok
            table.append((check.step, check.rank, check.level,
                          "ok" if check.ok else "CORRUPTED", reason))
        if rebuild:
            store.audit("rebuild", {"checkpoints": len(table), "corrupted": bad})
    finally:
        validator.close()
        store.close()
    _table(table, ("step", "rank", "level", "result", "detail"), out)
    debris = run.unfinished()
    if debris:
        print(f"{len(debris)} unfinished save(s) left by killed writers: {', '.join(debris)} "
              "(the next restore() removes them)", file=out)
    if unknown:
        print(f"{len(unknown)} checkpoint(s) name a continuation their lineage record does "
              f"not know; restore() refuses to guess: {unknown[0]}", file=out)
    print(f"{len(table) - bad} ok, {bad} corrupted", file=out)
    if dry_run:
        print(f"dry run: would mark {would_mark[Status.CORRUPTED]} row(s) corrupted and "
              f"{would_mark[Status.VALID]} pending row(s) valid; nothing changed", file=out)
    return 1 if bad else 0


def _expire_abandoned(store: MetadataStore, row: CheckpointRow, run: Run,
                      lineages: dict[int, Lineage], branch: object, name: str, reason: str,
                      unknown: list[str]) -> tuple[CheckpointRow, str]:
    """A rebuilt row of a checkpoint saved on a continuation a restore abandoned (its rank's
    lineage record says so) is expired, as the lost database had it; one saved on a
    continuation the record does not know is noted in ``unknown`` and kept. A rank with no
    record in ``lineages`` has none on disk (all were read before the rebuild began)."""
    lineage = lineages.get(row.rank) or Lineage(lineage_path(run.dir, row.rank), ())
    try:
        why = lineage.why_abandoned(branch, row.step)
    except UnknownContinuationError as e:
        unknown.append(f"{name}: {e}")
        return row, reason
    if why is None:
        return row, reason
    return (Moves(store).expire_rebuilt(row.key, f"abandoned: {why}"),
            f"{reason}; abandoned, row expired: {why}")


def _settle(store: MetadataStore, row: CheckpointRow | None, ok: bool, reason: str,
            dry_run: bool, would_mark: dict[Status, int]) -> None:
    """A verified checkpoint's pending row becomes valid, a failed one's live row corrupted
    (counted instead on a dry run)."""
    if row is None:
        return
    target = None
    if ok and row.status is Status.PENDING:
        target = Status.VALID
    elif not ok and row.status in (Status.VALID, Status.PENDING):
        target = Status.CORRUPTED
    if target is not None and dry_run:
        would_mark[target] += 1
    elif target is Status.VALID:
        Moves(store).publish(row.key)
    elif target is Status.CORRUPTED:
        Moves(store).condemn(row.key, f"validate: {reason}")


def _row_from_manifest(store: MetadataStore, run: Run, manifest: dict[str, object],
                       name: str) -> CheckpointRow:
    return store.add_pending(
        run_id=run.run_id, step=int(manifest["step"]),  # type: ignore[call-overload]
        rank=int(manifest["rank"]),  # type: ignore[call-overload]
        level=str(manifest["level"]), tier=Tier.REMOTE, location=run.remote.path(name),
        sha256=str(manifest["self_sha256"]),
        retention_class=str(manifest.get("retention_class", "routine")),
        score=manifest.get("score"),  # type: ignore[arg-type]
        bytes_raw=manifest.get("state_bytes"),  # type: ignore[arg-type]
        bytes_encoded=sum(int(f["bytes"]) for f in manifest["files"].values()),  # type: ignore[attr-defined]
        codec="raw", reason=f"rebuilt from {name}/manifest.json")
