"""Small helpers shared by the test modules."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from ckptpilot.tiers.remote import archive


def archive_tensors(directory: Path) -> Path:
    """The tensors file of a checkpoint directory: safetensors (organ) or container (pulse)."""
    for name in (archive.TENSORS_FILE, archive.CONTAINER_FILE):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError(f"{directory}: no tensors file")


def assert_states_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes and shapes, and the same bytes (``torch.equal`` on uint8 views, so
    NaN payloads and -0.0 count)."""
    assert a.keys() == b.keys()
    for key, ta in a.items():
        tb = b[key]
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, key
        assert torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)), \
            f"{key} differs bit-wise"


def save_final_state(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str,
                     **extra: Any) -> None:
    """What a training child leaves for its parent to compare: model and optimizer tensors
    as safetensors at ``path``, the optimizer's param groups and ``extra`` as ``path.json``."""
    sd = opt.state_dict()
    tensors = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"opt/{pid}/{k}"] = v.contiguous()
    safetensors.torch.save_file(tensors, path)
    Path(path + ".json").write_text(json.dumps({"param_groups": sd["param_groups"], **extra}))


def seeded_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Seed python, numpy and torch as the crash-test children do, and return their data:
    512 samples of 16 features, 4 classes from the signs of two feature sums."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=gen)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return x, y


DDP_JOB = Path(__file__).with_name("ddpjob.py")


def ddp_policy(tmp: Path, guard: str) -> Path:
    """The policy of tests/ddpjob.py's two-rank runs (pulses every 10 steps, driven by the
    loss alone, nothing in the background that a loaded machine could make late), plus
    ``guard``: the preemption or watchdog section under test."""
    cfg = tmp / "policy.yaml"
    cfg.write_text(
        "scheduler: {base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,\n"
        "  weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0},\n"
        "  organ_every: 100}\n"
        "validation: {load_test: none}\n"
        "observability: {tensorboard: false, decision_log: false}\n"
        "retention: {auto: false}\n" + guard + "\n")
    return cfg


def start_ddp_ranks(tmp: Path, cfg: Path, steps: int, *extra: list[str]
                    ) -> list[subprocess.Popen[str]]:
    """Two ranks of tests/ddpjob.py on a free port, run directory ``tmp/run``, final states
    ``tmp/final0`` and ``tmp/final1``; ``extra[r]`` are rank r's own arguments."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    return [subprocess.Popen([sys.executable, str(DDP_JOB), "--rank", str(r), "--port",
                              str(port), "--run-dir", str(tmp / "run"), "--config", str(cfg),
                              "--steps", str(steps), "--final", str(tmp / f"final{r}"),
                              *(extra[r] if extra else [])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (0, 1)]

