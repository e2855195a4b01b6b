"""The entries of a remote tier: the names they may have, what one must hold to be deleted,
and the one way it is deleted (issue 28).

Every deletion under a tier's root — retention during training and ``ckptpilot prune``, the
disk budget, what ``recover`` set aside, the debris of a killed writer (the restorer, for
every tier), the delete half of a "rename" on an object store, a tier's ``discard`` —
ends in :meth:`RemoteTier.remove <ckptpilot.tiers.remote.store.RemoteTier.remove>`, which calls
:func:`remove_entry`; nothing else in the package deletes under a root (the architecture
test ``tests/test_safe_delete.py`` reads the source for it). So a wrong path in a metadata
row — tampered, damaged, or written by a bug — can reach nothing but a checkpoint.

The rule, checked before anything is touched (:func:`vet`); anything else is refused with
:class:`~ckptpilot.errors.RemovalRefusedError` naming the entry and the reason:

- The entry is one name directly under the root (``.``, ``..`` or a path never are), and the
  name has a checkpoint's form: ``step_<step>_rank_<rank>`` (an archive) or
  ``dcp_step_<step>`` (a DCP checkpoint), followed by none or more of the suffixes the tier
  appends: ``.staging-<pid>-<hex>`` (``new_staging``), ``.<why>-<hex>`` (``set_aside``, with
  a why of :data:`SET_ASIDE_WHY`) and ``.removing-<hex>`` (a removal under way, see Order).
  A row's step and rank, when the caller gives them, must be the name's. A row's location is
  reduced to its last component (:func:`location_entry`) the way every reader resolves it —
  a copied run keeps its rows' old prefix — after refusing ``.`` and ``..`` anywhere in it;
  the entry deleted is always that name under this tier's root.
- Seen without following links, it is a link (only the link is removed, never what it points
  at) or a directory without subdirectories (checkpoints are flat).
- Its ``manifest.json`` names the same checkpoint: name, step, and rank (an archive's own;
  for a DCP checkpoint, a part of that rank). Without a readable manifest (an unfinished
  save, a removal cut short, a rotted manifest) it may hold only files a writer writes
  (:data:`WRITTEN_FILES`) and no link.

Order. Locally the directory is first renamed out of its name to ``<name>.removing-<hex>``
beside it, then removed: a failed rename touches nothing (the error names the entry), and a
removal cut short leaves a name the listings take for debris (``tiers.remote.archive``'s
``list_archives``, :func:`sweep`), never a published-looking directory with files missing.
An object store has no rename and publishes by the commit file, so there the commit file
goes first (unpublished) and the data after it; a removal cut short leaves an unfinished
save, which the listings take for debris too.

Links inside a checkpoint are never followed: reading or validating one refuses it
(:func:`refuse_links`, a ``CheckpointFormatError`` naming the file), deleting one removes
the link itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ckptpilot.errors import CheckpointFormatError, RemovalRefusedError

__all__ = [
    "COMMIT_FILE",
    "REMOVING_MARK",
    "SET_ASIDE_WHY",
    "STAGING_MARK",
    "WRITTEN_FILES",
    "Entry",
    "is_debris",
    "location_entry",
    "parse_entry",
    "refuse_links",
    "remove_entry",
    "sweep",
    "vet",
]

log = logging.getLogger(__name__)

STAGING_MARK = ".staging-"
REMOVING_MARK = ".removing-"
COMMIT_FILE = "manifest.json"
SET_ASIDE_WHY = re.compile(r"^(?:replaced|superseded|corrupted|abandoned-by-recover-\d+)$")
"""The reasons ``RemoteTier.set_aside`` accepts: each makes a name this module recognises."""
WRITTEN_FILES = re.compile(
    r"^(?:tensors\.safetensors|tensors\.ckpt|state\.json|manifest\.json|\.metadata"
    r"|__\d+_\d+\.distcp)$")
"""The files the archive and DCP writers put in a checkpoint's directory."""

_HEX = r"[0-9a-f]{8}"
_SUFFIX = (rf"(?:\.staging-\d+-{_HEX}|\.removing-{_HEX}"
           rf"|\.(?:replaced|superseded|corrupted|abandoned-by-recover-\d+)-{_HEX})")
_ENTRY_RE = re.compile(
    rf"^(?:step_(?P<step>\d{{8,}})_rank_(?P<rank>\d{{5,}})|dcp_step_(?P<dcp>\d{{8,}}))"
    rf"(?P<suffixes>{_SUFFIX}*)$")
_LAST_SUFFIX_RE = re.compile(rf"{_SUFFIX}$")


