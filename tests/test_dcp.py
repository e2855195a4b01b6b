"""ckptpilot.dcp: DCP's StorageWriter / StorageReader on ckptpilot, with two real gloo ranks
saving plain tensors and DTensors on a 1-D CPU mesh.

The ranks are started by ``torch.multiprocessing.start_processes`` with ``fork``: a spawned
child imports torch, DCP and ckptpilot again, several times what the job itself takes."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import signal
import socket
import struct
import warnings
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptpilot.cli import ops
from ckptpilot.dcp import Reader, Writer, dcp_name
from ckptpilot.dcp.format import (
    Encoding,
    ItemRecord,
    build_manifest,
    checkpoint_metadata,
    decode_manifest,
    encode_manifest,
    item_value,
    part_digests,
)
from ckptpilot.dcp.storage import read_manifest
from ckptpilot.dcp.values import MAX_DEPTH, canonical, decode_value, encode_value
from ckptpilot.errors import CheckpointFormatError, IntegrityError, NoCheckpointError
from ckptpilot.policy import Policy, load_policy
from ckptpilot.rundir import read_run_id
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Status, Tier

WORLD = 2
SHARDED = (Shard(0), Shard(1))
RESHARDED = (Shard(1), Replicate())
FIXTURES = Path(__file__).parent / "fixtures" / "format"
MANIFEST_V2 = FIXTURES / "dcp_manifest.v2.json"  # as written today
MANIFEST_V1 = FIXTURES / "dcp_manifest.v1.json"  # non-tensor values as pickles only
JOIN_SECONDS = 120  # a safety net for a hung collective, never a speed assertion

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, *args: Any) -> mp.ProcessContext:
    """Start ``fn(rank, port, *args)`` on WORLD ranks; the caller joins."""
    ctx = mp.start_processes(fn, args=(_free_port(), *args), nprocs=WORLD, join=False,
                             start_method="fork")
    assert ctx is not None
    return ctx


def _join(ctx: mp.ProcessContext) -> None:
    while not ctx.join(timeout=JOIN_SECONDS):
        pass


def _mesh(rank: int, port: int) -> DeviceMesh:
    warnings.simplefilter("ignore")  # DCP warns about defaults on every call
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    return init_device_mesh("cpu", (WORLD,))


def _reference(seed: int) -> dict[str, torch.Tensor]:
    """The global tensors every rank starts from: float32, bfloat16, int64, and the float
    bit patterns a value comparison would miss (-0.0, a NaN with a payload)."""
    g = torch.Generator().manual_seed(seed)
    nan_payload = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    odd = torch.cat([torch.tensor([0.0, -0.0, float("inf")]), nan_payload])
    return {"w": torch.randn(8, 6, generator=g), "h": torch.randn(6, 4, generator=g).bfloat16(),
            "plain": torch.cat([torch.randn(5, generator=g), odd]),
            "count": torch.arange(7) * (seed + 1)}


def _state(mesh: DeviceMesh, ref: dict[str, torch.Tensor],
           placements: tuple[Any, Any] = SHARDED, *, epoch: int = 3) -> dict[str, Any]:
    """A state dict as a sharded model's: DTensors, replicated plain tensors, a plain int."""
    return {"model": {"w": distribute_tensor(ref["w"], mesh, [placements[0]]),
                      "h": distribute_tensor(ref["h"], mesh, [placements[1]])},
            "plain": ref["plain"].clone(), "count": ref["count"].clone(), "epoch": epoch}


def _zeros(mesh: DeviceMesh, placements: tuple[Any, Any]) -> dict[str, Any]:
    ref = {k: torch.zeros_like(v) for k, v in _reference(0).items()}
    return _state(mesh, ref, placements, epoch=0)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _check(state: dict[str, Any], ref: dict[str, torch.Tensor], epoch: int = 3) -> None:
    """Every global tensor bit-equal to the reference (DTensors gathered whole)."""
    got = {"w": state["model"]["w"], "h": state["model"]["h"], "plain": state["plain"],
           "count": state["count"]}
    for key, tensor in got.items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        assert _bits_equal(full, ref[key]), f"{key} differs bit-wise"
    assert state["epoch"] == epoch


