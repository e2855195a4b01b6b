"""The pilot on sharded state: an FSDP2 model (``fully_shard`` on a CPU mesh, gloo) with AdamW,
saved by 4 ranks through ckptpilot.dcp and restored into 2 and 3 ranks bit-exactly, training
on like a reference that made the same reshard through stock DCP; a SIGKILL of every rank
mid-save and a corrupted chunk both walk every rank back to the same older step; the data
cursor's redistribution is exact.

The ranks are started by ``torch.multiprocessing.start_processes`` with ``fork`` (a spawned
child imports torch, DCP and ckptpilot again, several times what the job itself takes). Every
job asserts in the child, and leaves what the parent compares as JSON."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import textwrap
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptpilot import CheckpointPilot
from ckptpilot.assembly import remote_tier
from ckptpilot.capture.sharded import resume_cursor
from ckptpilot.catalog import Catalog
from ckptpilot.dcp import dcp_name
from ckptpilot.dcp.storage import read_manifest
from ckptpilot.errors import StateError
from ckptpilot.restorer import Read, Restorer
from ckptpilot.rundir import read_run_id
from ckptpilot.sampler import ResumableSampler
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Level, RecoverySource, RetentionClass, Status

SAVED_WORLD = 4
SAMPLES, SEED, BATCH = 50, 3, 2  # 50 samples: epoch 0 ends inside a step of 4 or 3 ranks
FIRST_SAVE, SECOND_SAVE, MORE_STEPS = 3, 6, 10
JOIN_SECONDS = 180  # a safety net for a hung collective, never a speed assertion
POLICY = textwrap.dedent("""\
    scheduler: {base_interval: 1000, max_interval: 100000, young_daly: false,
                weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0}}
    validation: {load_test: none}
    observability: {tensorboard: false, decision_log: false}
    """)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]


# -- the job's pieces -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(fn: Any, world: int, *args: Any) -> mp.ProcessContext:
    """``fn(rank, world, port, *args)`` on ``world`` ranks; the caller joins."""
    ctx = mp.start_processes(fn, args=(world, _free_port(), *args), nprocs=world, join=False,
                             start_method="fork")
    assert ctx is not None
    return ctx


def _run(fn: Any, world: int, *args: Any) -> None:
    ctx = _start(fn, world, *args)
    while not ctx.join(timeout=JOIN_SECONDS):
        pass


def _mesh(rank: int, world: int, port: int) -> Any:
    warnings.simplefilter("ignore")  # DCP and FSDP warn about defaults on every call
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return init_device_mesh("cpu", (world,))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(SAMPLES, 5, generator=torch.Generator().manual_seed(1))
    return x, torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(2))


def _build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """An FSDP2 model whose rows do not divide among 3 or 4 ranks (one rank's shard of the
    last layer is empty), AdamW and a cosine schedule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 14), torch.nn.Tanh(), torch.nn.Linear(14, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
          idx: torch.Tensor) -> float:
    x, y = _data()
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return float(loss)


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every global tensor of the model and optimizer, unsharded (collective)."""
    msd, osd = get_state_dict(model, opt)
    full = {f"model/{k}": v.full_tensor() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for k, v in state.items():
            full[f"opt/{fqn}/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return full


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8),
                           tensor.reshape(-1).view(torch.uint8)), f"{key} differs bit-wise"


def _pilot(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
           sampler: ResumableSampler) -> CheckpointPilot:
    return CheckpointPilot(out / "policy.yaml", model=model, optimizer=opt, lr_scheduler=sched,
                           data_state=sampler, run_dir=out / "run")


def _stream_index(g: int) -> int:
    """The sample at position ``g`` of the epochs' stream (epoch e is [e*n, (e+1)*n))."""
    epoch, at = divmod(g, SAMPLES)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
    return int(order[at])


def _write(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))


# -- the run that saves: 4 ranks ----------------------------------------------------------------


