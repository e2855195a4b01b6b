"""DCP checkpoints on the remote tier: list, read and verify them, and settle their rows.

Shared by the writer and reader of :mod:`ckptpilot.dcp` and by ``ckptpilot.cli.ops`` (``ls``,
``validate``, ``prune``, ``recover``). Owns how a DCP checkpoint's bytes are checked against
its commit file and how its per-rank rows relate to its one directory (every rank's row
points at the same directory). Formats belong to ``dcp.format``; durability and publication
to the tier; which checkpoint to load to the reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptpilot.catalog import Catalog
from ckptpilot.dcp.format import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    Encoding,
    ItemRecord,
    decode_manifest,
    item_digest,
    manifest_items,
    parse_dcp_name,
)
from ckptpilot.errors import CheckpointFormatError, IntegrityError, PolicyError
from ckptpilot.policy import Policy, load_policy
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.tiers.remote.entries import refuse_links
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Status, Tier

__all__ = [
    "PartCheck",
    "check_published",
    "entry_of",
    "is_dcp_entry",
    "list_dcp",
    "read_item",
    "read_manifest",
    "remote_of",
    "resolve_policy",
    "retire_step",
    "rows_of",
    "verify_dcp",
    "verify_parts",
]


_READ_CHUNK = 16 << 20


def resolve_policy(target: Policy | str | os.PathLike[str]) -> Policy:
    """A policy as given, or the default policy of the run directory ``target``."""
    if isinstance(target, Policy):
        return target
    return load_policy(None, run_dir=target)


def remote_of(policy: Policy) -> RemoteTier:
    remote = RemoteTier(policy.tiers.remote.url, policy.tiers.remote.storage_options,
                        retries=policy.tiers.remote.retries)
    if not remote.durable:
        raise PolicyError("tiers.remote.url", f"{remote.url} does not outlive this process, "
                          "so it cannot hold recovery points; use a directory or an object "
                          "store (file://, s3://, gs://)")
    return remote


def entry_of(location: str) -> str:
    """The directory name a row's location ends in."""
    return location.rstrip("/").rsplit("/", 1)[-1]


def list_dcp(tier: RemoteTier) -> list[tuple[int, str]]:
    """(step, name) of every published DCP checkpoint, oldest first."""
    found = []
    for name in tier.list():
        step = parse_dcp_name(name)
        if step is not None and tier.committed(name):
            found.append((step, name))
    return sorted(found)


def is_dcp_entry(name: str) -> bool:
    """A DCP checkpoint's directory, or its staging or set-aside copy."""
    return parse_dcp_name(name.split(".", 1)[0]) is not None


def read_manifest(tier: RemoteTier, name: str) -> dict[str, Any]:
    """The checkpoint's commit file, checked (format, digest, and that it is the checkpoint
    its directory's name says: a copy of step 18 under step 24's name is refused; so is a
    directory that is a link or holds one)."""
    refuse_links(tier, name)
    where = tier.path(name, MANIFEST_FILE)
    if not tier.exists(f"{name}/{MANIFEST_FILE}"):
        raise CheckpointFormatError(f"{where}: missing (the save did not finish)")
    manifest = decode_manifest(tier.read_bytes(f"{name}/{MANIFEST_FILE}"), where)
    base = name.split(".", 1)[0]
    if manifest.get("name") != base or parse_dcp_name(base) != manifest.get("step"):
        raise CheckpointFormatError(
            f"{where}: holds {manifest.get('name')!r} (step {manifest.get('step')!r}), not "
            f"{base} (a checkpoint copied or renamed under another step's name)")
    return manifest