class _Tier(Protocol):
    """What this module needs of ``RemoteTier`` (which imports this module)."""

    fs: Any
    root: str
    is_local: bool

    def path(self, *parts: str) -> str: ...


@dataclass(frozen=True)
class Entry:
    """A parsed entry name. ``rank`` is None for a DCP checkpoint (one directory holds every
    rank's part); ``published``: the bare name, no suffix; ``debris``: a staging directory
    or a removal cut short (its last suffix)."""

    name: str
    base: str
    step: int
    rank: int | None
    published: bool
    debris: bool
    removing: bool


def parse_entry(name: str) -> Entry | None:
    """The entry ``name`` names, or None when it is no name the writers and the tier make."""
    m = _ENTRY_RE.match(name)
    if m is None:
        return None
    suffixes = m.group("suffixes")
    last = _LAST_SUFFIX_RE.search(name) if suffixes else None
    last_text = last.group(0) if last else ""
    dcp = m.group("dcp")
    return Entry(
        name=name, base=name[:len(name) - len(suffixes)],
        step=int(dcp if dcp is not None else m.group("step")),
        rank=None if dcp is not None else int(m.group("rank")),
        published=not suffixes,
        debris=last_text.startswith((STAGING_MARK, REMOVING_MARK)),
        removing=last_text.startswith(REMOVING_MARK))


def is_debris(name: str) -> bool:
    """Whether ``name`` is a staging directory or what a removal cut short left."""
    entry = parse_entry(name)
    return entry is not None and entry.debris


def location_entry(location: str) -> str:
    """The entry name a row's location ends in; refuses a location with a ``.`` or ``..``
    component (``<run>/checkpoints/..`` names the run directory, not a checkpoint)."""
    path = location.split("://", 1)[-1].rstrip("/")
    parts = path.split("/")
    if any(part in (".", "..") for part in parts):
        raise RemovalRefusedError(
            f"{location}: has a '.' or '..' component; a checkpoint's location is a "
            "directory directly under the tier's root")
    return parts[-1]


def _refuse(where: str, why: str) -> RemovalRefusedError:
    return RemovalRefusedError(f"{where}: {why}")


def vet(tier: _Tier, name: str, *, step: int | None = None,
        rank: int | None = None) -> Entry:
    """Check that the entry ``name`` may be removed (the module docstring's rule) and return
    it parsed; raises ``RemovalRefusedError``, or ``FileNotFoundError`` when it is not there.
    ``step`` and ``rank``: the checkpoint the caller means (a metadata row's)."""
    where = tier.path(name)
    entry = parse_entry(name) if "/" not in name else None
    if entry is None:
        raise _refuse(where, f"{name!r} is not a checkpoint's name (step_<step>_rank_<rank> "
                      "or dcp_step_<step>, with a staging or set-aside suffix)")
    if (step is not None and entry.step != step) or (
            rank is not None and entry.rank is not None and entry.rank != rank):
        raise _refuse(where, f"the name is of step {entry.step}"
                      f"{'' if entry.rank is None else f', rank {entry.rank}'}, not of "
                      f"step {step}, rank {rank}")
    if tier.is_local:
        _vet_local(where, entry, rank)
    else:
        _vet_object_store(tier, where, entry, rank)
    return entry


