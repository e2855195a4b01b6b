"""The run policy: pydantic models of the policy YAML (SPEC §3) and ``load_policy``.

This package owns the schema of every tunable, its defaults, its validation and the
``{run_dir}`` interpolation. It reads the policy file and nothing else: it never creates or
inspects the run directory, and it holds no behaviour — the scheduler, codecs, tiers and
pilot read these values and decide what to do with them.

Every model is frozen and rejects unknown keys. Whatever goes wrong surfaces as one
:class:`~ckptpilot.errors.PolicyError` whose ``key`` is the dotted path in the YAML
(``scheduler.min_interval``, ``tiers.peer.endpoints[1]``, ``async.max_pending``), so a typo
never silently falls back to a default.

The modules, bottom up: ``values`` (byte sizes, bounds, the checks of single values, the
frozen base section), ``messages`` (pydantic's errors as a ``PolicyError`` on a YAML path),
``scheduler`` (the ``scheduler`` section), ``schema`` (every other section, :class:`Policy`,
the ``{run_dir}`` interpolation), ``reader`` (the hardened YAML reader) and ``load``
(:func:`load_policy`). Import the names from here; docs/reference/policy.md is generated from
:class:`Policy`.
"""

from ckptpilot.policy.load import default_policy_path, load_policy
from ckptpilot.policy.scheduler import (
    ExtraSignalPolicy,
    GradSignalPolicy,
    LossSignalPolicy,
    SchedulerPolicy,
    SchedulerWeights,
    SystemSignalPolicy,
)
from ckptpilot.policy.schema import (
    AsyncPolicy,
    BestMetricPolicy,
    CodecsPolicy,
    HeartbeatPolicy,
    LevelsPolicy,
    MemoryTierPolicy,
    ObservabilityPolicy,
    PeerTierPolicy,
    Policy,
    PreemptionPolicy,
    PulsePolicy,
    RemoteRetriesPolicy,
    RemoteTierPolicy,
    RetentionPolicy,
    RollbackPolicy,
    TiersPolicy,
    ValidationPolicy,
    WatchdogPolicy,
)
from ckptpilot.policy.values import CodecName, parse_byte_size

__all__ = [
    "AsyncPolicy",
    "BestMetricPolicy",
    "CodecName",
    "CodecsPolicy",
    "ExtraSignalPolicy",
    "GradSignalPolicy",
    "HeartbeatPolicy",
    "LevelsPolicy",
    "LossSignalPolicy",
    "MemoryTierPolicy",
    "ObservabilityPolicy",
    "PeerTierPolicy",
    "Policy",
    "PreemptionPolicy",
    "PulsePolicy",
    "RemoteRetriesPolicy",
    "RemoteTierPolicy",
    "RetentionPolicy",
    "RollbackPolicy",
    "SchedulerPolicy",
    "SchedulerWeights",
    "SystemSignalPolicy",
    "TiersPolicy",
    "ValidationPolicy",
    "WatchdogPolicy",
    "default_policy_path",
    "load_policy",
    "parse_byte_size",
]
