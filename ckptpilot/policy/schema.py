"""The sections of the policy besides ``scheduler``, the whole :class:`Policy`, and the
``{run_dir}`` interpolation that turns a validated template into a resolved policy.

The peer tier's endpoint count is checked against its shard count here, because the tier
would otherwise refuse to start only when the pilot builds it.
"""

from __future__ import annotations

import os
import string
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from typing_extensions import Self

from ckptpilot.errors import PolicyError
from ckptpilot.policy.messages import policy_error
from ckptpilot.policy.scheduler import SchedulerPolicy
from ckptpilot.policy.values import (
    MAX_COUNT,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_PEERS,
    MAX_PENDING,
    MAX_RATIO,
    MAX_SECONDS,
    MAX_SIGNAL_WINDOW,
    MAX_STEPS,
    MAX_THREADS,
    ByteSize,
    CodecName,
    Endpoint,
    KeyedError,
    Seconds,
    Section,
    check_path_text,
    check_signal_name,
    check_url,
    list_to_tuple,
)


class RollbackPolicy(Section):
    """Instability rollback (docs/concepts/rollback.md): spike detection and what to do.

    A loss above ``spike_factor`` × the median of the last ``baseline_window`` losses for
    ``patience`` steps in a row, or a NaN/inf loss at once, is a spike; its onset is the first
    of those steps. The newest save before the onset is classed ``critical``, whether or not
    ``enabled``. With ``enabled`` the pilot also restores it, skips
    ``skip_batches`` batches of the data cursor (null: as many as steps were trained from the
    restored step to the detection) and trains on; more than ``max_rollbacks`` rollbacks
    within ``window_steps`` steps raise :class:`ckptpilot.RollbackLimitError`.
    """

    enabled: bool = False
    spike_factor: float = Field(2.0, gt=1, le=MAX_RATIO)
    baseline_window: int = Field(50, ge=2, le=MAX_SIGNAL_WINDOW)
    patience: int = Field(3, ge=1, le=MAX_STEPS)
    skip_batches: int | None = Field(None, ge=0, le=MAX_STEPS)
    max_rollbacks: int = Field(3, ge=1, le=MAX_COUNT)
    window_steps: int = Field(1000, ge=1, le=MAX_STEPS)


class HeartbeatPolicy(Section):
    """Level-0 heartbeat: written every ``every`` steps, whatever the scheduler decides."""

    every: int = Field(1, ge=1, le=MAX_STEPS)


class PulsePolicy(Section):
    """Level-1 pulse. ``fsync``: whether a pulse written to the remote tier (no peer tier,
    or the peers could not take it) is fsynced like an organ. Off by default: a pulse stands
    in for the memory and peer tiers, which survive the process, not the node; without the
    fsync it costs the write into the page cache only, survives any crash of the training
    process, and after a power loss the restore finds it incomplete by its digests and walks
    back to the newest organ."""

    fsync: bool = False


class LevelsPolicy(Section):
    """Checkpoint levels with settings of their own."""

    heartbeat: HeartbeatPolicy = Field(default_factory=HeartbeatPolicy)
    pulse: PulsePolicy = Field(default_factory=PulsePolicy)


class CodecsPolicy(Section):
    """Lossless codecs per tensor family (SPEC §5)."""

    weights: CodecName = "xor_delta"
    optimizer: CodecName = "auto"
    other: CodecName = "auto"
    prefix_bits: int = Field(12, ge=1, le=31)
    zstd_level: int = Field(1, ge=1, le=22)
    threads: int = Field(0, ge=0, le=MAX_THREADS)


class MemoryTierPolicy(Section):
    """This process's CPU-memory tier; ``max_bytes`` bounds what it holds."""

    enabled: bool = True
    max_bytes: ByteSize = 8 * 2**30