# -- save and load: the two-rank job ---------------------------------------------------------


def _save_and_load_job(rank: int, port: int, run_dir: str) -> None:
    mesh = _mesh(rank, port)
    ref = _reference(0)
    dcp.save(_state(mesh, ref), storage_writer=Writer(run_dir, step=10))

    reader = Reader(run_dir)
    assert reader.step == 10
    got = _zeros(mesh, SHARDED)
    dcp.load(got, storage_reader=reader)
    _check(got, ref)

    # Another sharding: each rank now wants a slice of every saved chunk of "w" and "h".
    got = _zeros(mesh, RESHARDED)
    dcp.load(got, storage_reader=Reader(run_dir, step=10))
    _check(got, ref)

    # Interop: the directory is a plain DCP checkpoint for stock readers.
    got = _zeros(mesh, SHARDED)
    dcp.load(got, storage_reader=FileSystemReader(reader.checkpoint_id))
    _check(got, ref)

    later = _reference(1)
    response = dcp.async_save(_state(mesh, later, epoch=4),
                              storage_writer=Writer(run_dir, step=20))
    upload = getattr(response, "upload_completion", response)
    upload.result(timeout=JOIN_SECONDS)
    reader = Reader(run_dir)
    assert reader.step == 20
    got = _zeros(mesh, SHARDED)
    dcp.load(got, storage_reader=reader)
    _check(got, later, epoch=4)
    dist.destroy_process_group()


@pytest.mark.crash
def _keep_one(policy: Policy) -> Policy:
    """Retention down to the newest checkpoint (``keep_last`` 1), so a prune has work."""
    return policy.model_copy(update={
        "retention": policy.retention.model_copy(update={"keep_last": 1})})


