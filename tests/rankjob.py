"""One rank of tests/test_restore_hardening.py's two-rank (gloo) restore agreement test.

``--phase train``: 15 steps with an organ forced at steps 5, 10, 15; prints the published
steps and a digest of the model after every step. ``--phase restore``: restores and
prints the step, the skipped locations and the model digest. ``--phase restore-misfit``:
rank 1's model does not fit its checkpoints; each rank prints the error its restore raised.
``--phase rollback``: rollback enabled, a save every 5 steps; only rank 0's loss spikes
(steps 22-24); prints where each rank rolled back from and to, and whether its model then
equals its state of that step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

from ckptpilot import CheckpointPilot, CkptPilotError
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--phase", choices=("train", "restore", "restore-misfit", "rollback"),
                   required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=2)
    a.run_dir.mkdir(parents=True, exist_ok=True)
    cfg = a.run_dir.parent / f"policy-{a.run_dir.name}.yaml"
    cfg.write_text(textwrap.dedent("""\
        scheduler: {base_interval: 1000, max_interval: 100000, young_daly: false,
                    weights: {loss: 1.0, grad: 0.0, system: 0.0}}
        validation: {load_test: none}
        observability: {tensorboard: false, decision_log: false}
        """))
    if a.phase == "rollback":
        cfg.write_text(textwrap.dedent("""\
            scheduler: {base_interval: 5, min_interval: 1, young_daly: false,
                        weights: {loss: 1.0, grad: 0.0, system: 0.0},
                        loss: {slope_threshold: 1000.0}}
            rollback: {enabled: true, baseline_window: 10, patience: 2, skip_batches: 0}
            validation: {load_test: none}
            observability: {tensorboard: false, decision_log: false}
            """))
    torch.manual_seed(a.rank)
    misfit = a.phase == "restore-misfit" and a.rank == 1
    model = torch.nn.Linear(4, 5 if misfit else 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=a.run_dir)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(7 + a.rank))
    if a.phase == "train":
        pilot.restore()
        digests = {}
        for step in range(1, 16):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            pilot.observe(loss)
            if step % 5 == 0:
                pilot.save("organ", reason="test")
            digests[str(step)] = digest(model)
        pilot.close()
        tier = RemoteTier(str(a.run_dir / "checkpoints"))
        published = sorted(s for s, _ in archive.list_archives(tier, a.rank).published)
        print(json.dumps({"published": published, "digests": digests}))
    elif a.phase == "rollback":
        pilot.restore()
        digests, result = {}, {}
        for step in range(1, 31):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            spiking = a.rank == 0 and 22 <= step <= 24
            decision = pilot.observe(9.0 if spiking else 1.0 + 0.01 * math.sin(step))
            if decision.rollback_to is not None:
                result = {"at": decision.step, "onset": decision.spike_onset,
                          "to": decision.rollback_to, "step": pilot.step,
                          "restored": digest(model) == digests[decision.rollback_to]}
                break
            digests[step] = digest(model)
        pilot.close()
        print(json.dumps(result))
    elif a.phase == "restore-misfit":  # rank 1's model does not fit its checkpoints
        try:
            pilot.restore()
        except CkptPilotError as e:
            print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        pilot.close()
    else:
        step = pilot.restore()
        rec = pilot.last_recovery
        assert rec is not None
        print(json.dumps({"step": step, "digest": digest(model),
                          "skipped": [f"{s.location}: {s.reason}" for s in rec.skipped]}))
        pilot.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