class PeerTierPolicy(Section):
    """Peer-memory tier: ``data_shards`` shards plus an optional XOR parity shard (SPEC §6).

    ``endpoints`` is the fixed set of peers the tier places shards on; the ``registry`` only
    keeps the ones it marks down out of placement. So an enabled tier needs at least one
    distinct endpoint per shard, checked here because the tier refuses to start without them.
    Which of them are alive is the tier's decision at save time.

    ``lease_seconds`` starts at a second: the tier renews every third of it, and a shorter
    lease would have the peers drop the shards between renewals. ``probe_interval`` starts at
    10 ms: it is the period of the placement and registry threads, which would otherwise spin.
    """

    enabled: bool = False
    endpoints: Annotated[
        tuple[Endpoint, ...], BeforeValidator(list_to_tuple), Field(max_length=MAX_PEERS)
    ] = ()
    data_shards: int = Field(3, ge=1, le=MAX_PEERS)
    parity: bool = True
    lease_seconds: float = Field(600.0, ge=1, le=MAX_SECONDS)
    timeout_seconds: Seconds = 10.0
    probe_interval: float = Field(1.0, ge=0.01, le=MAX_SECONDS)
    registry: Endpoint | None = None
    deltas: Literal["auto", "always", "never"] = "auto"
    # The job's peer secret (``tiers/peer/auth.py``), created 0600 when missing; every
    # trainer and daemon of the job needs the same. CKPTPILOT_PEER_SECRET overrides it.
    secret_file: Annotated[str, AfterValidator(check_path_text)] = Field(
        "{run_dir}/peer.secret", min_length=1, max_length=MAX_PATH_CHARS)

    @model_validator(mode="after")
    def _check_peers(self) -> Self:
        seen: set[str] = set()
        for i, endpoint in enumerate(self.endpoints):
            if endpoint in seen:
                raise KeyedError(
                    f"endpoints[{i}]", f"{endpoint!r} is listed twice; list each peer once"
                )
            seen.add(endpoint)
        shards = self.data_shards + (1 if self.parity else 0)
        if self.enabled and len(self.endpoints) < shards:
            parity = " + 1 parity" if self.parity else ""
            raise KeyedError(
                "endpoints",
                f"the peer tier is enabled with {shards} shards ({self.data_shards} data"
                f"{parity}), each on its own peer, but {len(self.endpoints)} endpoint(s) are "
                "listed; add endpoints, lower data_shards, or set enabled: false",
            )
        return self


class RemoteRetriesPolicy(Section):
    """How often one object-store operation (a read, a listing, one object's write) is tried
    before the tier gives up on it: a reset connection or a restarting server is normal
    weather there, not a lost checkpoint. The wait doubles from ``backoff_seconds`` up to
    ``max_backoff_seconds``; ``attempts`` also goes to s3fs and botocore (S3 URLs) unless
    ``storage_options`` set their own."""

    attempts: int = Field(4, ge=1, le=100)
    backoff_seconds: float = Field(0.5, ge=0, le=MAX_SECONDS)
    max_backoff_seconds: float = Field(8.0, ge=0, le=MAX_SECONDS)


class RemoteTierPolicy(Section):
    """Remote persistent tier: an fsspec URL or a local path."""

    url: Annotated[str, AfterValidator(check_url)] = Field(
        "{run_dir}/checkpoints", min_length=1, max_length=MAX_PATH_CHARS
    )
    bandwidth: ByteSize = 2 * 10**9
    # Passed to fsspec as they are (endpoint_url, key/secret, profile, client_kwargs …).
    # Secrets: left out of repr; never logged, never written to the metadata store.
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    retries: RemoteRetriesPolicy = Field(default_factory=RemoteRetriesPolicy)
    # What a restore checks each chunk it reads against (``format.digest`` states each one's
    # guarantee): ``sha256`` stands against a deliberate substitution, ``xxh3`` only against
    # accidental damage, for far less CPU. Checkpoints without XXH3 digests (manifest
    # version 2 and older) are always checked by SHA256; ``validate`` always uses SHA256.
    verify_reads: Literal["sha256", "xxh3"] = "sha256"


class TiersPolicy(Section):
    """Where checkpoints live (SPEC §6)."""

    memory: MemoryTierPolicy = Field(default_factory=MemoryTierPolicy)
    peer: PeerTierPolicy = Field(default_factory=PeerTierPolicy)
    remote: RemoteTierPolicy = Field(default_factory=RemoteTierPolicy)


class ValidationPolicy(Section):
    """Checks run before a checkpoint is published (SPEC §7).

    ``load_test``: ``subprocess`` checks every checkpoint in a separate process; ``none``
    skips it (the word ``off`` would be read by YAML as the boolean false). ``paranoid``:
    re-read what was just written — re-hash every file (``sha256``) and decode every tensor —
    instead of trusting the digests computed from the very buffers that were written.
    """

    sha256: bool = True
    load_test: Literal["subprocess", "none"] = "subprocess"
    consistency: bool = True
    paranoid: bool = False


class BestMetricPolicy(Section):
    """Never prune the ``keep`` best checkpoints by a metric the user reports
    (``pilot.report_metric(metric, value)``); ``mode`` says whether lower or higher is better."""

    metric: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    mode: Literal["min", "max"] = "min"
    keep: int = Field(3, ge=1, le=MAX_COUNT)


