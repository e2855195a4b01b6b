"""Bit-exact resume proven with real SIGKILLs of a real training process (tests/crashjob.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
from helpers import assert_states_bit_equal

JOB = Path(__file__).with_name("crashjob.py")
STEPS = 60
INTERVAL = 10

pytestmark = pytest.mark.crash


def _config(tmp: Path, organ_every: int = 100) -> Path:
    """organ_every 100: every save here is a pulse — a codec container, since the remote tier
    is declared slow (at 1 MB/s compressing pays even for these tensors; at the default 2 GB/s
    they would all go raw, and such pulses take the safetensors layout); 1: all organs."""
    cfg = tmp / "policy.yaml"
    cfg.write_text(
        "tiers: {remote: {bandwidth: 1MB}}\n" +
        # A fixed interval, so the kill points below fall between known saves: the loss
        # signal cannot fire, the others weigh nothing, no Young-Daly cap.
        f"scheduler: {{base_interval: {INTERVAL}, min_interval: 1, max_interval: 500,\n"
        "  young_daly: false, weights: {loss: 1.0, grad: 0.0, system: 0.0},\n"
        f"  loss: {{slope_threshold: 1000.0}}, organ_every: {organ_every}}}\n"
        "observability: {tensorboard: false, decision_log: false}\n"
        "retention: {auto: false}\n")  # the kill points are checked against every save
    return cfg


def _run(run_dir: Path, cfg: Path, losses: Path, final: Path, *extra: str
         ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(JOB), "--run-dir", str(run_dir), "--steps", str(STEPS),
           "--config", str(cfg), "--losses", str(losses), "--final", str(final), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _losses(path: Path) -> list[tuple[int, str]]:
    return [(int(s), v) for s, v in (line.split() for line in path.read_text().splitlines())]


def _resumed(proc: subprocess.CompletedProcess[str]) -> list[str]:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESUMED"))
    return line.split()[1:]


def _resumed_from(proc: subprocess.CompletedProcess[str]) -> int:
    return int(_resumed(proc)[0])



@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("reference")
    losses, final = tmp / "losses.txt", tmp / "final.safetensors"
    proc = _run(tmp / "run", _config(tmp), losses, final)
    assert proc.returncode == 0, proc.stderr
    ref = dict(_losses(losses))
    assert sorted(ref) == list(range(STEPS))
    return {"losses": ref, "final": safetensors.torch.load_file(final),
            "json": json.loads(Path(str(final) + ".json").read_text())}


@pytest.mark.parametrize(("level", "kill_point"), [
    ("pulse", "tensors"), ("pulse", "publish"), ("organ", "tensors")])
def test_killed_between_and_during_saves_resumes_bit_exactly(
        tmp_path: Path, reference: dict[str, object], level: str, kill_point: str) -> None:
    cfg = _config(tmp_path, organ_every=100 if level == "pulse" else 1)
    run_dir, losses, final = tmp_path / "run", tmp_path / "losses.txt", tmp_path / "final"

    # 1: killed between saves (last published save: step 20).
    first = _run(run_dir, cfg, losses, final, "--kill-after-step", "23")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert _resumed_from(first) == 0

    # 2: resumes from 20, then is killed while the checkpoint of step 40 is being written.
    second = _run(run_dir, cfg, losses, final, "--kill-in-save", "40", "--kill-point", kill_point)
    assert second.returncode == -signal.SIGKILL, second.stderr
    assert _resumed_from(second) == 20
    ckpt_dir = run_dir / "checkpoints"
    assert not (ckpt_dir / "step_00000040_rank_00000").exists()
    assert any(p.name.startswith("step_00000040_rank_00000.staging-")
               for p in ckpt_dir.iterdir()), "the killed save should have left debris"

    # 3: the half-written step 40 is never chosen; resumes from 30 and finishes.
    third = _run(run_dir, cfg, losses, final)
    assert third.returncode == 0, third.stderr
    assert _resumed_from(third) == 30
    tensors = "tensors.ckpt" if level == "pulse" else "tensors.safetensors"
    assert (ckpt_dir / "step_00000030_rank_00000" / tensors).exists()
    assert not any(".staging-" in p.name for p in ckpt_dir.iterdir())

    # Heartbeats tell how far each dead run got; the ledger records both interruptions.
    assert _resumed(second) == ["20", "remote", "4", level]  # run 1 died after step 24
    assert _resumed(third)[3] == level
    lost = int(_resumed(third)[2])
    assert lost >= 10  # run 2 got at least to step 40 before the kill in its save
    ledger = [json.loads(ln) for ln in (run_dir / "ledger_rank_00000.jsonl").read_text()
              .splitlines()]
    kinds = [r["kind"] for r in ledger]
    assert kinds == ["run_start", "interruption", "run_start", "interruption", "run_start",
                     "run_end"]
    assert [(r["last_step"], r["recovered_step"]) for r in ledger if r["kind"] ==
            "interruption"] == [(24, 20), (30 + lost, 30)]

    ref_losses = reference["losses"]
    seen = _losses(losses)
    assert {s for s, _ in seen} == set(range(STEPS))
    mismatched = [(s, v, ref_losses[s]) for s, v in seen if ref_losses[s] != v]
    assert not mismatched, f"losses differ after resume: {mismatched[:3]}"
    # Steps 20-23 and 30-39 ran twice (before a kill and after resume), identically.
    assert len(seen) >= STEPS + 4 + 10

    assert_states_bit_equal(reference["final"], safetensors.torch.load_file(final))
    got = json.loads(Path(str(final) + ".json").read_text())
    assert got["param_groups"] == reference["json"]["param_groups"]
    assert got["sampler"] == reference["json"]["sampler"]
    assert got["sched"] == reference["json"]["sched"]
    assert got["torch_rng"] == reference["json"]["torch_rng"]