def test_two_ranks_save_dtensors_and_load_them_bit_exact_resharded_stock_and_async(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _join(_spawn(_save_and_load_job, str(run_dir)))

    remote = RemoteTier(str(run_dir / "checkpoints"))
    assert remote.list() == [dcp_name(10), dcp_name(20)], "staging debris or a missing save"
    assert sorted(os.listdir(run_dir / "checkpoints" / dcp_name(10))) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        rows = store.rows(read_run_id(run_dir), tier=Tier.REMOTE)
    assert sorted((r.step, r.rank, r.status, r.level.value) for r in rows) == [
        (step, rank, Status.VALID, "organ") for step in (10, 20) for rank in range(WORLD)]
    for row in rows:
        manifest = read_manifest(remote, dcp_name(row.step))
        assert row.location == remote.path(dcp_name(row.step))
        assert row.sha256 == manifest["parts"][str(row.rank)], "row and commit file disagree"

    policy = _keep_one(load_policy(None, run_dir=run_dir))
    out = io.StringIO()
    assert ops.ls(policy, out) == 0
    listed = [line.split() for line in out.getvalue().splitlines()[1:]]
    assert sorted((int(c[0]), int(c[1]), c[4]) for c in listed) == [
        (step, rank, "valid") for step in (10, 20) for rank in range(WORLD)]
    assert ops.validate(policy, rebuild=False, out=out) == 0
    assert "4 ok, 0 corrupted" in out.getvalue()

    # Both ranks' rows of step 10 point at one directory: it goes with them.
    assert ops.prune(policy, dry_run=False, out=out) == 0
    assert remote.list() == [dcp_name(20)]
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        old = [r for r in store.rows(read_run_id(run_dir)) if r.step == 10]
    assert [(r.status, r.removed_at is not None) for r in old] == [(Status.EXPIRED, True)] * 2


# -- a corrupted chunk ------------------------------------------------------------------------


def _corrupted_chunk_job(rank: int, port: int, run_dir: str) -> None:
    mesh = _mesh(rank, port)
    ref = _reference(0)
    dcp.save(_state(mesh, ref), storage_writer=Writer(run_dir, step=10))
    directory = Path(run_dir) / "checkpoints" / dcp_name(10)
    if rank == 0:  # one byte in the middle of rank 1's shard of "model.w"
        manifest = read_manifest(RemoteTier(str(directory.parent)), dcp_name(10))
        item = next(i for i in manifest["items"] if i["fqn"] == "model.w" and i["rank"] == 1)
        with open(directory / item["file"], "r+b") as f:
            f.seek(item["at"] + item["bytes"] - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_zeros(mesh, SHARDED), storage_reader=Reader(run_dir))
    error = caught.value.failures[1][0]
    assert isinstance(error, IntegrityError)
    assert "__1_0.distcp: item 'model.w' chunk at [4, 0]" in str(error)
    assert list(caught.value.failures) == [1], "only rank 1 reads rank 1's shard"
    dist.destroy_process_group()


@pytest.mark.crash
def test_a_corrupted_chunk_is_refused_on_read_naming_file_and_item_and_validate_marks_it(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _join(_spawn(_corrupted_chunk_job, str(run_dir)))

    out = io.StringIO()
    policy = load_policy(None, run_dir=run_dir)
    assert ops.validate(policy, rebuild=False, out=out) == 1
    assert "__1_0.distcp: item 'model.w' chunk at [4, 0]" in out.getvalue()
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        statuses = {r.rank: r.status for r in store.rows(read_run_id(run_dir))}
    assert statuses == {0: Status.CORRUPTED, 1: Status.CORRUPTED}
    with pytest.raises(NoCheckpointError, match="step 10: rank 0 corrupted, rank 1 corrupted"):
        Reader(run_dir)


# -- a save killed before DCP's .metadata ------------------------------------------------------


def _killed_before_metadata_job(rank: int, port: int, run_dir: str) -> None:
    mesh = _mesh(rank, port)
    dcp.save(_state(mesh, _reference(0)), storage_writer=Writer(run_dir, step=10))
    writer = Writer(run_dir, step=20)
    if rank == 0:  # the coordinator dies once every rank has written its part
        writer.finish = lambda **_: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    dcp.save(_state(mesh, _reference(1)), storage_writer=writer)
    raise AssertionError("the save of step 20 must not complete")


@pytest.mark.crash
def test_a_save_killed_before_its_metadata_leaves_no_valid_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ctx = _spawn(_killed_before_metadata_job, str(run_dir))
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        _join(ctx)
    assert ctx.processes[0].exitcode == -signal.SIGKILL

    entries = RemoteTier(str(run_dir / "checkpoints")).list()
    assert dcp_name(20) not in entries
    assert [e for e in entries if e.startswith(f"{dcp_name(20)}.staging-")], entries
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        rows = store.rows(read_run_id(run_dir))
    assert sorted((r.step, r.rank, r.status) for r in rows) == [
        (10, 0, Status.VALID), (10, 1, Status.VALID),
        (20, 0, Status.PENDING), (20, 1, Status.PENDING)]
    out = io.StringIO()
    ops.ls(load_policy(None, run_dir=run_dir), out)
    listed = [line.split() for line in out.getvalue().splitlines()[1:]]
    assert {c[4] for c in listed if c[0] == "20"} == {"pending"}

    reader = Reader(run_dir)  # the newest valid step is the one before the kill
    assert reader.step == 10
    assert reader.skipped == [(20, "rank 0 pending, rank 1 pending")]
    full = {k: torch.zeros_like(v) for k, v in _reference(0).items()}
    state: dict[str, Any] = {"model": {"w": full["w"], "h": full["h"]}, "plain": full["plain"],
                             "count": full["count"], "epoch": 0}
    dcp.load(state, storage_reader=reader, no_dist=True)  # 2 shards into 1 process
    _check(state, _reference(0))
    with pytest.raises(CheckpointException, match="missing"):
        dcp.load(state, storage_reader=Reader(run_dir, step=20), no_dist=True)


# -- one process -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_codecs_round_trip_bit_exact_and_stock_readers_find_no_metadata(tmp_path: Path) -> None:
    ref = _reference(2)
    state = {"plain": ref["plain"], "w": ref["w"], "h": ref["h"], "count": ref["count"]}
    dcp.save(state, storage_writer=Writer(tmp_path, step=3, codecs=True), no_dist=True)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = Reader(tmp_path)
    dcp.load(got, storage_reader=reader, no_dist=True)
    for key, tensor in state.items():
        assert _bits_equal(got[key], tensor), key
    manifest = read_manifest(reader.remote, dcp_name(3))
    assert manifest["level"] == "pulse" and manifest["metadata_file"] is None
    assert {i["encoding"] for i in manifest["items"]} == {"blob"}
    with pytest.raises(CheckpointException, match=r"\.metadata"):
        dcp.load(got, storage_reader=FileSystemReader(reader.checkpoint_id), no_dist=True)


def test_a_checkpoint_id_is_refused_the_directory_is_named_by_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without checkpoint_id"):
        dcp.save({"x": torch.ones(2)}, checkpoint_id=str(tmp_path / "elsewhere"),
                 storage_writer=Writer(tmp_path, step=1), no_dist=True)
    with pytest.raises(NoCheckpointError, match="no DCP save recorded"):
        Reader(tmp_path)


def test_a_directory_renamed_to_another_step_is_refused(tmp_path: Path) -> None:
    dcp.save({"x": torch.ones(2)}, storage_writer=Writer(tmp_path, step=1), no_dist=True)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / dcp_name(1)).rename(checkpoints / dcp_name(2))
    with pytest.raises(CheckpointFormatError, match="another step's name"):
        read_manifest(RemoteTier(str(checkpoints)), dcp_name(2))


def _save_steps(run_dir: Path, steps: list[int]) -> None:
    for step in steps:
        dcp.save({"x": torch.full((3,), float(step))}, storage_writer=Writer(run_dir, step=step),
                 no_dist=True)


def _step_loaded(run_dir: Path, step: int | None = None) -> tuple[int, float]:
    got = {"x": torch.zeros(3)}
    reader = Reader(run_dir, step=step)
    dcp.load(got, storage_reader=reader, no_dist=True)
    return reader.step, float(got["x"][0])


def test_prune_removes_old_dcp_checkpoints_and_recover_sets_later_ones_aside(
        tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2, 3, 4])
    policy = _keep_one(load_policy(None, run_dir=tmp_path))
    checkpoints = tmp_path / "checkpoints"
    out = io.StringIO()
    assert ops.prune(policy, dry_run=False, out=out) == 0
    assert sorted(os.listdir(checkpoints)) == [dcp_name(4)], out.getvalue()

    _save_steps(tmp_path, [5, 6])
    assert ops.recover(policy, step=4, dry_run=False, force=False, out=out) == 0
    left = sorted(os.listdir(checkpoints))
    assert left[0] == dcp_name(4) and len(left) == 3
    assert all(".abandoned-by-recover-4-" in name for name in left[1:])
    assert _step_loaded(tmp_path) == (4, 4.0)
    with MetadataStore(tmp_path / "metadata.sqlite", read_only=True) as store:
        statuses = {r.step: r.status for r in store.rows(read_run_id(tmp_path))}
    assert statuses == {1: Status.EXPIRED, 2: Status.EXPIRED, 3: Status.EXPIRED,
                        4: Status.VALID, 5: Status.EXPIRED, 6: Status.EXPIRED}
    with pytest.raises(ops.OpError, match="DCP checkpoint"):
        ops.recover(policy, step=4, dry_run=False, force=True, out=out)


def test_validate_rebuild_records_dcp_checkpoints_again(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    (tmp_path / "metadata.sqlite").unlink()
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"metadata.sqlite{suffix}").unlink(missing_ok=True)
    out = io.StringIO()
    assert ops.validate(load_policy(None, run_dir=tmp_path), rebuild=True, out=out) == 0
    assert "2 ok, 0 corrupted" in out.getvalue()
    assert _step_loaded(tmp_path) == (2, 2.0)


def test_a_step_saved_again_supersedes_the_earlier_save_and_keeps_its_bytes(
        tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    dcp.save({"x": torch.full((3,), 9.0)}, storage_writer=Writer(tmp_path, step=1),
             no_dist=True)
    assert _step_loaded(tmp_path) == (1, 9.0)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names[0] == dcp_name(1) and names[1].startswith(f"{dcp_name(1)}.superseded-")
    with MetadataStore(tmp_path / "metadata.sqlite", read_only=True) as store:
        rows = store.rows(read_run_id(tmp_path))
        replaced = store.audit_log("replace")
    assert [(r.step, r.status) for r in rows] == [(1, Status.VALID)]
    assert [e.details["status"] for e in replaced] == ["expired"], "the old row, audited"


def _pinned_manifest() -> bytes:
    """A commit file built from fixed inputs: a DTensor-like chunked tensor, a plain one and
    an object, as DCP's default planner describes them."""
    props = TensorProperties(dtype=torch.float32)
    metadata = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(props, torch.Size([4, 2]), [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2]))]),
            "epoch": BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "epoch": ("epoch",)},
        storage_meta=StorageMeta(checkpoint_id="/runs/x/checkpoints/dcp_step_00000007",
                                 save_id="s"),
        version="1.0.0")
    items = {
        MetadataIndex("epoch"): ItemRecord(0, "__0_0.distcp", 0, 10, "a" * 64, Encoding.BYTES,
                                           value=canonical(encode_value(7, "epoch"))),
        MetadataIndex("model.w", [0, 0]): ItemRecord(0, "__0_0.distcp", 10, 100, "b" * 64,
                                                     Encoding.TORCH_SAVE, "float32", (2, 2)),
        MetadataIndex("model.w", [2, 0]): ItemRecord(1, "__1_0.distcp", 0, 100, "c" * 64,
                                                     Encoding.TORCH_SAVE, "float32", (2, 2))}
    return encode_manifest(build_manifest(
        step=7, world_size=2, level="organ", reason="dcp.save", retention_class="routine",
        score=None, created_unix=1.5, codecs=False, metadata=metadata, items=items,
        metadata_file={"bytes": 5, "sha256": "d" * 64}))


