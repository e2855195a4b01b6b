"""Record real training traces for calibrating the scheduler's signals (``signals.py``).

Each trace is one real CPU training run on this machine: per step, the loss, the global
gradient norm (before any clipping, measured every step) and the step's wall time, as a small
CSV under ``bench/traces/``. Nothing is downloaded and nothing is injected: a spike in a trace
is what the optimizer did.

Traces:

* ``demo``: ``ckptpilot.cli.demo``'s character transformer on the standard library's source, the
  demo's own optimizer and one-cycle schedule;
* ``cnn``: a small CNN classifying generated images (oriented stripes of random phase, in
  noise), AdamW;
* ``finetune``: a small MLP pretrained briefly on one generated task, then all but its head
  frozen and the head fine-tuned on a shifted task (the recorded steps are the fine-tune);
* ``high_lr``: the CNN with a learning rate too high for it (plain SGD with momentum, no
  clipping), so that its loss spikes by itself.

The file header (``#`` lines) says what produced the trace. Which steps are steady and where
spikes start is judged from the data by the tests that use a trace, never written here.

Usage: ``.venv/bin/python bench/record_traces.py [--steps 300] [--out bench/traces]
[--only demo,cnn,...]``.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

TraceStep = Callable[[], tuple[float, float]]
"""One training step: returns (loss, global grad norm before clipping)."""


def _grad_norm(model: nn.Module) -> float:
    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def demo_trace(steps: int) -> TraceStep:
    from ckptpilot.cli.demo import BATCH, build_demo_job

    job = build_demo_job(steps)

    def step() -> tuple[float, float]:
        windows = job.text[job.sampler.take(BATCH)[:, None] + job.offsets].long()
        logits = job.model(windows[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))
        job.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1.0))
        job.opt.step()
        job.sched.step()
        return loss.item(), norm

    return step


def _stripes(generator: torch.Generator, batch: int, classes: int, size: int = 16,
             shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of stripes whose orientation is the class, random phase, in Gaussian noise."""
    labels = torch.randint(0, classes, (batch,), generator=generator)
    angle = labels.float() * (math.pi / classes) + shift
    phase = torch.rand(batch, generator=generator) * 2 * math.pi
    coords = torch.arange(size, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    wave = (xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None])
    images = torch.sin(wave * 0.9 + phase[:, None, None])
    images = images + 1.4 * torch.randn(batch, size, size, generator=generator)
    return images[:, None], labels


def _cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes),
    )


def cnn_trace(steps: int, *, optimizer: str = "adamw", lr: float = 2e-3) -> TraceStep:
    torch.manual_seed(1)
    generator = torch.Generator().manual_seed(1)
    model = _cnn(8)
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step() -> tuple[float, float]:
        images, labels = _stripes(generator, 64, 8)
        loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = _grad_norm(model)
        opt.step()
        return loss.item(), norm

    return step


def finetune_trace(steps: int, *, pretrain_steps: int = 200) -> TraceStep:
    torch.manual_seed(2)
    generator = torch.Generator().manual_seed(2)
    body = nn.Sequential(nn.Flatten(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64),
                         nn.ReLU())
    model = nn.Sequential(body, nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(pretrain_steps):
        images, labels = _stripes(generator, 64, 8)
        loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for parameter in body.parameters():
        parameter.requires_grad_(False)
    head = nn.Linear(64, 4)
    model = nn.Sequential(body, head)
    opt = torch.optim.AdamW(head.parameters(), lr=5e-3)

    def step() -> tuple[float, float]:
        # The shifted task: 4 classes, orientations rotated by a fraction of a class.
        images, labels = _stripes(generator, 64, 4, shift=0.3)
        loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = _grad_norm(head)
        opt.step()
        return loss.item(), norm

    return step


TRACES: dict[str, tuple[str, Callable[[int], TraceStep]]] = {
    "demo": ("ckptpilot.cli.demo CharTransformer, AdamW lr 3e-3 one-cycle, clip 1.0 (norm "
             "recorded before clipping)", demo_trace),
    "cnn": ("2-conv CNN on generated 16x16 stripe images, 8 classes, AdamW lr 2e-3",
            cnn_trace),
    "finetune": ("MLP pretrained 200 steps on 8-class stripes, body frozen, new head "
                 "fine-tuned on a rotated 4-class task, AdamW lr 5e-3", finetune_trace),
    "high_lr": ("the cnn trace's model and data with SGD momentum 0.9 at lr 0.05, no "
                "clipping", lambda steps: cnn_trace(steps, optimizer="sgd", lr=0.05)),
}


def record(name: str, steps: int, out_dir: Path) -> Path:
    description, build = TRACES[name]
    torch.set_num_threads(1)
    step = build(steps)
    rows = []
    for index in range(1, steps + 1):
        started = time.perf_counter()
        loss, norm = step()
        rows.append(f"{index},{loss:.6g},{norm:.6g},{time.perf_counter() - started:.4g}")
    path = out_dir / f"{name}.csv"
    header = [
        f"# trace {name}: {description}",
        f"# recorded by bench/record_traces.py, torch {torch.__version__}, "
        f"python {platform.python_version()}, {platform.machine()}, 1 thread",
        "step,loss,grad_norm,step_seconds",
    ]
    path.write_text("\n".join(header + rows) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "traces")
    parser.add_argument("--only", default=",".join(TRACES))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        if name not in TRACES:
            sys.exit(f"unknown trace {name!r}; choose from {', '.join(TRACES)}")
        started = time.perf_counter()
        path = record(name, args.steps, args.out)
        print(f"{path}: {args.steps} steps in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
