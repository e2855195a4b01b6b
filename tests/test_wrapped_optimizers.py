"""Framework wrappers around an optimizer are unwrapped to the torch optimizer that steps;
what cannot be captured is refused with one line naming the type (issue 13, point 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.capture.state import unwrap_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _train_and_save(tmp_path: Path, model: torch.nn.Module, optimizer: object,
                    inner: torch.optim.Optimizer) -> None:
    policy = load_policy(None, run_dir=tmp_path / "run")
    with CheckpointPilot(policy, model=model, optimizer=optimizer) as pilot:  # type: ignore[arg-type]
        for _ in range(3):
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()  # type: ignore[attr-defined]
            optimizer.zero_grad()  # type: ignore[attr-defined]
        # The hook sits on the optimizer that really steps: three optimizer steps counted.
        assert pilot.step == 3
    assert pilot.saves[-1].step == 3  # close() saved the last step
    fresh = _model()
    restored_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with CheckpointPilot(policy, model=fresh, optimizer=restored_opt) as again:
        assert again.restore() == 3
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
    assert torch.equal(restored_opt.state_dict()["state"][0]["exp_avg"].view(torch.int32),
                       inner.state_dict()["state"][0]["exp_avg"].view(torch.int32))


def test_accelerate_optimizer_is_unwrapped_and_captured(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, wrapped = accelerator.prepare(model, inner)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    assert unwrap_optimizer(wrapped) is inner
    _train_and_save(tmp_path, model, wrapped, inner)


def test_lightning_optimizer_is_unwrapped(tmp_path: Path) -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    inner = torch.optim.AdamW(_model().parameters(), lr=0.1)
    assert unwrap_optimizer(LightningOptimizer(inner)) is inner


def test_zero_redundancy_optimizer_is_refused_in_one_line() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)  # needs no process group
    with pytest.raises(TypeError, match="ZeroRedundancyOptimizer shards its state"):
        unwrap_optimizer(zero)


def test_an_object_that_wraps_no_optimizer_is_refused_naming_its_type(tmp_path: Path) -> None:
    class Shim:
        optimizer = "not an optimizer"

    with pytest.raises(TypeError, match=r"optimizer Shim is not a torch.optim.Optimizer"):
        unwrap_optimizer(Shim())
    policy = load_policy(None, run_dir=tmp_path / "run")
    with pytest.raises(TypeError, match="optimizer Shim"):
        CheckpointPilot(policy, model=_model(), optimizer=Shim())  # type: ignore[arg-type]
    assert not (tmp_path / "run" / "metadata.sqlite").exists()  # refused before any file