class RetentionPolicy(Section):
    """Retention classes from the health score at save time (SPEC §4, §8)."""

    critical_score: float = Field(0.8, ge=0, le=1)
    important_score: float = Field(0.5, ge=0, le=1)
    important_keep: int = Field(3, ge=1, le=MAX_COUNT)
    routine_keep: int = Field(1, ge=1, le=MAX_COUNT)
    # The newest N valid checkpoints of each rank and tier are never removed, whatever their
    # class: a newest one that rots after validation needs an older one to walk back to.
    keep_last: int = Field(2, ge=1, le=MAX_COUNT)
    best: BestMetricPolicy | None = None
    # Applied by the writer thread after every save published valid (rank 0 for the run).
    auto: bool = True
    # Disk budget on the remote tier: total checkpoint bytes, and free space to keep on its
    # file system (where that can be known). None: no limit.
    max_bytes: ByteSize | None = None
    min_free_bytes: ByteSize | None = None

    @property
    def budgeted(self) -> bool:
        """Whether a disk budget applies (every rank can tell, pruner or not)."""
        return self.max_bytes is not None or self.min_free_bytes is not None

    @model_validator(mode="after")
    def _check_scores(self) -> Self:
        if self.important_score > self.critical_score:
            raise KeyedError(
                "important_score",
                f"important_score ({self.important_score}) is above critical_score "
                f"({self.critical_score})",
            )
        return self


class ObservabilityPolicy(Section):
    """Decision log (JSON lines, every decision) and TensorBoard scalars (every save and
    rollback, the scheduler's curves about twice a second between them: ``telemetry.py``)."""

    tensorboard: bool = True
    decision_log: bool = True


class AsyncPolicy(Section):
    """Background save pipeline; ``max_pending`` saves in flight before the training blocks.

    ``background_priority``: ``nice`` runs the background work (hashing, encoding, writing,
    TensorBoard) at nice 10; ``idle`` under ``SCHED_IDLE``, so it takes no time slice from
    training, but only runs when nothing else on the machine wants a core: on training that
    keeps every core busy a save then waits until it is lifted (``ckptpilot.background``),
    and the newest recovery point lags. Opt in where training leaves cores free (GPU jobs).
    """

    max_pending: int = Field(2, ge=1, le=MAX_PENDING)
    background_priority: Literal["nice", "idle"] = "nice"


class PreemptionPolicy(Section):
    """A preemption notice (docs/operations/preemption-and-hangs.md): any of ``signals``
    makes the pilot save an emergency organ at the next step boundary, wait up to
    ``grace_seconds`` from the notice for it to be durable and valid, and exit with
    ``ExitStatus.PREEMPTED`` (75), or ``PREEMPTED_UNSAVED`` (76) when it was not in time.
    Handlers are installed only by a pilot built on the main thread."""

    enabled: bool = True
    signals: Annotated[
        tuple[Annotated[str, AfterValidator(check_signal_name)], ...],
        BeforeValidator(list_to_tuple), Field(min_length=1, max_length=8)
    ] = ("SIGTERM", "SIGUSR1")
    grace_seconds: Seconds = 25.0

    @model_validator(mode="after")
    def _check_unique(self) -> Self:
        if len(set(self.signals)) != len(self.signals):
            raise KeyedError("signals", f"lists a signal twice: {list(self.signals)}")
        return self


class WatchdogPolicy(Section):
    """The hang watchdog (docs/operations/preemption-and-hangs.md): no step boundary for
    ``max(min_seconds, step_time_multiple x the median step time)`` ends the process with
    ``ExitStatus.HANG`` (77) so that the launcher restarts the job. Off by default: a loop
    that legitimately spends long between two ``observe()`` calls (a long evaluation) must
    raise ``min_seconds`` above that first. Before it exits, the rank gives the saves it has
    in flight up to ``drain_seconds`` to become durable: they run on the writer's threads,
    which the hang does not stop, and a save taken before the hang is work the restart keeps."""

    enabled: bool = False
    step_time_multiple: float = Field(20.0, ge=2, le=MAX_RATIO)
    min_seconds: Seconds = 600.0
    drain_seconds: Seconds = 60.0


