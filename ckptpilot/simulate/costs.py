"""What one save and one restore cost a job of G GPUs: measured figures, scaled by formulas.

This module owns the cost side of the simulator: :class:`CostProfile` (what a benchmark
measured on one process, read from the JSON that ``bench/e2e.py --json`` writes),
:class:`ClusterSpec` (what the machine here cannot measure: the network, the remote store's
shared bandwidth, the job's relaunch) and :func:`tier_costs`, which combines the two for G
GPUs into the seconds the event loop charges. It does no simulation and reads no clock.

Scaling formulas (docs/operations/simulate.md), with ``b`` the state bytes of one process
(one GPU), ``b_node = 8·b`` (nodes of ``gpus_per_node``), ``B = G·b`` the job's state and
``p`` the profile's ``state_bytes``; every measured CPU cost scales linearly in bytes and every
process of a node runs its pipeline on its own share of the node's cores:

- stall (pulse or organ) = measured stall · b / p (the snapshot copy);
- pulse to peers, time to durable = stall + max(CPU: (pulse durable − stall) · b / p,
  wire: b_node · (N + 1) / N / link) for N data shards + 1 parity;
- organ to remote, time to durable = stall + max(CPU: (organ durable − stall) · b / p,
  wire: max(b_node / link, B / remote)): every node shares the remote store's bandwidth;
- restore from peers = max(measured peer restore · b / p, b_node · (N + 1) / N / link), the
  parity rebuild likewise from its own measurement; from remote = max(measured remote
  restore · b / p, b_node / link, B / remote);
- down time after a failure = relaunch (+ node replacement after a node loss, + detection
  after a hang) + the restore.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptpilot.errors import CkptPilotError

__all__ = [
    "PROFILE_FORMAT",
    "ClusterSpec",
    "CostProfile",
    "ProfileError",
    "TierCosts",
    "load_profile",
    "tier_costs",
]

PROFILE_FORMAT = "ckptpilot-cost-profile/1"


class ProfileError(CkptPilotError, ValueError):
    """A cost profile that cannot be used; the message names the file and the key."""


_Positive = Field(gt=0, allow_inf_nan=False)


class CostProfile(BaseModel):
    """Seconds measured for one process's state of ``state_bytes`` (bench/e2e.py --json).

    Keys beyond these (the benchmark's hardware references) are kept in ``extra`` untouched;
    a missing or non-positive cost is refused, naming the key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str
    source: dict[str, object] = Field(default_factory=dict)
    state_bytes: int = Field(gt=0)
    pulse_stall_seconds: float = _Positive
    pulse_durable_seconds: float = _Positive
    organ_stall_seconds: float = _Positive
    organ_durable_seconds: float = _Positive
    remote_restore_seconds: float = _Positive
    peer_restore_seconds: float = _Positive
    peer_rebuild_restore_seconds: float = _Positive
    extra: dict[str, float | str | int | None] = Field(default_factory=dict)


class ClusterSpec(BaseModel):
    """What cannot be measured on this machine; every default is an assumption, stated in
    docs/operations/simulate.md, and every one can be set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus_per_node: int = Field(8, ge=1)
    state_bytes_total: float = Field(70e9 * 16, gt=0)
    """The job's checkpointed state, sharded over all its GPUs (default: 70 B parameters at
    16 bytes each: bf16 weights, fp32 master copy, two fp32 Adam moments)."""
    node_link_bytes_per_second: float = Field(50e9, gt=0)
    remote_bytes_per_second: float = Field(200e9, gt=0)
    """Aggregate bandwidth of the remote store, shared by every node of the job."""
    relaunch_seconds: float = Field(60.0, ge=0)
    node_replace_seconds: float = Field(0.0, ge=0)
    """Extra down time to swap a lost node for a hot spare (0: spares are ready)."""
    hang_detect_seconds: float = Field(600.0, ge=0)
    """How long a hang goes unnoticed: PyTorch's default NCCL collective timeout."""
    preemption_notice_seconds: float = Field(30.0, ge=0)
    data_shards: int = Field(3, ge=1)
    """Peer tier: N data shards + 1 XOR parity shard on N + 1 nodes (one parity group)."""