def test_the_commit_file_format_is_pinned_and_reads_back_as_dcp_metadata() -> None:
    raw = _pinned_manifest()
    # Version 2's bytes: a change here is a format change (bump DCP_FORMAT_VERSION and keep
    # a golden of the old version).
    assert raw == MANIFEST_V2.read_bytes()
    manifest = decode_manifest(raw, "pinned")
    metadata = checkpoint_metadata(manifest, "pinned")
    assert metadata.planner_data == {"model.w": ("model", "w"), "epoch": ("epoch",)}
    chunks = metadata.state_dict_metadata["model.w"].chunks  # type: ignore[union-attr]
    assert [list(c.offsets) for c in chunks] == [[0, 0], [2, 0]]
    assert metadata.storage_data[MetadataIndex("model.w", [2, 0])].file == "__1_0.distcp"
    assert item_value(metadata.storage_data[MetadataIndex("epoch")], "pinned") == 7
    tampered = raw.replace(b'"step": 7', b'"step": 8')
    with pytest.raises(IntegrityError, match="pinned"):
        decode_manifest(tampered, "pinned")


@pytest.mark.parametrize("branches", [["a", "b"], {"0": 7}, {"rank0": "a"}, "a"])
def test_a_commit_file_whose_branches_are_not_rank_to_id_is_refused_naming_it(
        branches: object) -> None:
    def redigested(manifest: dict) -> bytes:  # as a forger would: the digest is the file's own
        body = {k: v for k, v in manifest.items() if k != "self_sha256"}
        manifest["self_sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True).encode()).hexdigest()
        return encode_manifest(manifest)

    manifest = decode_manifest(_pinned_manifest(), "pinned")
    manifest["branches"] = branches
    with pytest.raises(CheckpointFormatError, match=r"crafted: 'branches' must map"):
        decode_manifest(redigested(manifest), "crafted")
    manifest["branches"] = {"0": "", "1": "3f2a"}
    assert decode_manifest(redigested(manifest), "fine")["branches"] == {"0": "", "1": "3f2a"}


def test_a_version_1_commit_file_still_reads_but_its_pickled_value_is_refused_naming_it(
        ) -> None:
    manifest = decode_manifest(MANIFEST_V1.read_bytes(), "v1")
    metadata = checkpoint_metadata(manifest, "/runs/x/checkpoints/dcp_step_00000007")
    assert metadata.state_dict_metadata.keys() == {"model.w", "epoch"}
    w = metadata.storage_data[MetadataIndex("model.w", [0, 0])]
    assert (w.encoding, w.dtype, w.shape) == (Encoding.TORCH_SAVE, "float32", (2, 2))
    epoch = metadata.storage_data[MetadataIndex("epoch")]
    assert (epoch.encoding, epoch.value) == (Encoding.BYTES, None)
    where = epoch.where(MetadataIndex("epoch"), "/runs/x/checkpoints/dcp_step_00000007")
    with pytest.raises(CheckpointFormatError) as caught:
        item_value(epoch, where)
    assert str(caught.value).startswith(
        "/runs/x/checkpoints/dcp_step_00000007/__0_0.distcp: item 'epoch' (bytes 0..10): a "
        "non-tensor value that ckptpilot before DCP format version 2 stored only as a pickle; "
        "ckptpilot never unpickles a checkpoint")
    # Its rows' part digests are what they were: a version 1 checkpoint keeps its rows.
    assert part_digests(metadata.storage_data) == {int(r): d
                                                   for r, d in manifest["parts"].items()}


# -- non-tensor values: JSON, never a pickle ---------------------------------------------------


def _nan(bits: str) -> float:
    return struct.unpack(">d", bytes.fromhex(bits))[0]


VALUES: dict[str, Any] = {
    "epoch": 3,
    "big": -(2 ** 80) + 1,
    "floats": (0.1, -0.0, 1e308, 5e-324, float("inf"), float("-inf"), _nan("7ff8000000000123"),
               _nan("fff0000000000001")),
    "text": "héllo ✓ \x00 \"quoted\" \\",
    "flags": [True, False, None, 1, 2.5, "x", [3, [4, []]]],
    "nothing": None,
    "on": False,
    "betas": (0.9, 0.999, {"eps": 1e-8, 2: "two", (1, "k"): [None]}),
    "ordered": (OrderedDict([("b", 1), ("a", 2)]), {}),
    "cfg": {"optim": {"name": "adamw", "groups": 2}},  # flattened by DCP: cfg.optim.name, ...
}


def _placeholders(values: dict[str, Any]) -> dict[str, Any]:
    """The values' keys with None at each leaf DCP saves (it flattens nested dicts)."""
    return {k: _placeholders(v) if type(v) is dict and v else None for k, v in values.items()}


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit, types included (floats by their IEEE 754 bits, NaNs too)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return (list(a) == list(b) and all(_same(k, j) for k, j in zip(a, b, strict=True))
                and all(_same(a[k], b[k]) for k in a))
    return bool(a == b)


def _values_job(rank: int, port: int, run_dir: str) -> None:
    mesh = _mesh(rank, port)
    ref = _reference(0)
    dcp.save({**_state(mesh, ref), **VALUES}, storage_writer=Writer(run_dir, step=10))
    for placements, reader in ((SHARDED, Reader(run_dir)), (RESHARDED, Reader(run_dir)),
                               (SHARDED, FileSystemReader(Reader(run_dir).checkpoint_id))):
        got = {**_zeros(mesh, placements), **_placeholders(VALUES)}
        dcp.load(got, storage_reader=reader)
        _check(got, ref)
        for key, value in VALUES.items():
            assert _same(got[key], value), f"{key}: {got[key]!r} is not {value!r}"
    dist.destroy_process_group()


def test_non_tensor_values_round_trip_bit_exact_as_json_resharded_and_for_stock_readers(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _join(_spawn(_values_job, str(run_dir)))
    manifest = read_manifest(RemoteTier(str(run_dir / "checkpoints")), dcp_name(10))
    values = {i["fqn"]: i["value"] for i in manifest["items"] if i["encoding"] == "bytes"}
    assert values["floats"]["$tuple"][6] == {"$float": "7ff8000000000123"}
    assert values["cfg.optim.name"] == "adamw"
    assert values["betas"] == {"$tuple": [0.9, 0.999, {"$dict": [
        ["eps", 1e-08], [2, "two"], [{"$tuple": [1, "k"]}, [None]]]}]}
    assert manifest["format_version"] == 2


@pytest.mark.parametrize(("value", "named"), [
    ({1, 2}, "item 'v': a value of type set cannot be saved"),
    (b"raw", "item 'v': a value of type bytes cannot be saved"),
    ((torch.ones(2),), "item 'v': a value of type torch.Tensor (at [0]) cannot be saved"),
    (Fraction(1, 3), "item 'v': a value of type fractions.Fraction cannot be saved"),
])
def test_a_non_tensor_value_without_a_json_form_fails_the_save_naming_it(
        tmp_path: Path, value: Any, named: str) -> None:
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"x": torch.ones(2), "v": value}, storage_writer=Writer(tmp_path, step=4),
                 no_dist=True)
    error = caught.value.failures[0][0]
    assert isinstance(error, CheckpointFormatError)
    assert str(error).startswith(f"dcp_step_00000004 (step 4): {named}: ckptpilot stores a "
                                 "non-tensor value as JSON")
    assert "Put each tensor in the state dict as an entry of its own" in str(error)
    assert dcp_name(4) not in RemoteTier(str(tmp_path / "checkpoints")).list()
    with pytest.raises(NoCheckpointError):
        Reader(tmp_path)