class Policy(Section):
    """The whole policy file.

    ``Policy()`` holds the defaults with templates unresolved (``tiers.remote.url`` is
    ``"{run_dir}/checkpoints"``); :func:`load_policy` and :meth:`with_run_dir` return resolved
    policies and remember the templates, so a resolved policy can be moved to another run
    directory. The ``async`` section is the attribute ``async_``; constructors accept both
    spellings. :func:`load_policy` and :meth:`with_run_dir` raise :class:`PolicyError`;
    ``Policy(...)`` and ``Policy.model_validate`` are plain pydantic and raise its
    ``ValidationError`` (also a ``ValueError``).
    """

    model_config = ConfigDict(populate_by_name=True)

    run_dir: Annotated[str, AfterValidator(check_path_text)] = Field(
        "runs/default", min_length=1, max_length=MAX_PATH_CHARS)
    scheduler: SchedulerPolicy = Field(default_factory=SchedulerPolicy)
    levels: LevelsPolicy = Field(default_factory=LevelsPolicy)
    codecs: CodecsPolicy = Field(default_factory=CodecsPolicy)
    tiers: TiersPolicy = Field(default_factory=TiersPolicy)
    validation: ValidationPolicy = Field(default_factory=ValidationPolicy)
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)
    rollback: RollbackPolicy = Field(default_factory=RollbackPolicy)
    preemption: PreemptionPolicy = Field(default_factory=PreemptionPolicy)
    watchdog: WatchdogPolicy = Field(default_factory=WatchdogPolicy)
    observability: ObservabilityPolicy = Field(default_factory=ObservabilityPolicy)
    async_: AsyncPolicy = Field(default_factory=AsyncPolicy, alias="async")

    _template: dict[str, Any] | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal when every value is equal; the templates remembered for moves are ignored."""
        if not isinstance(other, Policy):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(tuple(self.__dict__.values()))

    def with_run_dir(self, run_dir: str | os.PathLike[str]) -> Policy:
        """Return this policy re-resolved for ``run_dir``, from its unresolved templates."""
        template = self._template_data()
        template["run_dir"] = os.fspath(run_dir)
        return resolve_policy(template, source=None)

    def to_yaml(self) -> str:
        """Return the policy as YAML that :func:`load_policy` reads back to an equal policy.

        The templates are written, not the resolved strings, so the file stays portable to
        another run directory; ``run_dir`` is written too, so loading it as is resolves to the
        same values. (An unresolved ``Policy()`` reads back resolved, hence not equal.)
        Byte sizes are written as plain byte counts.
        """
        return yaml.safe_dump(self._template_data(), sort_keys=False)

    def _template_data(self) -> dict[str, Any]:
        """The current values with each string put back to its template where it came from one.

        Comparing leaf by leaf, rather than returning the stored template, keeps the changes
        made since resolution (``model_copy(update=...)``) when the policy moves elsewhere.
        """
        current = self.model_dump(mode="json", by_alias=True)
        if self._template is None:
            return current
        run_dir = self._template["run_dir"]
        return {
            key: value
            if key == "run_dir"
            else _restore_templates(self._template.get(key), value, run_dir)
            for key, value in current.items()
        }


def resolve_policy(template: dict[str, Any], source: str | None) -> Policy:
    """Validate ``template`` with ``{run_dir}`` substituted; keep the template for later moves."""
    run_dir = template["run_dir"]
    where = "" if source is None else f" [in {source}]"
    if "{run_dir}" in run_dir:
        raise PolicyError("run_dir", f"run_dir cannot refer to itself{where}")
    resolved = {
        key: value if key == "run_dir" else _interpolate(value, run_dir, key, where)
        for key, value in template.items()
    }
    policy = validate_policy(resolved, source)
    policy._template = template
    return policy


def _interpolate(value: Any, run_dir: str, path: str, where: str) -> Any:
    if isinstance(value, dict):
        return {
            key: _interpolate(item, run_dir, f"{path}.{key}", where) for key, item in value.items()
        }
    if isinstance(value, list):
        return [_interpolate(item, run_dir, f"{path}[{i}]", where) for i, item in enumerate(value)]
    if not isinstance(value, str):
        return value
    try:
        fields = [parsed[1:] for parsed in string.Formatter().parse(value) if parsed[1] is not None]
    except ValueError as exc:
        raise PolicyError(
            path,
            f"malformed placeholder in {value!r} ({exc}); write literal braces as {{{{ }}}}{where}",
        ) from exc
    for name, spec, conversion in fields:
        if name != "run_dir" or spec or conversion:
            raise PolicyError(
                path, f"unknown placeholder in {value!r}; only {{run_dir}} is supported{where}"
            )
    return value.format(run_dir=run_dir)


def _restore_templates(template: Any, current: Any, run_dir: str) -> Any:
    if isinstance(template, dict) and isinstance(current, dict):
        return {
            key: _restore_templates(template.get(key), value, run_dir)
            for key, value in current.items()
        }
    if isinstance(template, list) and isinstance(current, list) and len(template) == len(current):
        return [_restore_templates(t, c, run_dir) for t, c in zip(template, current, strict=True)]
    if isinstance(template, str) and template.format(run_dir=run_dir) == current:
        return template
    return current


def validate_policy(data: Any, source: str | None) -> Policy:
    """``data`` as a :class:`Policy`; pydantic's errors become one :class:`PolicyError` on the
    YAML path of the first (``source`` names the file in the message)."""
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise policy_error(exc, Policy, source) from exc