def read_item(f: Any, rec: ItemRecord, index: MetadataIndex, location: str) -> bytearray:
    """One item's bytes from the open file ``f``, checked against its SHA256: exactly the
    bytes a read uses are the bytes verified, whichever part of the tensor it wants."""
    where = rec.where(index, location)
    buf = bytearray(rec.nbytes)
    view = memoryview(buf)
    f.seek(rec.at)
    got = 0
    while got < rec.nbytes:
        n = f.readinto(view[got:got + _READ_CHUNK])
        if not n:
            raise CheckpointFormatError(f"{where}: read {got} of {rec.nbytes} bytes "
                                        "(truncated?)")
        got += n
    actual = item_digest(buf)
    if actual != rec.sha256:
        raise IntegrityError(where, rec.sha256, actual)
    return buf


def verify_parts(location: str, manifest: Mapping[str, Any], ranks: Mapping[int, str]) -> None:
    """Check the {rank: part SHA256} the metadata rows recorded against the commit file:
    another checkpoint put under this name (an older copy, another run's) fails."""
    parts = manifest.get("parts", {})
    for rank, digest in sorted(ranks.items()):
        if parts.get(str(rank)) != digest:
            raise IntegrityError(f"{location}: rank {rank}'s part (not the checkpoint the "
                                 "metadata recorded for this step)", digest,
                                 str(parts.get(str(rank))))


def verify_dcp(tier: RemoteTier, name: str, manifest: Mapping[str, Any] | None = None,
               *, ranks: Mapping[int, str] | None = None) -> Mapping[str, Any]:
    """Re-hash every item of the checkpoint (every byte of its data files) and its
    ``.metadata``; raises ``CheckpointFormatError`` naming the file and item at fault.
    ``ranks``: {rank: part SHA256} that the metadata rows recorded, checked against the
    commit file (another checkpoint under this name fails)."""
    if manifest is None:
        manifest = read_manifest(tier, name)
    location = tier.path(name)
    verify_parts(location, manifest, ranks or {})
    items = manifest_items(manifest, location)
    by_file: dict[str, list[tuple[MetadataIndex, ItemRecord]]] = {}
    for index, rec in items.items():
        by_file.setdefault(rec.file, []).append((index, rec))
    for fname, entries in sorted(by_file.items()):
        size = sum(rec.nbytes for _, rec in entries)
        rel = f"{name}/{fname}"
        if not tier.exists(rel):
            raise CheckpointFormatError(f"{tier.path(rel)}: missing")
        if tier.size(rel) != size:
            raise CheckpointFormatError(f"{tier.path(rel)}: {tier.size(rel)} bytes, the "
                                        f"manifest's items cover {size} (truncated?)")
        with tier.open_read(rel) as f:
            for index, rec in entries:
                read_item(f, rec, index, location)
    meta = manifest.get("metadata_file")
    if meta is not None:
        rel = f"{name}/{DCP_METADATA_FILE}"
        if not tier.exists(rel):
            raise CheckpointFormatError(f"{tier.path(rel)}: missing")
        size, sha = tier.digest(rel)
        if (size, sha) != (meta["bytes"], meta["sha256"]):
            raise IntegrityError(tier.path(rel), meta["sha256"], sha)
    return manifest


def rows_of(store: MetadataStore, run_id: str, step: int, name: str) -> list[CheckpointRow]:
    """The remote rows of every rank that point at the DCP checkpoint ``name`` of ``step``."""
    return [row for row in store.rows(run_id, tier=Tier.REMOTE)
            if row.step == step and entry_of(row.location) == name]


def retire_step(store: MetadataStore, run_id: str, run_dir: Path, tier: RemoteTier,
                step: int) -> None:
    """Before ``step`` is saved again (a run resumed from an earlier step): every live row of
    that step, on any rank, whatever its layout (an archive, a DCP directory, a killed
    save's staging directory), stops counting, and its bytes are set aside rather than
    overwritten (``Catalog.retire``). A directory shared by several rows moves once."""
    moved: dict[str, str | None] = {}

    def set_aside(entry: str) -> Callable[[], str | None]:
        def move() -> str | None:
            if entry not in moved:
                moved[entry] = (tier.path(tier.set_aside(entry, "superseded"))
                                if tier.exists(entry) else None)
            return moved[entry]
        return move

    for row in store.rows(run_id, tier=Tier.REMOTE):
        if row.step == step and row.status in (Status.PENDING, Status.VALID):
            catalog = Catalog(store, run_id, row.rank, run_dir)
            catalog.retire(row.key, set_aside(entry_of(row.location)))


