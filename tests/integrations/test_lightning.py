"""CheckpointPilotCallback in a real ``lightning.Trainer`` fit: SIGKILLed children resume bit
for bit (tests/integrations/lightning_job.py), metrics reach the metadata, a finished fit
restarted trains nothing."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

from helpers import assert_states_bit_equal

from ckptpilot.storage.metadata import MetadataStore

JOB = Path(__file__).with_name("lightning_job.py")
STEPS = 30  # 12 batches an epoch: epochs 0 and 1 end at steps 12 and 24, each validated

pytestmark = [pytest.mark.integration, pytest.mark.crash]


def _config(tmp: Path) -> Path:
    """A fixed interval of 10 steps and best-2 by val_loss: the checkpoints are steps 10, 12
    (its validation reports val_loss: a pulse), 22, 24 (validation) and 30 (the final save)."""
    cfg = tmp / "policy.yaml"
    cfg.write_text(
        "scheduler: {base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,\n"
        "  weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0},\n"
        "  organ_every: 100}\n"
        "retention: {best: {metric: val_loss, mode: min, keep: 2}, auto: false}\n"
        # The load test is covered elsewhere; skipping it keeps the children quick.
        "validation: {load_test: none}\n"
        "observability: {tensorboard: false, decision_log: false}\n")
    return cfg


def _run(tmp: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(JOB), "--run-dir", str(run_dir), "--steps", str(STEPS),
           "--config", str(_config(tmp)), "--losses", str(tmp / "losses.txt"),
           "--final", str(tmp / "final.safetensors"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _resumed_from(proc: subprocess.CompletedProcess[str]) -> int:
    return int(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESUMED")).split()[1])


def _losses(tmp: Path) -> list[tuple[int, str]]:
    path = tmp / "losses.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(s), v) for s, v in (line.split() for line in lines)]


def _final(tmp: Path) -> tuple[dict[str, object], dict[str, object]]:
    path = tmp / "final.safetensors"
    return (safetensors.torch.load_file(path),
            json.loads(Path(f"{path}.json").read_text()))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("reference")
    proc = _run(tmp, tmp / "run")
    assert proc.returncode == 0, proc.stderr
    losses = dict(_losses(tmp))
    assert sorted(losses) == list(range(1, STEPS + 1))
    tensors, meta = _final(tmp)
    val = {int(s): float.fromhex(v) for _, s, v in
           (ln.split() for ln in proc.stdout.splitlines() if ln.startswith("VAL"))}
    return {"tmp": tmp, "losses": losses, "tensors": tensors, "meta": meta, "val": val}


def test_killed_fits_resume_bit_exactly(tmp_path: Path, reference: dict[str, object]) -> None:
    run_dir = tmp_path / "run"

    # 1: killed after step 17; the newest checkpoint is step 12, an epoch's last step, saved
    # after its validation.
    first = _run(tmp_path, run_dir, "--kill-after-step", "17")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert _resumed_from(first) == 0

    # 2: resumes in the next epoch (Lightning skips the validation that followed step 12),
    # then is killed after step 23; the newest checkpoint is step 22, mid-epoch.
    second = _run(tmp_path, run_dir, "--kill-after-step", "23")
    assert second.returncode == -signal.SIGKILL, second.stderr
    assert _resumed_from(second) == 12

    # 3: resumes at batch 10 of epoch 1 and finishes.
    third = _run(tmp_path, run_dir)
    assert third.returncode == 0, third.stderr
    assert _resumed_from(third) == 22

    ref = reference["losses"]
    assert isinstance(ref, dict)
    seen = _losses(tmp_path)
    assert [s for s, _ in seen] == [*range(1, 18), *range(13, 24), *range(23, STEPS + 1)]
    mismatched = [(s, v, ref[s]) for s, v in seen if ref[s] != v]
    assert not mismatched, f"losses differ after a resume: {mismatched[:3]}"

    tensors, meta = _final(tmp_path)
    assert_states_bit_equal(reference["tensors"], tensors)  # type: ignore[arg-type]
    # Optimizer hyper-parameters, data cursor, LR schedule, torch RNG, Lightning's counters.
    assert meta == reference["meta"]
    assert meta["global_step"] == STEPS


def test_validation_metrics_reach_the_metadata_rows(reference: dict[str, object]) -> None:
    tmp = reference["tmp"]
    assert isinstance(tmp, Path)
    with MetadataStore(tmp / "run" / "metadata.sqlite", read_only=True) as store:
        rows = store.rows(status="valid")
    metrics = {row.step: row.metric_value for row in rows if row.metric_name == "val_loss"}
    assert metrics == reference["val"]
    assert sorted(metrics) == [12, 24]
    assert sorted(row.step for row in rows) == [10, 12, 22, 24, STEPS]


def test_a_finished_fit_restarted_trains_no_step(tmp_path: Path,
                                                   reference: dict[str, object]) -> None:
    tmp = reference["tmp"]
    assert isinstance(tmp, Path)
    shutil.copytree(tmp / "run", tmp_path / "run")
    again = _run(tmp_path, tmp_path / "run")
    assert again.returncode == 0, again.stderr
    assert _resumed_from(again) == STEPS
    assert _losses(tmp_path) == []
    tensors, meta = _final(tmp_path)
    assert_states_bit_equal(reference["tensors"], tensors)  # type: ignore[arg-type]
    # The uninterrupted fit counts the epoch that max_steps cut short as finished when it
    # stops; the restored one (at that epoch's step 30) stops before it gets there.
    ref_meta = reference["meta"]
    assert isinstance(ref_meta, dict)
    assert meta == {**ref_meta, "epoch": ref_meta["epoch"] - 1}


def test_accumulating_batches_are_no_step_boundary(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning_job import TinyClassifier, data, make_trainer

    from ckptpilot.integrations.lightning import CheckpointPilotCallback

    class PilotSteps(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            assert callback.pilot is not None
            self.steps.append(callback.pilot.step)

    sampler, train, _ = data()
    callback = CheckpointPilotCallback(_config(tmp_path), run_dir=tmp_path / "run",
                                       data_state=sampler)
    seen = PilotSteps()
    make_trainer([callback, seen], 4, accumulate_grad_batches=3).fit(TinyClassifier(4), train)
    # An optimizer step every third batch; the pilot observes those only, numbered as
    # Lightning's global_step, and close() saved the last one.
    assert seen.steps == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert callback.pilot is not None
    assert [r.step for r in callback.pilot.saves] == [4]


def test_a_checkpoint_without_lightning_loop_state_is_refused(tmp_path: Path) -> None:
    from lightning_job import TinyClassifier, data, make_trainer

    from ckptpilot import CheckpointPilot, StateError
    from ckptpilot.integrations.lightning import CheckpointPilotCallback

    sampler, train, _ = data()
    model = TinyClassifier(4)
    optimizers = model.configure_optimizers()
    with CheckpointPilot(_config(tmp_path), model=model, optimizer=optimizers["optimizer"],
                         lr_scheduler=optimizers["lr_scheduler"]["scheduler"],
                         data_state=sampler, run_dir=tmp_path / "run") as pilot:
        pilot.observe(1.0)
    callback = CheckpointPilotCallback(_config(tmp_path), run_dir=tmp_path / "run",
                                       data_state=sampler)
    with pytest.raises(StateError, match="step 1 holds no Lightning loop state"):
        make_trainer([callback], 4).fit(model, train)
    # on_exception closed the pilot: the run directory is free for the next one.
    CheckpointPilot(_config(tmp_path), model=model, run_dir=tmp_path / "run").close(save=False)