@pytest.mark.parametrize(("doc", "fault"), [
    ({"$float": "7ff8"}, "$float '7ff8' is not 16 hex digits"),
    ({"$float": "zz" * 8}, "$float 'zzzzzzzzzzzzzzzz': non-hexadecimal"),
    ({"eps": 1.0}, "{'eps': 1.0} is not an encoded value"),
    ({"$tuple": 3}, "$tuple holds 3, not a list"),
    ({"$dict": [[[1], 2]]}, "$dict key [1]: unhashable type"),
    ({"$dict": [["a", 1], ["a", 2]]}, "$dict repeats a key"),
    ({"$dict": [["a"]]}, "$dict entry ['a'] is not a [key, value] pair"),
    (float("nan"), "a non-finite float must be a $float tag"),
    (functools.reduce(lambda d, _: [d], range(MAX_DEPTH + 1), 0), "nested deeper than 64"),
])
def test_a_malformed_value_document_is_refused_naming_where(doc: Any, fault: str) -> None:
    with pytest.raises(CheckpointFormatError) as caught:
        decode_value(doc, "m.json: items[0] ('v'): value")
    assert str(caught.value).startswith("m.json: items[0] ('v'): value: ")
    assert fault in str(caught.value)


class _TouchOnLoad:
    """Unpickled, creates ``marker``: the code a crafted checkpoint would run (a real
    attacker's payload would be ``os.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _save_job(rank: int, port: int, run_dir: str) -> None:
    mesh = _mesh(rank, port)
    dcp.save(_state(mesh, _reference(0)), storage_writer=Writer(run_dir, step=10))
    dist.destroy_process_group()


def _craft(directory: Path, marker: Path, *, version: int, keep_value: bool) -> None:
    """What an attacker with write access to the storage does: put a pickle that runs code
    in place of the "epoch" item's bytes, and make every digest match again (the item's, its
    rank's part, the commit file's own)."""
    manifest = json.loads((directory / "manifest.json").read_bytes())
    target = next(i for i in manifest["items"] if i["fqn"] == "epoch")
    evil = io.BytesIO()
    torch.save(_TouchOnLoad(marker), evil)
    mine = sorted((i for i in manifest["items"] if i["file"] == target["file"]),
                  key=lambda i: i["at"])
    old = (directory / target["file"]).read_bytes()
    out, at = bytearray(), 0
    for item in mine:
        payload = evil.getvalue() if item is target else old[item["at"]:item["at"] + item["bytes"]]
        item.update(at=at, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        out += payload
        at += len(payload)
    (directory / target["file"]).write_bytes(bytes(out))
    if not keep_value:
        target.pop("value", None)
    manifest["format_version"] = version
    for rank in manifest["parts"]:
        lines = sorted(
            f"{i['fqn']}\0{'-' if i['offset'] is None else ','.join(map(str, i['offset']))}"
            f"\0{i['sha256']}" + ("" if "value" not in i else "\0" + hashlib.sha256(
                canonical(i["value"]).encode()).hexdigest()) + "\n"
            for i in manifest["items"] if str(i["rank"]) == rank)
        manifest["parts"][rank] = hashlib.sha256("".join(lines).encode()).hexdigest()
    body = {k: v for k, v in manifest.items() if k != "self_sha256"}
    manifest["self_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()
                                             ).hexdigest()
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _forget_rows(run_dir: Path) -> None:
    """Delete the metadata store: no rows to check the parts against."""
    for suffix in ("", "-wal", "-shm"):
        (run_dir / f"metadata.sqlite{suffix}").unlink(missing_ok=True)


def _load_whole(run_dir: Path, step: int | None, *, epoch: bool = True) -> dict[str, Any]:
    """Both ranks' parts into this one process."""
    full = {k: torch.zeros_like(v) for k, v in _reference(0).items()}
    state: dict[str, Any] = {"model": {"w": full["w"], "h": full["h"]}, "plain": full["plain"],
                             "count": full["count"], **({"epoch": 0} if epoch else {})}
    dcp.load(state, storage_reader=Reader(run_dir, step=step), no_dist=True)
    return state


