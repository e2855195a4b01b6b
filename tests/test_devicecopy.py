"""The ordering of a capture's device-to-host copies, proven on CPU
(``ckptpilot.capture.devicecopy``).

A lazy copier stands in for the CUDA side streams: it treats the model's parameters and
buffers, the optimizer's state and the extras' tensors as "device" tensors, and copies
nothing until a fence call asks — the first group at ``before_forward``, both at
``before_optimizer_step`` or ``wait``. A copy that no hook or wait asked for in time is made
after the next steps changed its source, so a missing or misplaced wait saves a WRONG
checkpoint: these tests would see it.
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckptpilot import CheckpointPilot
from ckptpilot.capture import devicecopy
from ckptpilot.capture.devicecopy import Pairs, StepFences
from ckptpilot.capture.state import TrainingComponents, capture

BN = {"model/1.running_mean", "model/1.running_var", "model/1.num_batches_tracked"}


class LazyFence:
    """Copies a group on the first call that needs it (``wait`` only once ``gate`` opens: a
    device whose copies take as long as the test wants)."""

    def __init__(self, groups: tuple[Pairs, Pairs], gate: threading.Event) -> None:
        self._groups = groups
        self._copied = [False, False]
        self._gate = gate
        self._lock = threading.Lock()
        self.copied_by: list[str] = []  # the thread that made each group's copies

    def _copy(self, group: int) -> None:
        with self._lock:
            if self._copied[group]:
                return
            for dst, src in self._groups[group]:
                dst.copy_(src)
            self._copied[group] = True
            self.copied_by.append(threading.current_thread().name)

    def before_forward(self) -> None:
        self._copy(0)

    def before_optimizer_step(self) -> None:
        self._copy(0)
        self._copy(1)

    def wait(self) -> None:
        assert self._gate.wait(timeout=120), "the test never opened the gate"
        self.before_optimizer_step()


class LazyCopier:
    """A :class:`~ckptpilot.capture.devicecopy.DeviceCopier` whose "device" is the tensors that
    ``device_tensors()`` lists (CPU tensors, told apart by their memory)."""

    def __init__(self, device_tensors: Callable[[], Iterator[torch.Tensor]]) -> None:
        self._device_tensors = device_tensors
        self.gate = threading.Event()
        self.fences: list[LazyFence] = []

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in {t.data_ptr() for t in self._device_tensors()}

    def start(self, first: Pairs, second: Pairs) -> LazyFence:
        fence = LazyFence((first, second), self.gate)
        self.fences.append(fence)
        return fence


def policy_file(tmp_path: Path) -> Path:
    """Saves only when told (no interval, no signal can trigger one)."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(textwrap.dedent("""\
        scheduler: {base_interval: 100000, min_interval: 1, max_interval: 100000,
                    young_daly: false, weights: {loss: 1.0, grad: 0.0, system: 0.0},
                    loss: {slope_threshold: 1000.0}}
        observability: {tensorboard: false, decision_log: false}
        retention: {auto: false}
        """))
    return cfg


class LazyDevice:
    """What the test puts in ``devicecopy.copier_for``: each pilot gets a lazy copier whose
    "device" is the tensors of the newest :class:`Job`."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.copiers: list[LazyCopier] = []

    def copier_for(self, model: torch.nn.Module) -> LazyCopier:
        job = self.jobs[-1]
        assert job.model is model
        copier = LazyCopier(job.device_tensors)
        self.copiers.append(copier)
        return copier