@dataclass(frozen=True)
class TierCosts:
    """Seconds charged by the event loop for one job size (all per save or per restore)."""

    gpus: int
    nodes: int
    bytes_per_gpu: float
    pulse_stall_seconds: float
    peer_durable_seconds: float
    organ_stall_seconds: float
    remote_durable_seconds: float
    peer_restore_seconds: float
    peer_rebuild_seconds: float
    remote_restore_seconds: float
    relaunch_seconds: float
    node_replace_seconds: float
    hang_detect_seconds: float
    preemption_notice_seconds: float
    group_size: int
    first_save_extra_seconds: float = 0.0
    """Added to the time to durable of the first save after every start or restore (a
    validation worker starting, buffers allocated); 0 unless measured."""


def load_profile(path: Path) -> CostProfile:
    """Read a cost profile; any problem is one :class:`ProfileError` naming file and key."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ProfileError(f"cannot read cost profile {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"cost profile {path} is not JSON: {e}") from e
    return parse_profile(raw, str(path))


def parse_profile(raw: object, where: str = "cost profile") -> CostProfile:
    """Validate a decoded profile: the known keys checked, the rest kept under ``extra``."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{where}: key 'format' must be {PROFILE_FORMAT!r}, got "
                           f"{raw.get('format')!r}; write it with bench/e2e.py --json")
    known = set(CostProfile.model_fields) - {"extra"}
    fields = {k: v for k, v in raw.items() if k in known}
    extra = {k: v for k, v in raw.items() if k not in known}
    try:
        return CostProfile(**fields, extra=extra)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "?"
        raise ProfileError(f"{where}: key {key!r}: {first['msg']} "
                           f"(got {first.get('input')!r})") from e


def tier_costs(profile: CostProfile, cluster: ClusterSpec, gpus: int) -> TierCosts:
    """The per-save and per-restore seconds of a job of ``gpus`` GPUs (formulas above)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    nodes = math.ceil(gpus / cluster.gpus_per_node)
    b = cluster.state_bytes_total / gpus
    per_node = b * min(gpus, cluster.gpus_per_node)
    scale = b / profile.state_bytes
    link = cluster.node_link_bytes_per_second
    n = cluster.data_shards
    peer_wire = per_node * (n + 1) / n / link
    remote_wire = max(per_node / link, cluster.state_bytes_total / cluster.remote_bytes_per_second)
    pulse_stall = profile.pulse_stall_seconds * scale
    organ_stall = profile.organ_stall_seconds * scale
    pulse_bg = max(0.0, profile.pulse_durable_seconds - profile.pulse_stall_seconds) * scale
    organ_bg = max(0.0, profile.organ_durable_seconds - profile.organ_stall_seconds) * scale
    return TierCosts(
        gpus=gpus,
        nodes=nodes,
        bytes_per_gpu=b,
        pulse_stall_seconds=pulse_stall,
        peer_durable_seconds=pulse_stall + max(pulse_bg, peer_wire),
        organ_stall_seconds=organ_stall,
        remote_durable_seconds=organ_stall + max(organ_bg, remote_wire),
        peer_restore_seconds=max(profile.peer_restore_seconds * scale, peer_wire),
        peer_rebuild_seconds=max(profile.peer_rebuild_restore_seconds * scale, peer_wire),
        remote_restore_seconds=max(profile.remote_restore_seconds * scale, remote_wire),
        relaunch_seconds=cluster.relaunch_seconds,
        node_replace_seconds=cluster.node_replace_seconds,
        hang_detect_seconds=cluster.hang_detect_seconds,
        preemption_notice_seconds=cluster.preemption_notice_seconds,
        group_size=n + 1,
    )
