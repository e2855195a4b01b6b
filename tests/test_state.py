"""Capture/apply of the complete training state (SPEC §2), in process."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ckptpilot import ResumableSampler, StateError
from ckptpilot.capture.state import HostBufferPool, TrainingComponents, apply, capture


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
        assert torch.equal(bits(v), bits(b[k])), k


def make(opt_name: str) -> TrainingComponents:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12),
                                torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(12, 3))
    if opt_name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return TrainingComponents(model, opt, sched, scaler, ResumableSampler(100, seed=3))


def train(c: TrainingComponents, steps: int) -> list[float]:
    losses = []
    assert c.optimizer is not None and c.lr_scheduler is not None and c.scaler is not None
    sampler = c.data_state
    assert isinstance(sampler, ResumableSampler)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(100, 6, generator=gen), torch.randn(100, 3, generator=gen)
    for _ in range(steps):
        idx = sampler.take(10)
        c.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(c.model(x[idx]), y[idx])
        c.scaler.scale(loss).backward()  # type: ignore[attr-defined]
        c.scaler.step(c.optimizer)  # type: ignore[attr-defined]
        c.scaler.update()  # type: ignore[attr-defined]
        c.lr_scheduler.step()
        losses.append(loss.item() + random.random() + float(np.random.rand()))
    return losses


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_capture_apply_continues_bit_exactly(opt_name: str) -> None:
    c = make(opt_name)
    train(c, 5)
    snap = capture(c, step=5, extras={"best": 1.5, "tags": ("a", 2)})
    assert any(k.startswith("model/1.running_mean") for k in snap.tensors)  # buffers too
    assert any(k.startswith("optimizer/state/") for k in snap.tensors)
    expected = train(c, 7)
    final = {k: v.clone() for k, v in c.model.state_dict().items()}

    fresh = make(opt_name)
    train(fresh, 2)  # a different state that apply must fully overwrite
    extras = apply(fresh, snap.meta, snap.tensors.__getitem__)
    assert extras == {"best": 1.5, "tags": ("a", 2)}
    assert train(fresh, 7) == expected
    assert_same_tensors(final, fresh.model.state_dict())
    assert fresh.scaler.state_dict() == c.scaler.state_dict()  # type: ignore[union-attr]
    assert fresh.lr_scheduler.state_dict() == c.lr_scheduler.state_dict()  # type: ignore[union-attr]


def test_rng_states_are_restored() -> None:
    c = make("adamw")
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    snap = capture(c, step=0)
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    apply(c, snap.meta, snap.tensors.__getitem__)
    again = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert draws[:2] == again[:2]
    assert torch.equal(bits(draws[2]), bits(again[2]))


def test_snapshot_is_decoupled_from_live_objects() -> None:
    c = make("adamw")
    train(c, 3)
    snap = capture(c, step=3)
    stored = {k: v.clone() for k, v in snap.tensors.items()}
    with torch.no_grad():
        for p in c.model.parameters():
            p.add_(1.0)
        for st in c.optimizer.state.values():  # type: ignore[union-attr]
            st["exp_avg"].mul_(3.0)
    c.model[1].running_mean.fill_(7.0)  # type: ignore[index]
    assert_same_tensors(stored, snap.tensors)


def test_buffer_pool_reuses_memory_and_keeps_values_right() -> None:
    c = make("adamw")
    train(c, 2)
    pool = HostBufferPool(1)
    first = capture(c, step=2, pool=pool)
    ptrs = {k: v.data_ptr() for k, v in first.tensors.items()}
    expected_first = {k: v.clone() for k, v in first.tensors.items()}
    pool.give_back(first)
    train(c, 1)
    second = capture(c, step=3, pool=pool)
    reused = sum(ptrs[k] == v.data_ptr() for k, v in second.tensors.items() if k in ptrs)
    assert reused == len(ptrs)  # same layout: the whole arena is reused
    assert not torch.equal(second.tensors["model/0.weight"], expected_first["model/0.weight"])
    assert_same_tensors(second.tensors, {k: v.clone() for k, v in second.tensors.items()})


def test_unsupported_value_names_its_path() -> None:
    c = make("adamw")

    class Opaque:
        pass

    with pytest.raises(StateError, match=r"extras/cfg/handle: cannot checkpoint .*Opaque"):
        capture(c, step=0, extras={"cfg": {"handle": Opaque()}})


def test_model_mismatch_is_refused_before_anything_changes() -> None:
    c = make("adamw")
    snap = capture(c, step=0)
    other = TrainingComponents(torch.nn.Sequential(torch.nn.Linear(6, 13)))
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(StateError, match="model keys differ"):
        apply(other, snap.meta, snap.tensors.__getitem__)
    wrong_shape = make("adamw")
    wrong_shape.model[0] = torch.nn.Linear(6, 12, bias=True).double()  # type: ignore[index]
    with pytest.raises(StateError, match=r"model/0.weight: checkpoint has torch.float32"):
        apply(wrong_shape, snap.meta, snap.tensors.__getitem__)
    assert_same_tensors(before, other.model.state_dict())


def test_missing_component_state_is_an_error() -> None:
    bare = TrainingComponents(make("adamw").model)
    snap = capture(bare, step=0)
    with pytest.raises(StateError, match="optimizer: the checkpoint holds no optimizer state"):
        apply(make("adamw"), snap.meta, snap.tensors.__getitem__)


def test_special_values_survive_json() -> None:
    c = TrainingComponents(torch.nn.Linear(2, 2))
    extras = {"nan": float("nan"), "inf": float("-inf"), "big": 2**70, 3: "int key",
              "np": np.float32(0.1), "none": None, "nested": [(1, 2.5), {"x": [True]}]}
    snap = capture(c, step=0, extras=extras)
    meta = json.loads(json.dumps(snap.meta))
    got = apply(c, meta, snap.tensors.__getitem__)
    assert np.isnan(got.pop("nan"))
    del extras["nan"]
    assert got["np"].dtype == np.float32 and got["np"] == np.float32(0.1)
    assert got == extras