def _save_job(rank: int, world: int, port: int, out: Path, kill_at: int | None) -> None:
    """Trains 6 steps; the pilot saves step 3 (a pulse: through the codecs) and step 6 (an
    organ, at close: a plain DCP checkpoint). Leaves the
    unsharded tensors of both steps, each rank's RNG state, and a stock DCP checkpoint of
    step 6 (FileSystemWriter) for the reference. With ``kill_at``: every rank SIGKILLs
    itself inside that step's save, once its part is written."""
    mesh = _mesh(rank, world, port)
    model, opt, sched = _build(mesh)
    sampler = ResumableSampler(SAMPLES, seed=SEED, num_replicas=world, rank=rank)
    if kill_at is not None:
        from ckptpilot.dcp import writer as dcp_writer

        original = dcp_writer.Writer.write_data

        def write_then_die(self: Any, *args: Any) -> Any:
            done = original(self, *args)
            if self.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        dcp_writer.Writer.write_data = write_then_die  # type: ignore[method-assign]
    pilot = _pilot(out, model, opt, sched, sampler)
    assert pilot.restore() == 0
    taken = []
    for step in range(1, SECOND_SAVE + 1):
        idx = sampler.take(BATCH)
        taken += idx.tolist()
        pilot.observe(_step(model, opt, sched, idx))
        if step == FIRST_SAVE:
            assert pilot.save("pulse")
            pilot.flush()
            full = _full(model, opt)
            if rank == 0:
                safetensors.torch.save_file(full, out / f"full_{step}.safetensors")
        if step == kill_at:
            pilot.save()
            pilot.flush()
            raise AssertionError("the save of the kill step must not complete")
    full = _full(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(out / "stock"))
    safetensors.torch.save_file({"rng": torch.get_rng_state()}, out / f"rng_{rank}.safetensors")
    if rank == 0:
        safetensors.torch.save_file(full, out / f"full_{SECOND_SAVE}.safetensors")
        _write(out / "sched.json", sched.state_dict())
    _write(out / f"taken_{rank}.json", taken)
    pilot.close()  # saves step 6
    assert [(s.step, s.level.value) for s in pilot.saves] == [(FIRST_SAVE, "pulse"),
                                                              (SECOND_SAVE, "organ")]
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run saved by 4 ranks at steps 3 and 6, with its references."""
    out = tmp_path_factory.mktemp("sharded")
    (out / "policy.yaml").write_text(POLICY)
    _run(_save_job, SAVED_WORLD, out, None)
    return out


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    """A copy of the saved run for one test to restore (restores change rows)."""
    shutil.copytree(saved, tmp_path / "out")
    return tmp_path / "out"


# -- restored into fewer ranks --------------------------------------------------------------------


def _resume_job(rank: int, world: int, port: int, out: Path, expect: int) -> None:
    """Restores with ``world`` ranks and checks every global tensor against the unsharded
    reference of step ``expect``; at step 6, trains 10 more steps beside a reference that
    made the same reshard through stock DCP, on the samples the stream gives each rank."""
    mesh = _mesh(rank, world, port)
    model, opt, sched = _build(mesh)
    sampler = ResumableSampler(SAMPLES, seed=SEED, num_replicas=world, rank=rank)
    pilot = _pilot(out, model, opt, sched, sampler)
    assert pilot.restore() == expect
    report = pilot.last_recovery
    assert report is not None and report.step == expect
    _assert_bit_equal(_full(model, opt), safetensors.torch.load_file(
        out / f"full_{expect}.safetensors"))
    result: dict[str, Any] = {"step": expect, "source": report.source.value,
                              "skipped": [[s.location, s.reason] for s in report.skipped]}
    if expect == SECOND_SAVE:
        if rank < SAVED_WORLD:  # each rank resumes the RNG of the saved rank it continues
            saved_rng = safetensors.torch.load_file(out / f"rng_{rank}.safetensors")["rng"]
            assert torch.equal(torch.get_rng_state(), saved_rng)
        reference = _stock_reference(mesh, out, rank, world)
        losses = []
        for step in range(MORE_STEPS):
            idx = sampler.take(BATCH)
            assert idx.tolist() == reference["indices"][step], f"step {step}: other samples"
            losses.append(_step(model, opt, sched, idx).hex())
            pilot.observe(float.fromhex(losses[-1]))
        assert losses == reference["losses"], "the continuation differs from stock DCP's"
        result["losses"] = losses
    pilot.close(save=False)
    _write(out / f"resumed_{world}_{rank}.json", result)
    dist.destroy_process_group()


def _stock_reference(mesh: Any, out: Path, rank: int, world: int) -> dict[str, Any]:
    """Step 6 resharded by stock DCP (FileSystemReader, set_state_dict), then 10 steps on the
    rest of the stream: rank r of M takes positions 48 + r + M*i (the 4 ranks consumed 48)."""
    model, opt, sched = _build(mesh)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=FileSystemReader(out / "stock"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(json.loads((out / "sched.json").read_text()))
    consumed = SAVED_WORLD * BATCH * SECOND_SAVE
    indices, losses = [], []
    for step in range(MORE_STEPS):
        positions = [consumed + rank + world * (BATCH * step + i) for i in range(BATCH)]
        indices.append([_stream_index(g) for g in positions])
        losses.append(_step(model, opt, sched, torch.tensor(indices[-1])).hex())
    return {"indices": indices, "losses": losses}


@pytest.mark.crash
@pytest.mark.parametrize("world", [2, 3])
def test_four_ranks_restore_into_fewer_bit_exact_and_train_on_like_stock_dcp(
        copy: Path, world: int) -> None:
    _run(_resume_job, world, copy, SECOND_SAVE)

    results = [json.loads((copy / f"resumed_{world}_{r}.json").read_text())
               for r in range(world)]
    assert {(r["step"], r["source"]) for r in results} == {(SECOND_SAVE, "remote")}
    assert all(len(r["losses"]) == MORE_STEPS for r in results)
    # Epoch 0 (50 samples): 48 taken by the 4 ranks, the last 2 by the first resumed step.
    before = [i for r in range(SAVED_WORLD)
              for i in json.loads((copy / f"taken_{r}.json").read_text())]
    first_after = [_stream_index(SAVED_WORLD * BATCH * SECOND_SAVE + r) for r in range(2)]
    assert Counter(before + first_after) == Counter(range(SAMPLES)), "epoch 0 not exact"


def test_the_organ_of_a_sharded_run_loads_with_stock_dcp_into_one_process(saved: Path) -> None:
    want = safetensors.torch.load_file(saved / f"full_{SECOND_SAVE}.safetensors")
    state = {name: torch.zeros_like(t) for name, t in want.items() if name.startswith("model/")}
    directory = saved / "run" / "checkpoints" / dcp_name(SECOND_SAVE)
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    _assert_bit_equal(state, {k: v for k, v in want.items() if k in state})


# -- another mesh shape ---------------------------------------------------------------------------


def _mesh_job(rank: int, world: int, port: int, out: Path, shape: tuple[int, ...]) -> None:
    """A linear layer whose weight is sharded on both dimensions of a (dp, tp) mesh, or on
    the second of a 1-D one, with AdamW; the first run trains 2 steps and saves at close."""
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", shape)
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 10)
    placements = [Shard(0), Shard(1)] if len(shape) == 2 else [Shard(1)]
    layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, placements))
    layer.bias = torch.nn.Parameter(distribute_tensor(layer.bias.detach(), mesh,
                                                      [Replicate()] * len(shape)))
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    pilot = CheckpointPilot(out / "policy.yaml", model=layer, optimizer=opt, run_dir=out / "run")
    first = pilot.restore() == 0
    for _ in range(2 if first else 0):
        ((layer.weight * layer.weight).sum() + layer.bias.sum()).backward()
        opt.step()
        opt.zero_grad()
        pilot.observe(1.0)
    assert pilot.step == 2
    full = _full(layer, opt)
    if rank == 0:
        safetensors.torch.save_file(full, out / f"mesh_{len(shape)}d.safetensors")
    pilot.close(save=first)
    dist.destroy_process_group()


@pytest.mark.crash
def test_a_two_dimensional_mesh_restores_into_another_mesh_shape_bit_exact(
        tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    _run(_mesh_job, 4, tmp_path, (2, 2))
    _run(_mesh_job, 3, tmp_path, (3,))
    _assert_bit_equal(safetensors.torch.load_file(tmp_path / "mesh_1d.safetensors"),
                      safetensors.torch.load_file(tmp_path / "mesh_2d.safetensors"))


# -- walking back together --------------------------------------------------------------------


def _flip_chunk(out: Path, step: int, rank: int, fqn: str) -> str:
    """Flip one byte inside the chunk of ``fqn`` the saved ``rank`` wrote; names the item."""
    directory = out / "run" / "checkpoints" / dcp_name(step)
    manifest = read_manifest(RemoteTier(str(directory.parent)), dcp_name(step))
    item, = (i for i in manifest["items"] if i["rank"] == rank and i["fqn"] == fqn)
    with open(directory / item["file"], "r+b") as f:
        f.seek(item["at"] + item["bytes"] - 30)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    return f"{item['file']}: item {item['fqn']!r}"


def _statuses(out: Path) -> dict[tuple[int, int], Status]:
    run = out / "run"
    with MetadataStore(run / "metadata.sqlite", read_only=True) as store:
        return {(r.step, r.rank): r.status for r in store.rows(read_run_id(run))}


@pytest.mark.crash
def test_a_corrupted_chunk_of_one_rank_walks_every_rank_back_together(copy: Path) -> None:
    # Restored into 2 ranks, the second reads the rows 7..13 of the first layer's weight,
    # two of them from the chunk saved rank 3 wrote (rows 12..13).
    item = _flip_chunk(copy, SECOND_SAVE, rank=3, fqn="model/0.weight")
    _run(_resume_job, 2, copy, FIRST_SAVE)

    results = [json.loads((copy / f"resumed_2_{r}.json").read_text()) for r in range(2)]
    assert {r["step"] for r in results} == {FIRST_SAVE}
    for result in results:
        (location, reason), = result["skipped"]
        assert location.endswith(dcp_name(SECOND_SAVE))
        assert item in reason or "another rank" in reason
    assert any(item in r["skipped"][0][1] for r in results), "no rank named the item"
    statuses = _statuses(copy)
    assert {statuses[SECOND_SAVE, r] for r in range(SAVED_WORLD)} == {Status.CORRUPTED}
    assert {statuses[FIRST_SAVE, r] for r in range(SAVED_WORLD)} == {Status.VALID}


@pytest.mark.crash
def test_a_sigkill_of_every_rank_mid_save_restores_every_rank_to_the_older_step(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "policy.yaml").write_text(POLICY)
    ctx = _start(_save_job, 2, out, SECOND_SAVE)
    for process in ctx.processes:  # each rank dies on its own: no join terminates the other
        process.join(JOIN_SECONDS)
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGKILL] * 2
    checkpoints = out / "run" / "checkpoints"
    assert any(".staging-" in name for name in os.listdir(checkpoints)), "no save was cut"

    _run(_resume_job, 3, out, FIRST_SAVE)  # into more ranks than saved it

    results = [json.loads((out / f"resumed_3_{r}.json").read_text()) for r in range(3)]
    assert {r["step"] for r in results} == {FIRST_SAVE}
    for result in results:
        (location, reason), = result["skipped"]
        assert location.endswith(dcp_name(SECOND_SAVE))
        assert "corrupted" in reason
    assert sorted(os.listdir(checkpoints)) == [dcp_name(FIRST_SAVE)], "staging debris left"
    statuses = _statuses(out)
    assert {statuses[SECOND_SAVE, r] for r in range(2)} == {Status.CORRUPTED}


# -- the data cursor (no processes) -------------------------------------------------------------


def _stream(n: int, seed: int, upto: int) -> Iterator[tuple[int, int]]:
    """(epoch, index) of the stream's first ``upto`` positions."""
    for g in range(upto):
        epoch, at = divmod(g, n)
        yield epoch, int(torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
                         [at])


