"""The bytes of a DCP checkpoint written by ckptpilot: its directory name, its commit file and
the encoding of each item.

Owns, and keeps pure (no I/O):

- the directory name ``dcp_step_{step:08d}`` — one directory per step holding every rank's
  part, as DCP requires; it never parses as a per-rank archive name (``tiers.remote.archive``), so
  the pilot's listings and ``restore()`` do not mistake one for the other;
- the commit file ``manifest.json`` (format ``ckptpilot-dcp``, version 2; version 1 still
  read): DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` as JSON, so that
  :class:`~ckptpilot.dcp.Reader` never unpickles DCP's ``.metadata``; every item's file, byte
  range, encoding and SHA256; the SHA256 of each rank's part (what that rank's metadata row
  records); the size and SHA256 of ``.metadata``; ``branches``, present only when a rank saved
  on a continuation other than the run's first (``storage.lineage``): that rank's
  continuation id, by rank, as a per-rank archive's manifest has its ``branch``; and
  ``self_sha256`` over the rest, as in ``format.manifest``;
- the item encodings: ``torch.save`` (what stock ``FileSystemReader`` reads: one
  ``torch.save`` zip per tensor, as ``FileSystemWriter`` writes it), read back here by locating
  the storage record in the zip, without unpickling its ``data.pkl``; ``blob`` (a codec blob,
  ``ckptpilot.codecs.blob``; only ckptpilot reads it); ``bytes`` (a non-tensor value: its JSON
  form, ``dcp.values``, is the item's ``value`` in the commit file, covered by the commit
  file's digest and by its rank's part digest; the item's bytes in the data file are DCP's
  ``torch.save`` of it, for stock readers only, hashed but never read by ckptpilot).

Version 1 (the format before) kept a non-tensor value only as that ``torch.save`` pickle. It
is still read, tensors and all, but its ``bytes`` items carry no ``value`` and are refused
when a load asks for one (:func:`pickled_refusal`, naming the item): ckptpilot does not
unpickle them, not even with ``torch.load(weights_only=True)``, whose restricted unpickler is
a guard PyTorch has had to fix before, not a proof. Version 1 part digests are unchanged.

Must not touch files or decide which checkpoint to load: ``dcp.storage`` reads and writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import struct
import sys
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptpilot.codecs.blob import DTYPE_NAMES, DTYPES
from ckptpilot.codecs.registry import decode_blob
from ckptpilot.dcp.values import canonical, decode_value
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.format.manifest import decode_self_digested
from ckptpilot.tiers.remote.store import COMMIT_FILE

__all__ = [
    "DCP_FORMAT",
    "DCP_FORMAT_VERSION",
    "DCP_METADATA_FILE",
    "DCP_READABLE_VERSIONS",
    "MANIFEST_FILE",
    "Encoding",
    "ItemRecord",
    "build_manifest",
    "checkpoint_metadata",
    "dcp_name",
    "decode_item_tensor",
    "decode_manifest",
    "dtype_name",
    "empty_part_digest",
    "encode_manifest",
    "item_digest",
    "item_value",
    "manifest_items",
    "narrow",
    "parse_dcp_name",
    "part_digests",
    "pickled_refusal",
]

DCP_FORMAT = "ckptpilot-dcp"
DCP_FORMAT_VERSION = 2
DCP_READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = COMMIT_FILE
DCP_METADATA_FILE = ".metadata"
"""DCP's own metadata file (a pickle), written for stock readers only."""


class Encoding(str, Enum):
    """How an item's bytes hold its value; the value is the word in the commit file."""

    TORCH_SAVE = "torch.save"  # one tensor, as FileSystemWriter writes it
    BLOB = "blob"  # one tensor, a codec blob
    BYTES = "bytes"  # a non-tensor value: JSON in the commit file, torch.save in the file


_NAME_RE = re.compile(r"^dcp_step_(\d{8,})$")
_MEMORY_FORMATS = {torch.contiguous_format: "contiguous_format",
                   torch.channels_last: "channels_last",
                   torch.preserve_format: "preserve_format"}