def _vet_local(where: str, entry: Entry, rank: int | None) -> None:
    mode = os.lstat(where).st_mode
    if stat.S_ISLNK(mode):
        return
    if not stat.S_ISDIR(mode):
        raise _refuse(where, "is a file, not a checkpoint's directory")
    files, links = [], []
    with os.scandir(where) as listing:
        for item in listing:
            if item.is_symlink():
                links.append(item.name)
            elif item.is_dir(follow_symlinks=False):
                raise _refuse(where, f"holds a directory {item.name!r}; a checkpoint's "
                              "directory has none")
            else:
                files.append(item.name)
    manifest = None
    if COMMIT_FILE in files:
        fd = os.open(os.path.join(where, COMMIT_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            manifest = _decode(f.read())
    _check_contents(where, entry, rank, manifest, files, links)


def _vet_object_store(tier: _Tier, where: str, entry: Entry, rank: int | None) -> None:
    found = [str(f) for f in tier.fs.find(where)]
    if not found and not tier.fs.exists(where):
        raise FileNotFoundError(where)
    files = [f[len(where.rstrip("/")) + 1:] for f in found]
    nested = [f for f in files if "/" in f]
    if nested:
        raise _refuse(where, f"holds {nested[0]!r}; a checkpoint's directory is flat")
    manifest = None
    if COMMIT_FILE in files:
        manifest = _decode(bytes(tier.fs.cat_file(f"{where}/{COMMIT_FILE}")))
    _check_contents(where, entry, rank, manifest, files, [])


def _decode(raw: bytes) -> Mapping[str, Any] | None:
    """The manifest's fields, or None when the file is no JSON object (rotted, cut short)."""
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _check_contents(where: str, entry: Entry, rank: int | None,
                    manifest: Mapping[str, Any] | None, files: list[str],
                    links: list[str]) -> None:
    if manifest is not None:
        held = (manifest.get("name"), manifest.get("step"))
        mismatch = held != (entry.base, entry.step) or (
            entry.rank is not None and manifest.get("rank") != entry.rank)
        if mismatch:
            raise _refuse(where, f"its {COMMIT_FILE} names {held[0]!r} (step {held[1]!r}, "
                          f"rank {manifest.get('rank')!r}), not {entry.base}")
        parts = manifest.get("parts")
        if entry.rank is None and rank is not None and (
                not isinstance(parts, dict) or str(rank) not in parts):
            raise _refuse(where, f"its {COMMIT_FILE} has no part of rank {rank}")
        return
    if links:
        raise _refuse(where, f"holds a link {links[0]!r} and no readable {COMMIT_FILE}")
    strangers = [f for f in files if not WRITTEN_FILES.match(f)]
    if strangers:
        raise _refuse(where, f"holds {strangers[0]!r}, which no checkpoint writer writes, "
                      f"and no readable {COMMIT_FILE}")


def remove_entry(tier: _Tier, name: str, *, step: int | None = None,
                 rank: int | None = None) -> None:
    """Remove the entry ``name`` after :func:`vet` (same arguments and errors), in the
    module docstring's order. An ``OSError`` of the removal names the entry and says what
    is left."""
    entry = vet(tier, name, step=step, rank=rank)
    where = tier.path(name)
    if not tier.is_local:
        commit = f"{where}/{COMMIT_FILE}"
        if tier.fs.exists(commit):  # unpublish first: never a checkpoint with files missing
            tier.fs.rm(commit)
            if not tier.fs.exists(where):  # the commit file was its only file
                return
        tier.fs.rm(where, recursive=True)
        return
    if stat.S_ISLNK(os.lstat(where).st_mode):
        os.unlink(where)  # the link, never what it points at
        return
    trash = where
    if not entry.removing:
        trash = tier.path(f"{name}{REMOVING_MARK}{uuid.uuid4().hex[:8]}")
        try:
            os.rename(where, trash)
        except OSError as e:
            raise OSError(e.errno, f"cannot remove {where}: moving it out of its name "
                          f"failed ({e.strerror}); nothing was removed") from e
        fsync_dir(tier.root)
    try:
        shutil.rmtree(trash)
    except OSError as e:
        raise OSError(e.errno, f"{where}: moved to {trash}, then removing it failed "
                      f"({e.strerror}: {e.filename}); the next prune or restore removes "
                      "what is left") from e


def sweep(tier: _Tier, names: list[str]) -> tuple[list[str], list[str]]:
    """Remove what removals cut short left among ``names`` (a listing of the root): returns
    (removed, each failure as one line); a failure is retried by the next sweep."""
    removed, failed = [], []
    for name in names:
        entry = parse_entry(name)
        if entry is None or not entry.removing:
            continue
        try:
            remove_entry(tier, name)
        except FileNotFoundError:
            continue
        except OSError as e:
            failed.append(str(e))
            continue
        removed.append(name)
    return removed, failed


def refuse_links(tier: _Tier, name: str) -> None:
    """Raise ``CheckpointFormatError`` naming the link when the checkpoint ``name`` is a
    link or holds one: a checkpoint is read from its own files only, so a link to a file
    elsewhere (another run's, a device) never passes for its bytes. Nothing to check on an
    object store (no links) or for an entry that is not there (its reader says so)."""
    if not tier.is_local:
        return
    where = tier.path(name)
    try:
        mode = os.lstat(where).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise CheckpointFormatError(f"{where}: a symbolic link (to {os.readlink(where)}); a "
                                    "checkpoint is never read through a link")
    if not stat.S_ISDIR(mode):
        return
    with os.scandir(where) as listing:
        for item in sorted(listing, key=lambda i: i.name):
            if item.is_symlink():
                raise CheckpointFormatError(
                    f"{item.path}: a symbolic link (to {os.readlink(item.path)}); a "
                    "checkpoint is never read through a link")


def fsync_dir(path: str) -> None:
    """Make a rename or an unlink in ``path`` durable (the directory's own entry list)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