@dataclass(frozen=True)
class PartCheck:
    """The verdict on one rank's part of a published DCP checkpoint (``ckptpilot validate``):
    a checkpoint is verified as a whole, so every rank of one gets the same verdict.
    ``branch``: the continuation the rank saved its part on, as its commit file says ("" the
    run's first, also for a commit file from before ``branches``; None when the commit file
    cannot be read), which tells a rebuild whether a restore abandoned the part."""

    step: int
    rank: int
    name: str
    level: str
    ok: bool
    reason: str
    branch: str | None = None


def check_published(store: MetadataStore, run_id: str, tier: RemoteTier, *,
                    rebuild: bool = False) -> list[PartCheck]:
    """Verify every published DCP checkpoint of the run against its commit file and the
    rows that point at it; one verdict per rank (the ranks of its commit file, or of its
    rows when the commit file cannot be read). ``rebuild`` adds the missing rows from the
    commit file, ``pending``, for the caller to settle."""
    checks = []
    for step, name in list_dcp(tier):
        rows = rows_of(store, run_id, step, name)
        manifest = None
        try:
            manifest = read_manifest(tier, name)
            verify_dcp(tier, name, manifest, ranks={row.rank: row.sha256 for row in rows})
            ok, reason = True, "ok (hashes only)" + _pickled_note(tier, name, manifest)
        except CheckpointFormatError as e:
            ok, reason = False, str(e)
        branches: dict[int, str | None]
        if manifest is None:
            branches = dict.fromkeys(sorted({row.rank for row in rows}))
            level = "-"
        else:
            saved_on = manifest.get("branches", {})
            branches = {rank: saved_on.get(str(rank), "")
                        for rank in range(int(manifest["world_size"]))}
            level = str(manifest["level"])
            if rebuild:
                _add_rows(store, run_id, tier, name, manifest, {row.rank for row in rows})
        checks.extend(PartCheck(step, rank, name, level, ok, reason, branch)
                      for rank, branch in branches.items())
    return checks


def _pickled_note(tier: RemoteTier, name: str, manifest: Mapping[str, Any]) -> str:
    """What a load of a version 1 checkpoint will refuse: its non-tensor items, pickles only
    (``dcp.format.pickled_refusal``); its tensors load."""
    pickled = sorted(index.fqn for index, rec in manifest_items(manifest, tier.path(name)).items()
                     if rec.encoding is Encoding.BYTES and rec.value is None)
    if not pickled:
        return ""
    return (f"; its non-tensor item(s) {', '.join(map(repr, pickled[:5]))} are pickles "
            "(DCP format version 1), which ckptpilot does not load")


def _add_rows(store: MetadataStore, run_id: str, tier: RemoteTier, name: str,
              manifest: Mapping[str, Any], present: set[int]) -> None:
    items = manifest_items(manifest, tier.path(name))
    for rank in range(int(manifest["world_size"])):
        if rank in present:
            continue
        mine = [rec for rec in items.values() if rec.rank == rank]
        store.add_pending(
            run_id=run_id, step=int(manifest["step"]), rank=rank, level=str(manifest["level"]),
            tier=Tier.REMOTE, location=tier.path(name), sha256=str(manifest["parts"][str(rank)]),
            retention_class=str(manifest["retention_class"]), score=manifest.get("score"),
            bytes_encoded=sum(rec.nbytes for rec in mine),
            codec="blob" if manifest.get("codecs") else "raw",
            reason=f"rebuilt from {name}/{MANIFEST_FILE}")