_MEMORY_FORMAT_OF = {name: fmt for fmt, name in _MEMORY_FORMATS.items()}
_ZIP_LOCAL_HEADER = struct.Struct("<4s5H3I2H")
_ZIP_LOCAL_MAGIC = b"PK\x03\x04"


def dcp_name(step: int) -> str:
    """The directory of step ``step``: by global step, never by time (as archives are)."""
    return f"dcp_step_{step:08d}"


def parse_dcp_name(name: str) -> int | None:
    """The step of a DCP checkpoint directory name; None for any other name (staging and
    set-aside directories carry a suffix, so they are None too)."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ItemRecord:
    """Where one saved item (a tensor chunk or a serialised object) lies and what it hashes
    to. ``shape`` is the chunk's, ``dtype`` a codec dtype name; both None for ``bytes``.
    ``value``: a ``bytes`` item's value as :func:`~ckptpilot.dcp.values.canonical` JSON
    text; None for a tensor and for a version 1 ``bytes`` item (a pickle only)."""

    rank: int
    file: str
    at: int
    nbytes: int
    sha256: str
    encoding: Encoding
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    value: str | None = None

    def where(self, index: MetadataIndex, location: str) -> str:
        """How errors name the item: its file, its fqn and chunk offset, its byte range."""
        chunk = "" if index.offset is None else f" chunk at {list(index.offset)}"
        return (f"{location}/{self.file}: item {index.fqn!r}{chunk} "
                f"(bytes {self.at}..{self.at + self.nbytes})")


def dtype_name(dtype: torch.dtype, fqn: str) -> str:
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise CheckpointFormatError(f"{fqn}: dtype {dtype} cannot be stored")
    return name


def _dtype(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r}")
    return DTYPES[name]


def _ints(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CheckpointFormatError(f"{where}: expected a list of non-negative ints, "
                                    f"got {value!r}")
    return tuple(value)


def _offset_key(index: MetadataIndex) -> str:
    return "-" if index.offset is None else ",".join(str(v) for v in index.offset)


def part_digests(items: Mapping[MetadataIndex, ItemRecord]) -> dict[int, str]:
    """SHA256 of each rank's part: over its items' (fqn, chunk offset, SHA256, and a value's
    digest), sorted, so that it depends on what the rank wrote and not on the order it wrote
    it in. A rank that wrote nothing (DCP gave every item to others) has the digest of no
    items."""
    lines: dict[int, list[str]] = {}
    for index, rec in items.items():
        value = "" if rec.value is None else f"\0{hashlib.sha256(rec.value.encode()).hexdigest()}"
        lines.setdefault(rec.rank, []).append(f"{index.fqn}\0{_offset_key(index)}\0"
                                              f"{rec.sha256}{value}\n")
    return {rank: hashlib.sha256("".join(sorted(part)).encode()).hexdigest()
            for rank, part in lines.items()}


def empty_part_digest() -> str:
    return hashlib.sha256(b"").hexdigest()


def _state_to_json(md: Metadata) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            state[fqn] = {"kind": "bytes"}
            continue
        if not isinstance(smd, TensorStorageMetadata):
            raise CheckpointFormatError(
                f"{fqn}: {type(smd).__name__} entries cannot be recorded (tensors and "
                "serialised objects only)")
        props = smd.properties
        if props.layout != torch.strided:
            raise CheckpointFormatError(f"{fqn}: layout {props.layout} cannot be stored "
                                        "(strided tensors only)")
        if props.memory_format not in _MEMORY_FORMATS:
            raise CheckpointFormatError(f"{fqn}: memory format {props.memory_format} "
                                        "cannot be recorded")
        state[fqn] = {
            "kind": "tensor", "dtype": dtype_name(props.dtype, fqn),
            "requires_grad": bool(props.requires_grad),
            "memory_format": _MEMORY_FORMATS[props.memory_format],
            "pin_memory": bool(props.pin_memory), "size": list(smd.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)}
                       for c in smd.chunks],
        }
    return state


def _planner_data_to_json(data: object) -> dict[str, list[str | int]] | None:
    """DCP's default planner keeps ``{flat fqn: path in the nested state dict}``; a custom
    planner's data of another shape has no JSON form here and is refused, naming it."""
    if data is None:
        return None
    if isinstance(data, Mapping) and all(
            isinstance(k, str) and isinstance(v, Sequence) and not isinstance(v, str)
            and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
            for k, v in data.items()):
        return {k: list(v) for k, v in data.items()}
    raise CheckpointFormatError(
        f"the save planner's planner_data ({type(data).__name__}) is not a mapping of fqn to "
        "a path of str/int keys, so it cannot be recorded; use DefaultSavePlanner or a "
        "planner that keeps that shape")


