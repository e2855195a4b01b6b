"""The organ archive: a self-contained, pickle-free checkpoint directory on the remote tier.

Layout of ``step_{step:08d}_rank_{rank:05d}/``:

- ``tensors.safetensors`` — every tensor of the snapshot, in the safetensors format (written
  here by a streaming writer so that no second copy of the state is built in memory; read back
  with the ``safetensors`` library, which cannot execute code); or, for an archive whose
  tensors go through the codecs (pulses), ``tensors.ckpt``: the codec container
  (``ckptpilot.codecs.container``) with every tensor encoded on its own and no reference to any
  other checkpoint — a passive store cannot fold deltas, so a pulse here is self-contained;
- ``state.json`` — everything else (optimizer structure, schedulers, RNG, data cursor, extras);
- ``manifest.json`` — format name and version, step/rank/level, per-file size and SHA256 of
  every chunk (``ckptpilot.format.digest``), and a digest of the manifest itself (its keys
  and bytes: ``ckptpilot.format.manifest``). Written last: a directory without a valid
  manifest is an incomplete checkpoint and is never loaded.

This module owns the layout and its verification; durability and atomic publication belong to
the tier, the choice of which checkpoint to load to the pilot.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptpilot.capture.state import Snapshot
from ckptpilot.codecs.container import (
    CodecFor,
    ContainerIndex,
    read_container,
    read_index,
    write_container,
)
from ckptpilot.errors import CheckpointFormatError, IntegrityError
from ckptpilot.format.manifest import (
    MANIFEST_FORMAT,
    build_manifest,
    decode_manifest,
    encode_manifest,
)
from ckptpilot.format.safetensors_header import MAX_HEADER_BYTES, check_safetensors_header
from ckptpilot.tiers.remote.directio import ALIGN as DATA_ALIGN
from ckptpilot.tiers.remote.entries import REMOVING_MARK, refuse_links
from ckptpilot.tiers.remote.store import COMMIT_FILE, STAGING_MARK, RemoteTier

TENSORS_FILE = "tensors.safetensors"
CONTAINER_FILE = "tensors.ckpt"
STATE_FILE = "state.json"
MANIFEST_FILE = COMMIT_FILE
_CHUNK_BYTES = 64 << 20
_NAME_RE = re.compile(r"^step_(\d{8,})_rank_(\d{5,})$")

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def checkpoint_name(step: int, rank: int) -> str:
    """Names use the global step and rank, never wall-clock time (SPEC §4)."""
    return f"step_{step:08d}_rank_{rank:05d}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    m = _NAME_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class WrittenArchive:
    name: str
    location: str
    bytes: int
    manifest: dict[str, Any]


@dataclass(frozen=True)
class LoadedArchive:
    name: str
    location: str
    manifest: dict[str, Any]
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.location}: state refers to tensor {key!r}, absent from its "
                "tensors file") from None


_TORCH_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def parse_safetensors(buf: bytearray | np.ndarray, where: str) -> dict[str, torch.Tensor]:
    """Tensors as views of ``buf`` (no copy): a safetensors file already read into memory."""
    if len(buf) < 8:
        raise CheckpointFormatError(f"{where}: shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", buf)
    if n > MAX_HEADER_BYTES or 8 + n > len(buf):
        raise CheckpointFormatError(f"{where}: header claims {n} bytes, file has {len(buf)}")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, an int too long
        raise CheckpointFormatError(f"{where}: header is not valid JSON ({e})") from e
    check_safetensors_header(header, len(buf) - 8 - n, where)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        if end == begin:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=8 + n + begin)
        tensors[name] = flat.view(dtype).reshape(info["shape"])
    return tensors


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _safetensors_chunks(tensors: Mapping[str, torch.Tensor]) -> Iterator[memoryview | bytes]:
    """Yield a safetensors file piece by piece, straight from the tensors' own memory.

    The header is padded so that the data starts at a multiple of :data:`DATA_ALIGN` (format
    version 4): a snapshot's arena is laid out in this very order, so from a page-aligned
    arena every byte's address is congruent with its file offset, and the durable write
    sends the tensors to the disk from where they are."""
    header: dict[str, Any] = {"__metadata__": {"format": MANIFEST_FORMAT}}
    # Widest elements first: every tensor then starts at a multiple of its element size,
    # so a reader can view the bytes in place without unaligned access.
    ordered = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    offset = 0
    for name, t in ordered:
        dtype = _SAFETENSORS_DTYPES.get(t.dtype)
        if dtype is None:
            raise CheckpointFormatError(f"{name}: dtype {t.dtype} cannot be stored")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise CheckpointFormatError(f"{name}: snapshot tensors must be contiguous CPU")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
    yield struct.pack("<Q", len(raw)) + raw
    for _, t in ordered:
        view = _byte_view(t)
        for start in range(0, len(view), _CHUNK_BYTES):
            yield view[start:start + _CHUNK_BYTES]


def _tensors_digest(index: ContainerIndex) -> str:
    """SHA256 over the container index's per-tensor SHA256s (names, order) and its meta's."""
    h = hashlib.sha256()
    for entry in index.tensors:
        h.update(f"{entry.name}\0{entry.sha256}\n".encode())
    h.update(index.meta_sha256.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class StagedArchive:
    """A complete archive in its staging directory: written and fsynced, not yet visible.
    ``commit``: the encoded manifest still to be written by :func:`publish_organ` (an object
    store, where writing it is the publication); None when it is in the staging directory."""

    name: str
    staging: str
    bytes: int
    manifest: dict[str, Any]
    index: ContainerIndex | None = None  # what the codecs made of each tensor (containers)
    commit: bytes | None = None


def publish_organ(tier: RemoteTier, staged: StagedArchive) -> None:
    """Make a staged archive a checkpoint: the rename of its staging directory, or on an
    object store the write of its manifest (see ``tiers.remote.store``)."""
    if staged.commit is None:
        tier.publish(staged.staging, staged.name)
    else:
        tier.write_file(f"{staged.name}/{MANIFEST_FILE}", [staged.commit])


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (how layouts are compared, whatever the file kind)."""
    name = _SAFETENSORS_DTYPES.get(dtype)
    if name is None:
        raise CheckpointFormatError(f"dtype {dtype} cannot be stored")
    return name


