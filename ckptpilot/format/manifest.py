"""The remote archive's manifest: the JSON file that makes an archive directory a checkpoint.

An archive (``tiers/remote/archive.py``) is complete only once its manifest is there; the manifest
names the format and its version, the checkpoint (name, step, rank), why and how it was kept
(level, reason, retention class, score), and the size and digests of every other file
(version 3: the SHA256 and the XXH3-128 of every chunk, ``format.digest``; version 2, still
read: the SHA256 of every chunk; version 1, still read: one SHA256 of the whole file), and it
carries ``self_sha256``, the SHA256 of its own other keys (``json.dumps(..., sort_keys=True)``),
so a manifest edited or damaged after writing is refused. ``branch``, present only in a
checkpoint saved after the run was restored, is the continuation it was saved on
(``storage.lineage``); an optional key, so no new version: older readers ignore it and a
manifest without it belongs to the run's first continuation. The XXH3 digests did get a new
version (the file records' keys are pinned by golden files): a ckptpilot that reads only
versions 1 and 2 refuses a version-3 checkpoint, naming the version. Version 4 changes the
safetensors file's bytes only: its header is padded with spaces (as the safetensors format
allows) so that the tensor data starts at a multiple of 4096 bytes, where a page-aligned arena
goes to the disk with ``O_DIRECT`` and no copy (``tiers/remote/directio.py``); version 3 had
the tensor data start at a multiple of 8. Reading is the same for both.
The key order and the one-space indent are part of the format: the metadata store
records ``self_sha256``, and a golden file pins the bytes.

Owns the format name and version, the manifest's keys, its bytes and their check. Must not
touch files or decide what an archive's name means: the archive module reads and writes, and
checks that a manifest belongs under its directory's name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from ckptpilot.errors import CheckpointFormatError, IntegrityError

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "build_manifest",
    "decode_manifest",
    "encode_manifest",
    "manifest_digest",
]

MANIFEST_FORMAT = "ckptpilot-organ"
MANIFEST_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """SHA256 of every key but ``self_sha256``, independent of key order."""
    body = {k: v for k, v in manifest.items() if k != "self_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def build_manifest(*, name: str, step: int, rank: int, world_size: int, epoch: int | None,
                   level: str, reason: str, retention_class: str, score: float | None,
                   created_unix: float, state_bytes: int,
                   files: Mapping[str, Mapping[str, Any]],
                   branch: str | None = None) -> dict[str, Any]:
    """A complete manifest, ``self_sha256`` included, keys in the format's order.

    ``files`` maps each file of the archive to its record (``format.digest``; a container's
    also has ``tensors_digest``). ``branch`` (None or "": the first continuation, no key)
    goes before ``files``.
    """
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "name": name,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "epoch": epoch,
        "level": level,
        "reason": reason,
        "retention_class": retention_class,
        "score": score,
        "created_unix": created_unix,
        "state_bytes": state_bytes,
    }
    if branch:
        manifest["branch"] = branch
    manifest["files"] = {fname: dict(rec) for fname, rec in files.items()}
    manifest["self_sha256"] = manifest_digest(manifest)
    return manifest


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()


def decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest in ``raw``, checked for format, version and its own digest.

    ``where`` (the manifest's path) starts every error message. A digest mismatch raises
    :class:`~ckptpilot.errors.IntegrityError`, any other fault ``CheckpointFormatError``.
    """
    return decode_self_digested(raw, where, fmt=MANIFEST_FORMAT, version=READABLE_VERSIONS,
                                digest=manifest_digest)


def decode_self_digested(raw: bytes, where: str, *, fmt: str, version: int | tuple[int, ...],
                         digest: Callable[[Mapping[str, Any]], str]) -> dict[str, Any]:
    """A JSON document that names its ``format`` and ``format_version`` and carries
    ``self_sha256`` = ``digest(document)``: every commit file of ckptpilot (this manifest, the
    DCP manifest) is checked through here."""
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, an int past the digit limit
        raise CheckpointFormatError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise CheckpointFormatError(f"{where}: not a {fmt} manifest")
    versions = (version,) if isinstance(version, int) else version
    if manifest.get("format_version") not in versions:
        raise CheckpointFormatError(
            f"{where}: format version {manifest.get('format_version')!r} is not supported "
            f"(this ckptpilot reads version {' and '.join(map(str, versions))})")
    actual = digest(manifest)
    if manifest.get("self_sha256") != actual:
        raise IntegrityError(where, str(manifest.get("self_sha256")), actual)
    return manifest