def build_manifest(*, step: int, world_size: int, level: str, reason: str,
                   retention_class: str, score: float | None, created_unix: float,
                   codecs: bool, metadata: Metadata, items: Mapping[MetadataIndex, ItemRecord],
                   metadata_file: Mapping[str, Any] | None,
                   branches: Mapping[int, str] | None = None) -> dict[str, Any]:
    """A complete commit file, ``self_sha256`` included. ``metadata_file``: the size and
    SHA256 of the ``.metadata`` written beside it (None when none was: with codecs);
    ``branches``: each rank's continuation id ("" or absent: the run's first)."""
    storage = metadata.storage_meta
    manifest: dict[str, Any] = {
        "format": DCP_FORMAT,
        "format_version": DCP_FORMAT_VERSION,
        "name": dcp_name(step),
        "step": step,
        "world_size": world_size,
        "level": level,
        "reason": reason,
        "retention_class": retention_class,
        "score": score,
        "created_unix": created_unix,
        "codecs": codecs,
        "dcp_version": metadata.version,
        "storage_meta": None if storage is None else {
            "checkpoint_id": None if storage.checkpoint_id is None
            else str(storage.checkpoint_id),
            "save_id": storage.save_id, "modules": list(storage.modules)},
        "state": _state_to_json(metadata),
        "planner_data": _planner_data_to_json(metadata.planner_data),
        "items": [_item_to_json(index, rec) for index, rec in items.items()],
        "metadata_file": None if metadata_file is None else dict(metadata_file),
        "parts": {str(rank): digest for rank, digest in sorted(part_digests(items).items())},
    }
    for rank in range(world_size):
        manifest["parts"].setdefault(str(rank), empty_part_digest())
    if branches and any(branches.values()):
        manifest["branches"] = {str(rank): branch for rank, branch in sorted(branches.items())
                                if branch}
    manifest["self_sha256"] = _digest(manifest)
    return manifest


def _item_to_json(index: MetadataIndex, rec: ItemRecord) -> dict[str, Any]:
    item = {"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
            "index": index.index, "rank": rec.rank, "file": rec.file, "at": rec.at,
            "bytes": rec.nbytes, "sha256": rec.sha256, "encoding": rec.encoding.value,
            "dtype": rec.dtype, "shape": None if rec.shape is None else list(rec.shape)}
    if rec.encoding is Encoding.BYTES:
        if rec.value is None:
            raise CheckpointFormatError(f"{index.fqn}: a non-tensor item without its JSON "
                                        "value cannot be recorded")
        item["value"] = json.loads(rec.value)
    return item


def _digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "self_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()


def decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The commit file in ``raw``, checked for format, version and its own digest (a
    mismatch raises ``IntegrityError``, any other fault ``CheckpointFormatError``), and its
    ``branches``, if any, a map of rank numbers to continuation ids: the digest is the file's
    own, so a crafted file passes it, and a rebuild or a restore reads these as they are."""
    manifest = decode_self_digested(raw, where, fmt=DCP_FORMAT,
                                    version=DCP_READABLE_VERSIONS, digest=_digest)
    branches = manifest.get("branches", {})
    if not (isinstance(branches, dict)
            and all(isinstance(k, str) and k.isdecimal() and isinstance(v, str)
                    for k, v in branches.items())):
        raise CheckpointFormatError(f"{where}: 'branches' must map rank numbers to "
                                    f"continuation ids, got {branches!r:.200}")
    return manifest


def manifest_items(manifest: Mapping[str, Any], where: str) -> dict[MetadataIndex, ItemRecord]:
    """Every item of a decoded commit file, checked: known encodings, items of one file back
    to back from byte 0 (so that checking the items checks every byte of every file), and
    (version 2) every ``bytes`` item's value a valid encoded value."""
    items: dict[MetadataIndex, ItemRecord] = {}
    ends: dict[str, int] = {}
    with_values = manifest.get("format_version") != 1
    for n, raw in enumerate(manifest.get("items", [])):
        at = f"{where}: items[{n}]"
        try:
            offset = raw["offset"]
            index = MetadataIndex(str(raw["fqn"]),
                                  None if offset is None else _ints(offset, at),
                                  raw.get("index"))
            shape = raw.get("shape")
            rec = ItemRecord(rank=int(raw["rank"]), file=str(raw["file"]), at=int(raw["at"]),
                             nbytes=int(raw["bytes"]), sha256=str(raw["sha256"]),
                             encoding=Encoding(raw["encoding"]), dtype=raw.get("dtype"),
                             shape=None if shape is None else _ints(shape, at))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{at}: malformed ({e!r})") from e
        if rec.encoding is Encoding.BYTES and with_values:
            rec = dataclasses.replace(rec, value=_value_text(raw, f"{at} ({index.fqn!r})"))
        if rec.encoding is not Encoding.BYTES:
            _dtype(rec.dtype, at)
            if rec.shape is None:
                raise CheckpointFormatError(f"{at}: a tensor item without a shape")
        if "/" in rec.file or rec.file.startswith(".") or rec.at != ends.get(rec.file, 0):
            raise CheckpointFormatError(f"{at}: {rec.file!r} at byte {rec.at} does not follow "
                                        "the file's previous item")
        ends[rec.file] = rec.at + rec.nbytes
        items[index] = rec
    return items


def _value_text(raw: Mapping[str, Any], where: str) -> str:
    """A version 2 ``bytes`` item's value, checked to decode, as canonical text."""
    if "value" not in raw:
        raise CheckpointFormatError(f"{where}: a non-tensor item without its JSON value "
                                    "(ckptpilot does not read the pickle beside it)")
    decode_value(raw["value"], f"{where}: value")
    return canonical(raw["value"])


def item_value(rec: ItemRecord, where: str) -> Any:
    """The value of a ``bytes`` item, decoded from its JSON; a version 1 item (a pickle
    only) is refused (:func:`pickled_refusal`)."""
    if rec.value is None:
        raise pickled_refusal(where)
    return decode_value(json.loads(rec.value), f"{where}: value")


def pickled_refusal(where: str) -> CheckpointFormatError:
    """Why a version 1 non-tensor item is not loaded, and what to do about it."""
    return CheckpointFormatError(
        f"{where}: a non-tensor value that ckptpilot before DCP format version 2 stored only "
        "as a pickle; ckptpilot never unpickles a checkpoint, so it does not load it. If you "
        "trust these files, load that value with stock dcp.load and FileSystemReader on the "
        "directory (codecs off: it has a .metadata) and save the step again with this "
        "ckptpilot, or leave the key out of the state dict you load")