def model_layout(snapshot: Snapshot) -> dict[str, tuple[str, list[int]]]:
    """Names, safetensors dtypes and shapes of the model tensors: what a load test expects."""
    return {k: (_SAFETENSORS_DTYPES[t.dtype], list(t.shape))
            for k, t in snapshot.tensors.items() if k.startswith("model/")}


def write_organ(tier: RemoteTier, snapshot: Snapshot, *, level: str = "organ",
                reason: str = "") -> WrittenArchive:
    """Write ``snapshot`` as a complete archive and publish it atomically (no validation)."""
    staged = stage_organ(tier, snapshot, level=level, reason=reason)
    publish_organ(tier, staged)
    return WrittenArchive(name=staged.name, location=tier.path(staged.name), bytes=staged.bytes,
                          manifest=staged.manifest)


def stage_organ(tier: RemoteTier, snapshot: Snapshot, *, level: str = "organ",
                reason: str = "", retention_class: str = "routine",
                score: float | None = None, codec_for: CodecFor | None = None,
                created_unix: float | None = None, fsync: bool = True) -> StagedArchive:
    """Write ``snapshot`` into a fresh staging directory, manifest last (on an object store
    the manifest is left for the publication); publish separately, after validation, with
    :func:`publish_organ`.

    With ``codec_for`` the tensors go into a codec container (``tensors.ckpt``), each encoded
    by the codec it names (encoding overlaps writing); without, into ``tensors.safetensors``.
    ``created_unix`` stamps the manifest (default: the clock); a given one makes the archive's
    bytes a function of its inputs, which is how the golden files pin them. ``fsync=False``
    leaves the files in the page cache (a pulse: ``levels.pulse.fsync``).
    """
    meta = snapshot.meta
    name = checkpoint_name(snapshot.step, meta["rank"])
    staging = tier.new_staging(name)
    files: dict[str, dict[str, Any]] = {}
    index = None
    if codec_for is None:
        files[TENSORS_FILE] = tier.write_record(f"{staging}/{TENSORS_FILE}",
                                                _safetensors_chunks(snapshot.tensors),
                                                fsync=fsync)
    else:
        with tier.open_write(f"{staging}/{CONTAINER_FILE}", chunked=True, fsync=fsync) as out:
            index = write_container(out, snapshot.tensors, {"step": snapshot.step}, codec_for)
        files[CONTAINER_FILE] = {**out.record, "tensors_digest": _tensors_digest(index)}
    state_raw = json.dumps(meta, separators=(",", ":")).encode()
    files[STATE_FILE] = tier.write_record(f"{staging}/{STATE_FILE}", [state_raw], fsync=fsync)
    manifest = build_manifest(
        name=name, step=snapshot.step, rank=meta["rank"], world_size=meta["world_size"],
        epoch=meta.get("epoch"), level=level, reason=reason, retention_class=retention_class,
        score=score, created_unix=time.time() if created_unix is None else created_unix,
        state_bytes=snapshot.nbytes, files=files, branch=meta.get("branch"))
    commit: bytes | None = encode_manifest(manifest)
    if tier.renames:
        tier.write_file(f"{staging}/{MANIFEST_FILE}", [commit])
        commit = None
    total = sum(f["bytes"] for f in files.values())
    return StagedArchive(name=name, staging=staging, bytes=total, manifest=manifest, index=index,
                         commit=commit)


def read_manifest(tier: RemoteTier, name: str) -> dict[str, Any]:
    """The archive's manifest, checked for format, version and its own digest; an archive
    that is a link or holds one is refused (``tiers.remote.entries.refuse_links``)."""
    refuse_links(tier, name)
    where = tier.path(name, MANIFEST_FILE)
    if not tier.exists(f"{name}/{MANIFEST_FILE}"):
        raise CheckpointFormatError(f"{where}: missing (the writer did not finish)")
    manifest = decode_manifest(tier.read_bytes(f"{name}/{MANIFEST_FILE}"), where)
    _check_identity(manifest, name, where)
    return manifest


def _check_identity(manifest: Mapping[str, Any], name: str, where: str) -> None:
    """A directory is not trusted by its name: a complete, self-consistent archive of step 18
    copied to ``step_00000024_rank_00000`` must not restore as step 24. Staging and set-aside
    directories carry the checkpoint's name before the first dot."""
    base = name.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    parsed = parse_checkpoint_name(base)
    if parsed is None:
        return
    held = (manifest.get("name"), manifest.get("step"), manifest.get("rank"))
    if held != (base, *parsed):
        raise CheckpointFormatError(
            f"{where}: holds {held[0]!r} (step {held[1]!r}, rank {held[2]!r}), not {base} "
            "(a checkpoint copied or renamed under another step's name)")


def _check_file(tier: RemoteTier, name: str, fname: str, rec: Mapping[str, Any]) -> str:
    rel = f"{name}/{fname}"
    if not tier.exists(rel):
        raise CheckpointFormatError(f"{tier.path(rel)}: missing")
    size = tier.size(rel)
    if size != rec["bytes"]:
        raise CheckpointFormatError(
            f"{tier.path(rel)}: {size} bytes, manifest says {rec['bytes']} (truncated?)")
    return rel


def check_sizes(tier: RemoteTier, name: str, manifest: Mapping[str, Any]) -> None:
    """Every file of the archive exists with the size its manifest says (nothing read)."""
    for fname, rec in manifest["files"].items():
        _check_file(tier, name, fname, rec)


def verify_organ(tier: RemoteTier, name: str,
                 manifest: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """Re-hash every file of the archive against its manifest (streaming, nothing kept);
    ``manifest``: the one staged with it, for an archive whose manifest is not written yet."""
    if manifest is None:
        manifest = read_manifest(tier, name)
    for fname, rec in manifest["files"].items():
        tier.verify(_check_file(tier, name, fname, rec), rec)
    return manifest


def _read_verified(tier: RemoteTier, name: str, fname: str, rec: Mapping[str, Any]
                   ) -> np.ndarray:
    """The file's bytes, read once and checked against the manifest's size and digests."""
    return tier.read_verified(_check_file(tier, name, fname, rec), rec)


def read_organ(tier: RemoteTier, name: str, *, manifest_sha256: str | None = None
               ) -> LoadedArchive:
    """Verify and load an archive; raises ``CheckpointFormatError`` instead of half-loading.

    ``manifest_sha256``: the manifest digest the metadata store recorded when this checkpoint
    was written; another archive in its place (an older copy, another run's) is refused.

    Each file is read exactly once into memory the returned tensors own: nothing stays mapped
    to the file, so a later change or removal of the file cannot reach the restored state. A
    container is checked as it is decoded (blob checksums, the SHA256 of every decoded tensor)
    rather than by a second pass over the file.
    """
    manifest = read_manifest(tier, name)
    location = tier.path(name)
    if manifest_sha256 is not None and manifest["self_sha256"] != manifest_sha256:
        raise IntegrityError(f"{tier.path(name, MANIFEST_FILE)} (not the archive the metadata "
                             "recorded for this step)", manifest_sha256,
                             manifest["self_sha256"])
    files = manifest["files"]
    if STATE_FILE not in files or not (TENSORS_FILE in files or CONTAINER_FILE in files):
        raise CheckpointFormatError(
            f"{location}: manifest lists no {STATE_FILE} or no tensors file")
    if CONTAINER_FILE in files:
        rel = _check_file(tier, name, CONTAINER_FILE, files[CONTAINER_FILE])
        where = tier.path(rel)
        with tier.open_read(rel) as f:
            try:
                # The file is not hashed again here: its blobs' checksums and every tensor's
                # SHA256 are checked while decoding, and this digest of those SHA256s ties the
                # container to the manifest (a container swapped in from elsewhere fails).
                digest = _tensors_digest(read_index(f))
                if digest != files[CONTAINER_FILE].get("tensors_digest"):
                    raise IntegrityError(where, str(files[CONTAINER_FILE].get("tensors_digest")),
                                         digest)
                tensors, _ = read_container(f)
            except CheckpointFormatError as e:
                raise CheckpointFormatError(f"{where}: {e}") from e
            except ValueError as e:
                raise CheckpointFormatError(f"{where}: cannot decode: {e}") from e
    else:
        tensors = parse_safetensors(
            _read_verified(tier, name, TENSORS_FILE, files[TENSORS_FILE]),
            tier.path(name, TENSORS_FILE))
    raw = bytes(_read_verified(tier, name, STATE_FILE, files[STATE_FILE]))
    try:  # IntegrityError is a ValueError too: the read stays outside
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, an int too long
        raise CheckpointFormatError(f"{tier.path(name, STATE_FILE)}: not valid JSON") from e
    if not isinstance(meta, dict):
        raise CheckpointFormatError(f"{tier.path(name, STATE_FILE)}: a JSON "
                                    f"{type(meta).__name__}, not an object")
    if meta.get("step") != manifest["step"]:
        raise CheckpointFormatError(
            f"{location}: state is of step {meta.get('step')}, manifest of {manifest['step']}")
    return LoadedArchive(name=name, location=location, manifest=manifest, meta=meta,
                         tensors=tensors)


@dataclass(frozen=True)
class ArchiveListing:
    """What the tier holds for one rank: published archives (newest first) and staging debris."""

    published: list[tuple[int, str]]
    staging: list[str]


def list_archives(tier: RemoteTier, rank: int) -> ArchiveListing:
    """``staging`` also lists what a removal cut short left (``*.removing-*``): debris too."""
    published: list[tuple[int, str]] = []
    staging: list[str] = []
    for entry in tier.list():
        if STAGING_MARK in entry or REMOVING_MARK in entry:
            parsed = parse_checkpoint_name(entry.split(".", 1)[0])
            if parsed is not None and parsed[1] == rank:
                staging.append(entry)
            continue
        parsed = parse_checkpoint_name(entry)
        if parsed is not None and parsed[1] == rank:
            if tier.committed(entry):
                published.append((parsed[0], entry))
            else:  # an object store's save that never wrote its manifest
                staging.append(entry)
    published.sort(reverse=True)
    return ArchiveListing(published=published, staging=staging)