def _take_round(samplers: list[ResumableSampler], k: int, seen: list[tuple[int, int]]) -> None:
    for sampler in samplers:
        for _ in range(k):  # one at a time: ``epoch`` is then the epoch of that sample
            index = int(sampler.take(1))
            seen.append((sampler.epoch, index))


@pytest.mark.parametrize(("degrees", "k"), [((4, 3, 2), 2), ((2, 5, 1), 3), ((3, 3, 4), 4)])
def test_redistributed_cursors_see_every_sample_of_each_epoch_exactly_once(
        degrees: tuple[int, ...], k: int) -> None:
    n, seen = 23, []
    samplers = [ResumableSampler(n, seed=5, num_replicas=degrees[0], rank=r)
                for r in range(degrees[0])]
    for degree in degrees[1:]:
        for _ in range(4):
            _take_round(samplers, k, seen)
        states = json.loads(json.dumps([s.state_dict() for s in samplers]))
        samplers = [ResumableSampler(n, seed=5, num_replicas=degree, rank=r)
                    for r in range(degree)]
        for sampler in samplers:
            sampler.load_resharded(states)
    for _ in range(4):
        _take_round(samplers, k, seen)
    assert Counter(seen) == Counter(_stream(n, 5, len(seen)))


def test_a_split_cursor_refuses_counts_that_are_not_one_prefix_and_a_state_of_another_rank(
        ) -> None:
    samplers = [ResumableSampler(10, num_replicas=2, rank=r) for r in range(2)]
    samplers[0].take(3)
    samplers[1].take(1)
    states = [s.state_dict() for s in samplers]
    with pytest.raises(StateError, match=r"took \[3, 1\] samples each.*same number"):
        ResumableSampler(10, num_replicas=3, rank=0).load_resharded(states)
    with pytest.raises(StateError, match="load_resharded"):
        ResumableSampler(10, num_replicas=3, rank=0).load_state_dict(states[0])
    with pytest.raises(StateError, match="rank 1 of 2, not rank 0 of 2"):
        ResumableSampler(10, num_replicas=3, rank=0).load_resharded(states[::-1])