def checkpoint_metadata(manifest: Mapping[str, Any], where: str) -> Metadata:
    """DCP's ``Metadata`` rebuilt from a decoded commit file, its ``storage_data`` mapping
    each item's index to its :class:`ItemRecord`."""
    state: dict[str, Any] = {}
    for fqn, raw in manifest.get("state", {}).items():
        at = f"{where}: state[{fqn!r}]"
        try:
            if raw["kind"] == "bytes":
                state[fqn] = BytesStorageMetadata()
                continue
            props = TensorProperties(
                dtype=_dtype(raw["dtype"], at), layout=torch.strided,
                requires_grad=bool(raw["requires_grad"]),
                memory_format=_MEMORY_FORMAT_OF[raw["memory_format"]],
                pin_memory=bool(raw["pin_memory"]))
            chunks = [ChunkStorageMetadata(offsets=torch.Size(_ints(c["offsets"], at)),
                                           sizes=torch.Size(_ints(c["sizes"], at)))
                      for c in raw["chunks"]]
            state[fqn] = TensorStorageMetadata(properties=props,
                                               size=torch.Size(_ints(raw["size"], at)),
                                               chunks=chunks)
        except (KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{at}: malformed ({e!r})") from e
    planner = manifest.get("planner_data")
    storage = manifest.get("storage_meta")
    return Metadata(
        state_dict_metadata=state,
        planner_data=None if planner is None else {k: tuple(v) for k, v in planner.items()},
        storage_data=manifest_items(manifest, where),
        storage_meta=None if storage is None else StorageMeta(
            checkpoint_id=storage.get("checkpoint_id"), save_id=storage.get("save_id"),
            modules=list(storage.get("modules", []))),
        version=manifest.get("dcp_version"))


def item_digest(payload: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a buffer, without copying it (``zipfile`` reads only
    the directory at the end and the headers it is asked for)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        memoryview(buffer).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def _torch_save_storage(payload: memoryview, where: str) -> tuple[int, int]:
    """(offset, length) of the one storage record of a ``torch.save`` zip of one tensor.

    The zip's ``data.pkl`` (a pickle) is never read: the dtype and shape come from the commit
    file, the bytes from the storage record, found through the zip's directory."""
    try:
        with zipfile.ZipFile(_ViewReader(payload)) as archive:
            infos = archive.infolist()
            storages = [i for i in infos if re.fullmatch(r"[^/]+/data/\d+", i.filename)]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            byteorder = archive.read(order[0]).decode() if order else "little"
    except (zipfile.BadZipFile, UnicodeDecodeError, EOFError) as e:
        raise CheckpointFormatError(f"{where}: not a torch.save archive ({e})") from e
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
        raise CheckpointFormatError(f"{where}: expected one uncompressed tensor storage, found "
                                    f"{[i.filename for i in storages]}")
    if byteorder != sys.byteorder:
        raise CheckpointFormatError(f"{where}: written on a {byteorder}-endian machine")
    info = storages[0]
    start = info.header_offset
    if start + _ZIP_LOCAL_HEADER.size > len(payload):
        raise CheckpointFormatError(f"{where}: storage header out of range")
    fields = _ZIP_LOCAL_HEADER.unpack_from(payload, start)
    if fields[0] != _ZIP_LOCAL_MAGIC:
        raise CheckpointFormatError(f"{where}: bad zip local header")
    offset = start + _ZIP_LOCAL_HEADER.size + fields[-2] + fields[-1]
    if offset + info.file_size > len(payload):
        raise CheckpointFormatError(f"{where}: storage record out of range")
    return offset, info.file_size


def decode_item_tensor(rec: ItemRecord, payload: bytearray, where: str) -> torch.Tensor:
    """The tensor of a verified tensor item, over ``payload``'s memory where it can be."""
    dtype = _dtype(rec.dtype, where)
    shape = rec.shape or ()
    if rec.encoding is Encoding.BLOB:
        try:
            tensor = decode_blob(payload)
        except ValueError as e:
            raise CheckpointFormatError(f"{where}: cannot decode: {e}") from e
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointFormatError(f"{where}: decoded {tensor.dtype} {list(tensor.shape)}, "
                                        f"recorded {dtype} {list(shape)}")
        return tensor
    offset, length = _torch_save_storage(memoryview(payload), where)
    numel = 1
    for d in shape:
        numel *= d
    if length != numel * dtype.itemsize:
        raise CheckpointFormatError(f"{where}: storage holds {length} bytes, {dtype} "
                                    f"{list(shape)} needs {numel * dtype.itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(payload, dtype=torch.uint8, count=length, offset=offset)
    return flat.view(dtype).reshape(shape)


def narrow(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]
           ) -> torch.Tensor:
    """The hypercube of ``tensor`` a read request asks for."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor
