"""ckptpilot.dcp: DCP's StorageWriter / StorageReader on ckptpilot, with two real gloo ranks
saving plain tensors and DTensors on a 1-D CPU mesh.

The ranks are started by ``torch.multiprocessing.start_processes`` with ``fork``: a spawned
child imports torch, DCP and ckptpilot again, several times what the job itself takes."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import socket
import warnings
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

from ckptpilot import runops
from ckptpilot.dcp import Reader, Writer, dcp_name
from ckptpilot.dcp.format import (
    Encoding,
    ItemRecord,
    build_manifest,
    checkpoint_metadata,
    decode_manifest,
    encode_manifest,
)
from ckptpilot.dcp.storage import read_manifest
from ckptpilot.errors import CheckpointFormatError, IntegrityError, NoCheckpointError
from ckptpilot.policy import Policy, load_policy
from ckptpilot.rundir import read_run_id
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.vocab import Status, Tier

WORLD = 2
SHARDED = (Shard(0), Shard(1))
RESHARDED = (Shard(1), Replicate())
PINNED_MANIFEST_SHA256 = "93dbdb298ffa0012b3fe30b8b8f1e993b09ff097b92518472c2cbae35b12c578"
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
    assert runops.ls(policy, out) == 0
    listed = [line.split() for line in out.getvalue().splitlines()[1:]]
    assert sorted((int(c[0]), int(c[1]), c[4]) for c in listed) == [
        (step, rank, "valid") for step in (10, 20) for rank in range(WORLD)]
    assert runops.validate(policy, rebuild=False, out=out) == 0
    assert "4 ok, 0 corrupted" in out.getvalue()

    # Both ranks' rows of step 10 point at one directory: it goes with them.
    assert runops.prune(policy, dry_run=False, out=out) == 0
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
    assert runops.validate(policy, rebuild=False, out=out) == 1
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
    runops.ls(load_policy(None, run_dir=run_dir), out)
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
    assert runops.prune(policy, dry_run=False, out=out) == 0
    assert sorted(os.listdir(checkpoints)) == [dcp_name(4)], out.getvalue()

    _save_steps(tmp_path, [5, 6])
    assert runops.recover(policy, step=4, dry_run=False, force=False, out=out) == 0
    left = sorted(os.listdir(checkpoints))
    assert left[0] == dcp_name(4) and len(left) == 3
    assert all(".abandoned-by-recover-4-" in name for name in left[1:])
    assert _step_loaded(tmp_path) == (4, 4.0)
    with MetadataStore(tmp_path / "metadata.sqlite", read_only=True) as store:
        statuses = {r.step: r.status for r in store.rows(read_run_id(tmp_path))}
    assert statuses == {1: Status.EXPIRED, 2: Status.EXPIRED, 3: Status.EXPIRED,
                        4: Status.VALID, 5: Status.EXPIRED, 6: Status.EXPIRED}
    with pytest.raises(runops.OpError, match="DCP checkpoint"):
        runops.recover(policy, step=4, dry_run=False, force=True, out=out)


def test_validate_rebuild_records_dcp_checkpoints_again(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    (tmp_path / "metadata.sqlite").unlink()
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"metadata.sqlite{suffix}").unlink(missing_ok=True)
    out = io.StringIO()
    assert runops.validate(load_policy(None, run_dir=tmp_path), rebuild=True, out=out) == 0
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
        MetadataIndex("epoch"): ItemRecord(0, "__0_0.distcp", 0, 10, "a" * 64, Encoding.BYTES),
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
    # Version 1's bytes: a change here is a format change (bump DCP_FORMAT_VERSION).
    assert hashlib.sha256(raw).hexdigest() == PINNED_MANIFEST_SHA256
    manifest = decode_manifest(raw, "pinned")
    metadata = checkpoint_metadata(manifest, "pinned")
    assert metadata.planner_data == {"model.w": ("model", "w"), "epoch": ("epoch",)}
    chunks = metadata.state_dict_metadata["model.w"].chunks  # type: ignore[union-attr]
    assert [list(c.offsets) for c in chunks] == [[0, 0], [2, 0]]
    assert metadata.storage_data[MetadataIndex("model.w", [2, 0])].file == "__1_0.distcp"
    tampered = raw.replace(b'"step": 7', b'"step": 8')
    with pytest.raises(IntegrityError, match="pinned"):
        decode_manifest(tampered, "pinned")