class Job:
    """A model with a BatchNorm layer (its forward writes buffers), AdamW, and an EMA in the
    extras updated after each optimizer step; seeded by ``seed``."""

    def __init__(self, tmp_path: Path, seed: int, device: LazyDevice) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                         torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        self.extras_ema = torch.zeros(16)
        device.jobs.append(self)
        self.pilot = CheckpointPilot(policy_file(tmp_path), model=self.model,
                                     optimizer=self.opt, run_dir=tmp_path / "run")
        self.copier = device.copiers[-1]
        self.pilot.extras["ema"] = self.extras_ema

    def device_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        yield from self.model.buffers()
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        yield self.extras_ema

    def train(self, steps: int, via_submodules: bool = False) -> None:
        """``via_submodules``: call the layers one by one, never the model itself."""
        for _ in range(steps):
            out = self.x
            for layer in self.model if via_submodules else [self.model]:
                out = layer(out)
            loss = torch.nn.functional.mse_loss(out, self.y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.pilot.extras["ema"].mul_(0.9).add_(self.model[0].weight.detach()[:, 0], alpha=0.1)
            self.pilot.observe(loss)

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor the test compares, cloned."""
        tensors = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            tensors.update((f"opt/{pid}/{k}", v.clone()) for k, v in st.items())
        tensors["ema"] = self.pilot.extras["ema"].clone()
        return tensors


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> set[str]:
    """The keys whose tensors differ in any bit."""
    assert a.keys() == b.keys()
    return {k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].contiguous().reshape(-1).view(torch.uint8),
                               b[k].contiguous().reshape(-1).view(torch.uint8))}


@pytest.fixture
def lazy_device(monkeypatch: pytest.MonkeyPatch) -> LazyDevice:
    """Pilots built in the test copy lazily (the seam: the assembly asks
    ``devicecopy.copier_for``)."""
    device = LazyDevice()
    monkeypatch.setattr(devicecopy, "copier_for", device.copier_for)
    return device


def restored_state(tmp_path: Path, step: int, device: LazyDevice) -> dict[str, torch.Tensor]:
    """The checkpoint of ``step`` restored by a fresh pilot (from storage, its memory tier is
    empty) into a differently seeded job."""
    job = Job(tmp_path, seed=99, device=device)
    try:
        assert job.pilot.restore() == step
        return job.state()
    finally:
        job.pilot.close(save=False)


def lazy_job(tmp_path: Path, device: LazyDevice) -> tuple[Job, LazyCopier]:
    job = Job(tmp_path, seed=0, device=device)
    return job, job.copier


@pytest.mark.parametrize("missing", [None, "forward", "optimizer"])
def test_a_save_restores_bit_exactly_only_with_both_hooks(
        tmp_path: Path, lazy_device: LazyDevice, missing: str | None,
        caplog: pytest.LogCaptureFixture) -> None:
    job, copier = lazy_job(tmp_path, lazy_device)
    assert len(job.model._forward_pre_hooks) == 1
    assert len(job.opt._optimizer_step_pre_hooks) == 1
    job.train(1)
    assert job.pilot.save()  # the forward hook runs before the next step: trusted from now
    job.train(2)
    assert job.pilot.save()
    expected = job.state()
    if missing == "forward":
        job.model._forward_pre_hooks.clear()
    elif missing == "optimizer":
        job.opt._optimizer_step_pre_hooks.clear()
    job.train(2)  # changes parameters, optimizer state, BatchNorm buffers and the EMA
    assert differing(expected, job.state()) == set(expected)
    copier.gate.set()  # the copies the hooks did not ask for are made only now
    job.pilot.flush()
    job.pilot.close(save=False)

    wrong = differing(expected, restored_state(tmp_path, 3, lazy_device))
    if missing is None:
        assert wrong == set()
    elif missing == "forward":  # the buffers were copied after the next forward wrote them
        assert wrong == BN
    else:  # parameters and optimizer state were copied after the next optimizer steps
        assert wrong == set(expected) - BN - {"ema"}
    fence = copier.fences[1]  # who made the copies: the hooks, or the writer's late wait
    main = threading.main_thread().name
    assert [name == main for name in fence.copied_by] == [True, missing != "optimizer"]
    assert ("was not called between the last save" in caplog.text) == (missing == "forward")


def test_a_loop_calling_submodules_gets_its_buffers_ordered_at_the_capture(
        tmp_path: Path, lazy_device: LazyDevice, caplog: pytest.LogCaptureFixture) -> None:
    job, copier = lazy_job(tmp_path, lazy_device)
    job.train(1, via_submodules=True)
    assert job.pilot.save()
    job.train(2, via_submodules=True)
    assert job.pilot.save()
    expected = job.state()
    job.train(2, via_submodules=True)
    copier.gate.set()
    job.pilot.flush()
    job.pilot.close(save=False)
    assert differing(expected, restored_state(tmp_path, 3, lazy_device)) == set()
    assert "was not called" not in caplog.text


def test_the_writer_waits_for_the_copies_before_it_reads(
        tmp_path: Path, lazy_device: LazyDevice) -> None:
    job, copier = lazy_job(tmp_path, lazy_device)
    copier.gate.set()
    job.train(3)
    assert job.pilot.save()
    expected = job.state()
    job.pilot.flush()  # no step in between: only the writer's wait copies the parameters
    (fence,) = copier.fences
    main = threading.main_thread().name
    assert fence.copied_by[0] == main  # the buffers, at the capture (first save: untrusted)
    assert fence.copied_by[1].startswith("ckptpilot-writer")
    # The memory tier holds the very buffers the writer waited for.
    held = job.pilot.memory.newest() if job.pilot.memory is not None else None
    assert held is not None and held.step == 3
    model_keys = {k for k in expected if k.startswith("model/")}
    assert differing({k: expected[k] for k in model_keys},
                     {k: held.snapshot.tensors[k] for k in model_keys}) == set()
    job.pilot.close(save=False)
    assert differing(expected, restored_state(tmp_path, 3, lazy_device)) == set()


def test_the_groups_are_what_a_forward_writes_then_what_the_optimizer_writes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    ema = torch.ones(3)
    live = [*model.parameters(), *model.buffers(), ema,
            *(v for st in opt.state.values() for v in st.values())]
    copier = LazyCopier(lambda: iter(live))
    snap = capture(TrainingComponents(model, opt), step=1, extras={"ema": ema}, copier=copier)
    (fence,) = copier.fences
    first, second = ({src.data_ptr() for _, src in group} for group in fence._groups)
    assert first == {t.data_ptr() for t in (*model.buffers(), ema)}
    assert second == {t.data_ptr() for t in (*model.parameters(),
                                             *(v for st in opt.state.values()
                                               for v in st.values()))}
    assert snap.fence is fence
    fence.before_forward()
    assert torch.equal(snap.tensors["model/1.running_mean"], model[1].running_mean)
    assert not torch.equal(snap.tensors["model/0.weight"], model[0].weight)  # not yet copied
    copier.gate.set()
    fence.wait()
    assert torch.equal(snap.tensors["model/0.weight"], model[0].weight)


def test_without_an_optimizer_the_forward_waits_for_every_copy() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    copier = LazyCopier(lambda: iter([*model.parameters(), *model.buffers()]))
    fences = StepFences(copier, model, None)
    snap = capture(TrainingComponents(model), step=1, copier=fences)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 4))
    for name, value in before.items():
        assert torch.equal(snap.tensors[f"model/{name}"], value), name
    fences.remove()
    assert not model._forward_pre_hooks


def test_a_cpu_model_gets_no_hooks_and_no_fence(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    assert devicecopy.copier_for(model) is None
    pilot = CheckpointPilot(policy_file(tmp_path), model=model, optimizer=opt,
                            run_dir=tmp_path / "run")
    try:
        assert not model._forward_pre_hooks
        assert not opt._optimizer_step_pre_hooks
        assert capture(TrainingComponents(model, opt), step=0).fence is None
    finally:
        pilot.close(save=False)


def test_the_hooks_are_removed_at_close(tmp_path: Path,
                                        lazy_device: LazyDevice) -> None:
    job, copier = lazy_job(tmp_path, lazy_device)
    copier.gate.set()
    job.train(2)
    job.pilot.close()  # with a final save, flushed before the hooks go
    assert not job.model._forward_pre_hooks
    assert not job.opt._optimizer_step_pre_hooks
    assert len(copier.fences) == 1 and len(copier.fences[0].copied_by) == 2