def test_crafted_sharded_checkpoint_cannot_run_code(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    _join(_spawn(_save_job, str(run_dir)))
    directory = run_dir / "checkpoints" / dcp_name(10)
    pristine = {p.name: p.read_bytes() for p in directory.iterdir()}
    _forget_rows(run_dir)

    # The format whose "bytes" items were pickles: refused naming the item, nothing unpickled.
    _craft(directory, marker, version=1, keep_value=False)
    item = next(i for i in json.loads((directory / "manifest.json").read_bytes())["items"]
                if i["fqn"] == "epoch")
    where = (f"{directory}/{item['file']}: item 'epoch' (bytes {item['at']}.."
             f"{item['at'] + item['bytes']}): ")
    with pytest.raises(CheckpointException) as caught:
        _load_whole(run_dir, 10)
    assert not marker.exists(), "loading the crafted checkpoint ran its code"
    (error, _), = caught.value.failures.values()
    assert isinstance(error, CheckpointFormatError)
    assert str(error).startswith(where + "a non-tensor value that ckptpilot before DCP format "
                                 "version 2 stored only as a pickle; ckptpilot never "
                                 "unpickles a checkpoint, so it does not load it")

    # validate --rebuild records it again (its hashes all match) without unpickling; the
    # newest valid step then refuses the item on load, as above.
    out = io.StringIO()
    assert ops.validate(load_policy(None, run_dir=run_dir), rebuild=True, out=out) == 0
    assert "its non-tensor item(s) 'epoch' are pickles (DCP format version 1)" in out.getvalue()
    with pytest.raises(CheckpointException, match="stored only as a pickle") as caught:
        _load_whole(run_dir, None)
    assert where in str(caught.value)
    assert not marker.exists(), "validate --rebuild or the load ran the crafted code"
    # Leaving the refused key out loads the rest of that checkpoint, bit for bit.
    _check({**_load_whole(run_dir, 10, epoch=False), "epoch": 3}, _reference(0))

    # Today's format without the value: refused on reading the commit file.
    _forget_rows(run_dir)  # the rebuilt rows would catch the new part digests
    for name, raw in pristine.items():
        (directory / name).write_bytes(raw)
    _craft(directory, marker, version=2, keep_value=False)
    with pytest.raises(CheckpointException) as caught:
        _load_whole(run_dir, 10)
    assert "('epoch'): a non-tensor item without its JSON value (ckptpilot does not read the " \
           "pickle beside it)" in str(caught.value)
    assert not marker.exists()

    # With its value, the pickle beside it is never read: the value loads, no code runs.
    for name, raw in pristine.items():
        (directory / name).write_bytes(raw)
    _craft(directory, marker, version=2, keep_value=True)
    assert _load_whole(run_dir, 10)["epoch"] == 3
    assert not marker.exists()