class _OwnCursor:
    """A user's cursor: positions per rank, no word on how it is split."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def test_a_cursor_that_cannot_be_redistributed_is_refused_naming_the_fix() -> None:
    own = {r: ({"position": 8}, None) for r in range(4)}
    with pytest.raises(StateError, match=r"saved by 4 ranks.*this run has 2.*num_replicas"):
        resume_cursor(_OwnCursor(), own, rank=0, world_size=2, saved_world_size=4)
    cursor = _OwnCursor()
    resume_cursor(cursor, own, rank=1, world_size=4, saved_world_size=4)()
    assert cursor.position == 8, "the same world size loads the rank's own cursor"

    split = _OwnCursor()
    split.num_replicas, split.rank = 2, 0  # type: ignore[attr-defined]
    saved = {r: ({"position": 8}, {"degree": 4, "rank": r}) for r in range(4)}
    with pytest.raises(StateError, match="no load_resharded"):
        resume_cursor(split, saved, rank=0, world_size=2, saved_world_size=4)
    global_cursor = ResumableSampler(10)  # one cursor every rank holds: degree 1
    global_cursor.take(7)
    replicated = {r: (global_cursor.state_dict(), {"degree": 1, "rank": 0}) for r in range(4)}
    resumed = ResumableSampler(10)
    resume_cursor(resumed, replicated, rank=1, world_size=2, saved_world_size=4)()
    assert resumed.state_dict() == global_cursor.state_dict()


# -- replicated state across a world-size change (no processes) --------------------------------


def test_a_memory_copy_of_another_world_size_is_passed_over_for_the_remote_tier(
        tmp_path: Path) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(POLICY + "tiers: {memory: {enabled: true}}\n")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Rank 0 of a 2-rank (DDP) run: its memory tier and its archive hold the replicated state.
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=tmp_path / "run", rank=0,
                            world_size=2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    pilot.observe(1.0)
    assert pilot.save()
    pilot.flush()
    assert pilot.memory is not None and pilot.memory.steps() == [1]
    # The same copies, seen by a run of one rank.
    restorer = Restorer(Catalog(pilot.store, pilot.run_id, 0, tmp_path / "run"),
                        [remote_tier(pilot.remote, rank=0)], pilot.memory, None, world_size=1)
    reads: list[Read] = []
    restored = restorer.restore(None, reads.append)
    assert restored is not None and restored.step == 1
    assert [r.source for r in reads] == [RecoverySource.REMOTE]
    (skipped,) = restored.skipped
    assert skipped.location == "memory:step 1"
    assert "saved by a run of 2 ranks and this one has 1" in skipped.reason
    assert "never trusted across a world-size change" in skipped.reason
    pilot.close(save=False)


# -- the disk budget on sharded saves ---------------------------------------------------------


BUDGET_WIDTH = 256  # Linear(256, 256) + AdamW: ~0.79 MB of state, ~0.39 MB a rank


def _budget_job(rank: int, world: int, port: int, out: Path, max_bytes: int) -> None:
    """Saves every step for 8 steps under ``retention.max_bytes``; after each save (flushed)
    rank 0 records the DCP directories on disk and their bytes. One torch thread: this
    layer is large enough for torch to run parallel regions, and a child forked from a
    parent whose OpenMP threads ran cannot start its own (libgomp is not fork-safe)."""
    torch.set_num_threads(1)
    mesh = _mesh(rank, world, port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BUDGET_WIDTH, BUDGET_WIDTH))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (out / "policy.yaml").write_text(POLICY + f"retention: {{max_bytes: {max_bytes}}}\n")
    pilot = CheckpointPilot(out / "policy.yaml", model=model, optimizer=opt, run_dir=out / "run")
    x = torch.randn(4, BUDGET_WIDTH, generator=torch.Generator().manual_seed(rank))
    seen = []
    for _ in range(8):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        pilot.observe(1.0)
        pilot.save()
        pilot.flush()
        dirs = sorted(p for p in (out / "run" / "checkpoints").glob("dcp_step_*")
                      if p.is_dir())
        seen.append({"dirs": [p.name for p in dirs],
                     "bytes": sum(f.stat().st_size for p in dirs for f in p.rglob("*")
                                  if f.is_file())})
    pilot.close(save=False)
    _write(out / f"budget_{rank}.json", seen)
    dist.destroy_process_group()


def test_the_disk_budget_prunes_for_sharded_saves_and_refuses_on_every_rank_together(
        tmp_path: Path) -> None:
    roomy, tight = tmp_path / "roomy", tmp_path / "tight"
    roomy.mkdir()
    tight.mkdir()
    # Each save is estimated at (its part + 1 MiB) x 2 ranks: 5 MB leaves room for two kept.
    _run(_budget_job, 2, roomy, 5_000_000)
    seen = json.loads((roomy / "budget_0.json").read_text())
    assert all(len(s["dirs"]) <= 3 and s["bytes"] <= 5_000_000 for s in seen), seen
    assert [s["dirs"][-1] for s in seen] == [dcp_name(step) for step in range(1, 9)]
    assert len(seen[-1]["dirs"]) < 8  # pruned while training
    with MetadataStore(roomy / "run" / "metadata.sqlite", read_only=True) as store:
        assert store.audit_log("save-refused") == []
    _run(_budget_job, 2, tight, 1 << 20)  # below the estimate of one save
    for rank in (0, 1):
        assert all(s["dirs"] == [] for s in json.loads(
            (tight / f"budget_{rank}.json").read_text()))
    with MetadataStore(tight / "run" / "metadata.sqlite", read_only=True) as store:
        refused = Counter((e.details["step"], e.details["rank"])
                          for e in store.audit_log("save-refused"))
        assert refused == Counter((step, rank) for step in range(1, 9) for rank in (0, 1))
        for entry in store.audit_log("save-refused"):
            assert ("retention.max_bytes 1048576" if entry.details["rank"] == 0
                    else "rank 0's log says why") in entry.details["reason"]
        assert store.rows(read_run_id(tight / "run")) == []


# -- the sharded tier's own validation (no processes) -------------------------------------------


def test_the_paranoid_read_back_refuses_a_part_damaged_after_its_write_and_publishes_nothing(
        tmp_path: Path) -> None:
    from ckptpilot.assembly import sharded_tier
    from ckptpilot.policy import Policy
    from ckptpilot.tiers.base import CheckpointImage

    policy = Policy().with_run_dir(tmp_path / "run")
    policy = policy.model_copy(update={"validation": policy.validation.model_copy(
        update={"paranoid": True, "sha256": True})})
    tier = sharded_tier(policy, RemoteTier(f"file://{tmp_path}/dcp"), rank=0, world_size=1,
                        group=None)
    weight = torch.arange(64, dtype=torch.float32)
    image = CheckpointImage.copied(5, {"step": 5, "rank": 0, "world_size": 1},
                                   {"model/w": weight}, level=Level.ORGAN, reason="test",
                                   retention_class=RetentionClass.ROUTINE, score=None)
    staged = tier.stage(image)
    assert staged.location.rsplit("/", 1)[-1].startswith(dcp_name(5) + ".staging-")
    data = Path(staged.location.removeprefix("file://")) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x01  # inside the last item's bytes
    data.write_bytes(raw)
    check = tier.validate(staged)
    assert not check.ok and "read back after writing" in check.reason
    assert "SHA256 mismatch" in check.reason and check.seconds is not None
    aside = tier.abort(staged, check.reason)
    assert aside is not None and f"{dcp_name(5)}.corrupted-" in aside
    assert tier.steps() == [] and not data.exists()
