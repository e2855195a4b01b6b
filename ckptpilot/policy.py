"""The run policy: pydantic models of the policy YAML (SPEC §3) and ``load_policy``.

This module owns the schema of every tunable, its defaults, its validation and the
``{run_dir}`` interpolation. It reads the policy file and nothing else: it never creates or
inspects the run directory, and it holds no behaviour — the scheduler, codecs, tiers and
pilot read these values and decide what to do with them.

Every model is frozen and rejects unknown keys. Whatever goes wrong surfaces as one
:class:`~ckptpilot.errors.PolicyError` whose ``key`` is the dotted path in the YAML
(``scheduler.min_interval``, ``tiers.peer.endpoints[1]``, ``async.max_pending``), so a typo
never silently falls back to a default.

Bounds: a policy that loads is one the pilot can run, so every check the tiers and the
scheduler would make later is made here, at load time. Every number has an upper bound far
beyond what a real run needs (windows of 100,000 probes, timeouts of a day, a PiB of memory)
because the consumers size buffers, thread pools and socket timeouts from these values: an
unbounded window is a multi-GB allocation and a timeout of 1e300 s overflows the socket layer.
Strings, lists and the file itself are bounded for the same reason. The peer tier's endpoint
count is checked against its shard count, and the remote URL's fsspec protocol against the
installed backends, because both would otherwise fail only when the pilot starts.

Long because the schema is one document: every section of the policy YAML is a model here
with its bounds and its error messages, and docs/reference/policy.md is generated from it as
one page; split, the cross-section checks (endpoints against shards, codecs against tiers)
would import across modules for no gain.

The YAML reader refuses what PyYAML would turn into another exception or an unbounded cost:
bytes that are not UTF-8, integer literals too long for ``int`` (Python's digit limit),
nesting deep enough to exhaust the recursion limit, aliases that expand to a huge or
cyclic value (a "billion laughs" alias bomb: PyYAML shares aliased values, but pydantic's
error messages repr them in full), and merge keys (``<<``), whose expansion is exponential.
"""

from __future__ import annotations

import difflib
import importlib.resources
import os
import re
import reprlib
import signal
import string
from collections.abc import Hashable
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import fsspec
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ImportString,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo
from typing_extensions import Self

from ckptpilot.errors import PolicyError

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
    "RemoteTierPolicy",
    "RetentionPolicy",
    "RollbackPolicy",
    "SchedulerPolicy",
    "SchedulerWeights",
    "SystemSignalPolicy",
    "TiersPolicy",
    "ValidationPolicy",
    "WatchdogPolicy",
    "load_policy",
    "parse_byte_size",
]

_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
# Upper bounds, each far beyond a real run and small enough to keep memory and time sane.
_MAX_STEPS = 10**9
"""Intervals counted in optimizer steps."""
_MAX_SIGNAL_WINDOW = 1000
"""Windows kept sorted on the training thread, per step (the spike detector's baseline)."""
_MAX_SIGNAL_SPAN = 1000
"""Spans of the scheduler's signal EWMAs: one that needs longer to follow a change is no
signal (the state is a few floats whatever the span)."""
_MAX_EXTRA_SIGNALS = 16
"""Signals beyond the built-in ones: each is measured, and sent to the other ranks, per step."""
_MAX_COUNT = 100_000
"""Counts of steps, probes or checkpoints (``organ_every``, ``*_keep``)."""
_MAX_SECONDS = 86_400.0
"""Durations and timeouts: one day; socket timeouts overflow long before 1e300 s."""
_MAX_RATIO = 1e6
"""Unitless thresholds (sigmas, relative changes, decades per step): far past any signal."""
_MAX_BYTES = 2**50
"""Byte sizes and byte rates: 1 PiB (per second)."""
_MAX_PEERS = 1024
"""Peer endpoints and shards: the peer protocol's limit on ``shard_count``."""
_MAX_THREADS = 1024
_MAX_PENDING = 64
"""Saves in flight: each holds a full host copy of the training state."""
_MAX_PATH_CHARS = 4096
"""``run_dir`` and ``tiers.remote.url``: Linux's PATH_MAX."""
_MAX_NAME_CHARS = 256
_MAX_HOST_CHARS = 255
"""A DNS name has at most 253 characters; an IPv6 literal with its brackets far fewer."""

# Limits of the YAML reader; a policy file is a few KB, about 60 values, 5 levels deep.
_MAX_FILE_BYTES = 2**20
_MAX_YAML_DEPTH = 32
_MAX_YAML_VALUES = 10_000
_MAX_INT_CHARS = 64
"""Longer integer literals are refused before ``int()``, which stops at 4300 digits."""

_BYTE_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_SIGNAL_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_BUILT_IN_SIGNALS = ("loss", "grad", "system", "hard_errors", "non_finite")
"""Keys of the scheduler's own signals and channels, which an extra signal cannot take."""
_FACTORY_RE = re.compile(r"[A-Za-z_][\w.]*[:.][A-Za-z_][\w.]*", re.ASCII)
_ENDPOINT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


class _KeyedError(ValueError):
    """Raised inside a model validator to blame a key relative to that model.

    Pydantic only knows the location of the model whose validator failed; the converter
    appends ``key`` to it, so a cross-field check can name the field the user must change.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def parse_byte_size(value: int | str) -> int:
    """Return a byte count from an int or a string such as ``"8GiB"`` or ``"512 MB"``.

    KB/MB/GB/TB are powers of 1000 and KiB/MiB/GiB/TiB powers of 1024, so that ``8GB`` and
    ``8GiB`` mean what a disk vendor and the kernel respectively mean. Fractions are allowed
    when they come to a whole number of bytes (``1.5KiB``). Raises ``ValueError``.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a byte count such as 8589934592 or '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte count must not be negative, got {value}")
        return value
    match = _BYTE_SIZE_RE.fullmatch(value)
    if match is None or match.group(2) not in _BYTE_UNITS:
        units = ", ".join(unit for unit in _BYTE_UNITS if unit)
        raise ValueError(
            f"cannot read {value!r} as a byte size; write e.g. '8GiB' (units: {units})"
        )
    size = Fraction(match.group(1)) * _BYTE_UNITS[match.group(2)]
    if size.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def _check_endpoint(value: str) -> str:
    match = _ENDPOINT_RE.fullmatch(value)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(
            f"expected 'host:port' with a port in 1..65535 (IPv6 as '[::1]:port'), "
            f"got {reprlib.repr(value)}"
        )
    if len(match.group(1)) > _MAX_HOST_CHARS:
        raise ValueError(
            f"host name of {len(match.group(1))} characters; a DNS name has at most 253"
        )
    return value


def _url_protocols(url: str) -> list[str]:
    """The fsspec protocols ``url`` names, read as ``fsspec.core.url_to_fs`` reads them.

    A chained URL names one per ``::`` link (``simplecache::s3://bucket/x``), where a bare word
    is a protocol; a path without ``proto://`` names none (it is local). One-letter schemes are
    Windows drives, as fsspec's ``split_protocol`` has it.
    """
    links = url.split("::") if "::" in url else [url]
    protocols = []
    for link in links:
        bare = len(links) > 1 and re.fullmatch(r"[A-Za-z][A-Za-z0-9+._-]*", link)
        protocol, _ = fsspec.core.split_protocol(f"{link}://" if bare else link)
        if protocol:
            protocols.append(protocol)
    return protocols


def _check_path_text(path: str) -> str:
    """A NUL or another control character in a path makes the OS call fail later, far from
    the policy; refuse it here."""
    bad = next((c for c in path if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"contains the control character {bad!r}: {path[:80]!r}")
    return path


def _check_url(url: str) -> str:
    """Refuse a protocol fsspec does not know, or whose optional package is not installed.

    ``get_filesystem_class`` imports the backend and nothing more: no connection is made.
    """
    _check_path_text(url)
    for protocol in _url_protocols(url):
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            missing = exc.__cause__ if isinstance(exc.__cause__, ModuleNotFoundError) else exc
            package = (missing.name or "").partition(".")[0]
            fix = f"pip install {package}" if package else "install the package it names"
            raise ValueError(
                f"the {protocol!r} storage in {url!r} needs a package that is not installed "
                f"({exc}); {fix}, or use a local path"
            ) from exc
        except ValueError as exc:
            close = difflib.get_close_matches(protocol, fsspec.available_protocols(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"unknown storage protocol {protocol!r} in {url!r}; {hint}write a local path "
                "or an fsspec URL such as file:///data/ckpt or s3://bucket/ckpt"
            ) from exc
    return url


def _check_nvml(value: object) -> object:
    # Literal[True] alone would also accept the integer 1.
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"expected auto, true or false, got {value!r}")


def _list_to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


_ByteSize = Annotated[int, BeforeValidator(parse_byte_size), Field(ge=1, le=_MAX_BYTES)]
"""A positive byte count; YAML may give an int or a string with a unit (``8GiB``)."""

_Seconds = Annotated[float, Field(gt=0, le=_MAX_SECONDS)]
"""A positive duration of at most a day."""

_Endpoint = Annotated[str, AfterValidator(_check_endpoint)]
"""A peer address, ``host:port``."""

CodecName = Literal["raw", "zstd", "byteplane", "expplane", "xor_delta", "prefix_index",
                    "auto"]
"""Names accepted by ``ckptpilot.codecs.get_codec`` (SPEC §5)."""


class _Section(BaseModel):
    # strict: a quoted "100" or a 1 for a boolean is a mistake in a policy file, not a value
    # to coerce; ints are still accepted where a float is expected.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def __hash__(self) -> int:
        # By value, as pydantic's frozen hash, but also over dict and list values
        # (``storage_options``, a signal's ``params``), which are not hashable themselves.
        return hash(tuple(_frozen(value) for value in self.__dict__.values()))


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


class SchedulerWeights(_Section):
    """Weights of the built-in signals in the health score; each non-negative.

    With ``scheduler.extra_signals``' weights they sum to 1: the scheduler section checks the
    sum, since only it sees both."""

    loss: float = 0.4
    grad: float = 0.35
    system: float = 0.25

    @model_validator(mode="after")
    def _check_non_negative(self) -> Self:
        weights = {"loss": self.loss, "grad": self.grad, "system": self.system}
        negative = [name for name, weight in weights.items() if weight < 0]
        if negative:
            raise _KeyedError("", f"weights must not be negative ({', '.join(negative)})")
        return self


def _check_factory_text(value: object) -> object:
    if isinstance(value, str) and (len(value) > _MAX_NAME_CHARS
                                   or not _FACTORY_RE.fullmatch(value)):
        raise ValueError(
            f"{_brief(value)} is no import path; write 'package.module:ClassName' (at most "
            f"{_MAX_NAME_CHARS} characters)")
    return value


class ExtraSignalPolicy(_Section):
    """A signal beyond loss, grad and system (``scheduler.extra_signals.<name>``).

    ``factory``: the class that measures it, as ``"package.module:ClassName"``; it implements
    ``ckptpilot.scheduler.signal.Signal``. The module is imported when the policy loads, as an
    ``import`` statement would, so name only modules you trust. ``weight``: its weight in the
    score (the weights of all signals sum to 1). ``params``: checked against the class's
    pydantic model ``Params`` when the policy loads and handed to the class; a class without
    ``Params`` takes none.
    """

    factory: Annotated[ImportString[Any], BeforeValidator(_check_factory_text)]
    weight: float = Field(ge=0, le=1)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> Self:
        model = getattr(self.factory, "Params", None)
        if model is None:
            if self.params:
                raise _KeyedError("params", f"{_brief(self.factory)} takes no params (it has "
                                  "no Params model); remove them")
            return self
        try:
            model.model_validate(self.params)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise _KeyedError(f"params.{where}" if where else "params", error["msg"]) from None
        return self


class LossSignalPolicy(_Section):
    """Loss-change signal: robust z-score of the short-window log10-loss slope (SPEC §4.1).

    Spans are those of exponentially weighted moving averages (weight 2 / (span + 1), the
    center of mass of a plain mean of ``span`` values). ``level_span_steps``: the level the
    new loss is compared with (the slope's window); ``center_span_steps``: the slope's own
    center; ``spread_span_steps``: the spread of its step-to-step changes, the noise that
    judges the new slope. A jump grows linearly from 0 at |z| = ``z_low`` to 1 at ``z_high``;
    drift is a two-sided CUSUM of z minus ``drift_allowance`` per step, graded from 0 at
    ``drift_low`` to 1 at ``drift_high``; a slope within ``slope_threshold`` decades per step
    of its center never counts (a relative change: it keeps a flat loss quiet).
    """

    level_span_steps: int = Field(14, ge=2, le=_MAX_SIGNAL_SPAN)
    center_span_steps: int = Field(24, ge=2, le=_MAX_SIGNAL_SPAN)
    spread_span_steps: int = Field(32, ge=4, le=_MAX_SIGNAL_SPAN)
    z_low: float = Field(5.0, ge=0, le=_MAX_RATIO)
    z_high: float = Field(10.0, gt=0, le=_MAX_RATIO)
    drift_allowance: float = Field(1.5, ge=0, le=_MAX_RATIO)
    drift_low: float = Field(5.0, ge=0, le=_MAX_RATIO)
    drift_high: float = Field(10.0, gt=0, le=_MAX_RATIO)
    slope_threshold: float = Field(0.001, ge=0, le=_MAX_RATIO)

    @model_validator(mode="after")
    def _check_band(self) -> Self:
        _check_band("z_low", self.z_low, "z_high", self.z_high)
        _check_band("drift_low", self.drift_low, "drift_high", self.drift_high)
        _check_allowance("drift_allowance", self.drift_allowance, self.z_high)
        return self


class GradSignalPolicy(_Section):
    """Gradient-activity signal: robust deviation and growth of log grad norm (SPEC §4.2).

    Probes every ``probe_every`` steps; ``span_probes`` is the span of the EWMAs of log10 grad
    norm and of its absolute deviation (its center and spread); deviation grows from 0 at
    z = ``z_low`` to 1 at ``z_high``; growth is a CUSUM of z minus ``growth_allowance`` per
    probe, graded from 0 at ``growth_low`` to 1 at ``growth_high``; a norm within
    ``deadband_decades`` of its center never counts.
    """

    probe_every: int = Field(10, ge=1, le=_MAX_STEPS)
    span_probes: int = Field(32, ge=4, le=_MAX_SIGNAL_SPAN)
    z_low: float = Field(5.0, ge=0, le=_MAX_RATIO)
    z_high: float = Field(10.0, gt=0, le=_MAX_RATIO)
    growth_allowance: float = Field(1.5, ge=0, le=_MAX_RATIO)
    growth_low: float = Field(5.0, ge=0, le=_MAX_RATIO)
    growth_high: float = Field(10.0, gt=0, le=_MAX_RATIO)
    deadband_decades: float = Field(0.02, ge=0, le=10)

    @model_validator(mode="after")
    def _check_band(self) -> Self:
        _check_band("z_low", self.z_low, "z_high", self.z_high)
        _check_band("growth_low", self.growth_low, "growth_high", self.growth_high)
        _check_allowance("growth_allowance", self.growth_allowance, self.z_high)
        return self


def _check_allowance(key: str, allowance: float, z_high: float) -> None:
    if allowance >= z_high:
        raise _KeyedError(
            key,
            f"{key} ({allowance:g}) must be below z_high ({z_high:g}): a step adds at most "
            f"z_high − {key} to its CUSUM, so the detector could never fire",
        )


def _check_band(low_key: str, low: float, high_key: str, high: float) -> None:
    if low >= high:
        raise _KeyedError(
            high_key,
            f"{high_key} ({high:g}) must be above {low_key} ({low:g}): the signal grows from "
            f"0 at {low_key} to 1 at {high_key}; raise {high_key}",
        )


class SystemSignalPolicy(_Section):
    """System-health signal: NVML errors and IO latency (SPEC §4.3), and the hazard window.

    ``nvml``: ``auto`` uses NVML when a GPU and the library are present, ``true`` requires it,
    ``false`` never loads it. ``hazard_window_steps``: after a precursor (any signal at 0.5 or
    more, or a non-finite loss or grad norm) the system signal is at least a hazard that falls
    from 1 to 0 over this many steps; 0 turns it off. ``alarm_signal``: a health part of the
    system signal (what the training signals' own hazard does not explain) at or above it is
    an alarm: a save at once when it starts, and ``min_interval`` while it lasts.
    """

    nvml: Annotated[Literal["auto", True, False], BeforeValidator(_check_nvml)] = "auto"
    io_latency_ms: float = Field(15, gt=0, le=_MAX_SECONDS * 1000)
    sustained_seconds: _Seconds = 5
    hazard_window_steps: int = Field(100, ge=0, le=_MAX_STEPS)
    alarm_signal: float = Field(1.0, gt=0, le=1)


class SchedulerPolicy(_Section):
    """Adaptive checkpoint scheduler (SPEC §4); intervals are in optimizer steps.

    ``trigger_refractory_fraction``: a score reaching ``trigger_threshold`` saves at once only
    when at least this fraction of the base interval has passed since the last save (0: at
    any time), so a long unusual phase does not cluster saves.
    """

    base_interval: int = Field(100, ge=1, le=_MAX_STEPS)
    min_interval: int = Field(10, ge=1, le=_MAX_STEPS)
    max_interval: int = Field(500, ge=1, le=_MAX_STEPS)
    trigger_threshold: float = Field(0.7, ge=0, le=1)
    trigger_refractory_fraction: float = Field(0.5, ge=0, le=1)
    weights: SchedulerWeights = Field(default_factory=SchedulerWeights)
    loss: LossSignalPolicy = Field(default_factory=LossSignalPolicy)
    grad: GradSignalPolicy = Field(default_factory=GradSignalPolicy)
    system: SystemSignalPolicy = Field(default_factory=SystemSignalPolicy)
    # Left out of dumps while empty: a policy without extra signals dumps as before, and
    # the reference file, which lists every key, needs no entry for an empty mapping.
    extra_signals: dict[str, ExtraSignalPolicy] = Field(
        default_factory=dict, max_length=_MAX_EXTRA_SIGNALS, exclude_if=lambda value: not value)
    organ_every: int = Field(10, ge=1, le=_MAX_COUNT)
    young_daly: bool = True

    def __hash__(self) -> int:
        # By value like every section, but ``extra_signals`` is a dict: its names stand for
        # it (equal policies have equal names, which is all a hash needs).
        return hash(tuple(tuple(v) if isinstance(v, dict) else v for v in self.__dict__.values()))

    @model_validator(mode="after")
    def _check_signals(self) -> Self:
        for name in self.extra_signals:
            if name in _BUILT_IN_SIGNALS or not _SIGNAL_NAME_RE.fullmatch(name):
                raise _KeyedError(
                    f"extra_signals.{name}",
                    f"{_brief(name)} cannot name a signal: use lowercase letters, digits and "
                    f"'_' (at most 64, starting with a letter), other than "
                    f"{', '.join(_BUILT_IN_SIGNALS)}")
        weights = {"loss": self.weights.loss, "grad": self.weights.grad,
                   "system": self.weights.system}
        weights.update({f"extra_signals.{name}.weight": entry.weight
                        for name, entry in self.extra_signals.items()})
        total = sum(weights.values())
        if abs(total - 1.0) > 1e-6:
            names = " + ".join(weights)
            terms = " + ".join(f"{weight:g}" for weight in weights.values())
            raise _KeyedError(
                "weights",
                f"{names} must sum to 1, got {terms} = {total:g} "
                "(a weight left out keeps its default); rescale them",
            )
        return self

    @model_validator(mode="after")
    def _check_intervals(self) -> Self:
        if self.min_interval > self.max_interval:
            raise _KeyedError(
                "min_interval",
                f"min_interval ({self.min_interval}) is above max_interval "
                f"({self.max_interval}); swap them",
            )
        if not self.min_interval <= self.base_interval <= self.max_interval:
            raise _KeyedError(
                "base_interval",
                f"base_interval ({self.base_interval}) must lie within "
                f"[min_interval, max_interval] = [{self.min_interval}, {self.max_interval}]",
            )
        return self


class RollbackPolicy(_Section):
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
    spike_factor: float = Field(2.0, gt=1, le=_MAX_RATIO)
    baseline_window: int = Field(50, ge=2, le=_MAX_SIGNAL_WINDOW)
    patience: int = Field(3, ge=1, le=_MAX_STEPS)
    skip_batches: int | None = Field(None, ge=0, le=_MAX_STEPS)
    max_rollbacks: int = Field(3, ge=1, le=_MAX_COUNT)
    window_steps: int = Field(1000, ge=1, le=_MAX_STEPS)


class HeartbeatPolicy(_Section):
    """Level-0 heartbeat: written every ``every`` steps, whatever the scheduler decides."""

    every: int = Field(1, ge=1, le=_MAX_STEPS)


class PulsePolicy(_Section):
    """Level-1 pulse. ``fsync``: whether a pulse written to the remote tier (no peer tier,
    or the peers could not take it) is fsynced like an organ. Off by default: a pulse stands
    in for the memory and peer tiers, which survive the process, not the node; without the
    fsync it costs the write into the page cache only, survives any crash of the training
    process, and after a power loss the restore finds it incomplete by its digests and walks
    back to the newest organ."""

    fsync: bool = False


class LevelsPolicy(_Section):
    """Checkpoint levels with settings of their own."""

    heartbeat: HeartbeatPolicy = Field(default_factory=HeartbeatPolicy)
    pulse: PulsePolicy = Field(default_factory=PulsePolicy)


class CodecsPolicy(_Section):
    """Lossless codecs per tensor family (SPEC §5)."""

    weights: CodecName = "xor_delta"
    optimizer: CodecName = "auto"
    other: CodecName = "auto"
    prefix_bits: int = Field(12, ge=1, le=31)
    zstd_level: int = Field(1, ge=1, le=22)
    threads: int = Field(0, ge=0, le=_MAX_THREADS)


class MemoryTierPolicy(_Section):
    """This process's CPU-memory tier; ``max_bytes`` bounds what it holds."""

    enabled: bool = True
    max_bytes: _ByteSize = 8 * 2**30


class PeerTierPolicy(_Section):
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
        tuple[_Endpoint, ...], BeforeValidator(_list_to_tuple), Field(max_length=_MAX_PEERS)
    ] = ()
    data_shards: int = Field(3, ge=1, le=_MAX_PEERS)
    parity: bool = True
    lease_seconds: float = Field(600.0, ge=1, le=_MAX_SECONDS)
    timeout_seconds: _Seconds = 10.0
    probe_interval: float = Field(1.0, ge=0.01, le=_MAX_SECONDS)
    registry: _Endpoint | None = None
    deltas: Literal["auto", "always", "never"] = "auto"
    # The job's peer secret (``tiers/peer/auth.py``), created 0600 when missing; every
    # trainer and daemon of the job needs the same. CKPTPILOT_PEER_SECRET overrides it.
    secret_file: Annotated[str, AfterValidator(_check_path_text)] = Field(
        "{run_dir}/peer.secret", min_length=1, max_length=_MAX_PATH_CHARS)

    @model_validator(mode="after")
    def _check_peers(self) -> Self:
        seen: set[str] = set()
        for i, endpoint in enumerate(self.endpoints):
            if endpoint in seen:
                raise _KeyedError(
                    f"endpoints[{i}]", f"{endpoint!r} is listed twice; list each peer once"
                )
            seen.add(endpoint)
        shards = self.data_shards + (1 if self.parity else 0)
        if self.enabled and len(self.endpoints) < shards:
            parity = " + 1 parity" if self.parity else ""
            raise _KeyedError(
                "endpoints",
                f"the peer tier is enabled with {shards} shards ({self.data_shards} data"
                f"{parity}), each on its own peer, but {len(self.endpoints)} endpoint(s) are "
                "listed; add endpoints, lower data_shards, or set enabled: false",
            )
        return self


class RemoteRetriesPolicy(_Section):
    """How often one object-store operation (a read, a listing, one object's write) is tried
    before the tier gives up on it: a reset connection or a restarting server is normal
    weather there, not a lost checkpoint. The wait doubles from ``backoff_seconds`` up to
    ``max_backoff_seconds``; ``attempts`` also goes to s3fs and botocore (S3 URLs) unless
    ``storage_options`` set their own."""

    attempts: int = Field(4, ge=1, le=100)
    backoff_seconds: float = Field(0.5, ge=0, le=_MAX_SECONDS)
    max_backoff_seconds: float = Field(8.0, ge=0, le=_MAX_SECONDS)


class RemoteTierPolicy(_Section):
    """Remote persistent tier: an fsspec URL or a local path."""

    url: Annotated[str, AfterValidator(_check_url)] = Field(
        "{run_dir}/checkpoints", min_length=1, max_length=_MAX_PATH_CHARS
    )
    bandwidth: _ByteSize = 2 * 10**9
    # Passed to fsspec as they are (endpoint_url, key/secret, profile, client_kwargs …).
    # Secrets: left out of repr; never logged, never written to the metadata store.
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    retries: RemoteRetriesPolicy = Field(default_factory=RemoteRetriesPolicy)
    # What a restore checks each chunk it reads against (``format.digest`` states each one's
    # guarantee): ``sha256`` stands against a deliberate substitution, ``xxh3`` only against
    # accidental damage, for far less CPU. Checkpoints without XXH3 digests (manifest
    # version 2 and older) are always checked by SHA256; ``validate`` always uses SHA256.
    verify_reads: Literal["sha256", "xxh3"] = "sha256"


class TiersPolicy(_Section):
    """Where checkpoints live (SPEC §6)."""

    memory: MemoryTierPolicy = Field(default_factory=MemoryTierPolicy)
    peer: PeerTierPolicy = Field(default_factory=PeerTierPolicy)
    remote: RemoteTierPolicy = Field(default_factory=RemoteTierPolicy)


class ValidationPolicy(_Section):
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


class BestMetricPolicy(_Section):
    """Never prune the ``keep`` best checkpoints by a metric the user reports
    (``pilot.report_metric(metric, value)``); ``mode`` says whether lower or higher is better."""

    metric: str = Field(min_length=1, max_length=_MAX_NAME_CHARS)
    mode: Literal["min", "max"] = "min"
    keep: int = Field(3, ge=1, le=_MAX_COUNT)


class RetentionPolicy(_Section):
    """Retention classes from the health score at save time (SPEC §4, §8)."""

    critical_score: float = Field(0.8, ge=0, le=1)
    important_score: float = Field(0.5, ge=0, le=1)
    important_keep: int = Field(3, ge=1, le=_MAX_COUNT)
    routine_keep: int = Field(1, ge=1, le=_MAX_COUNT)
    # The newest N valid checkpoints of each rank and tier are never removed, whatever their
    # class: a newest one that rots after validation needs an older one to walk back to.
    keep_last: int = Field(2, ge=1, le=_MAX_COUNT)
    best: BestMetricPolicy | None = None
    # Applied by the writer thread after every save published valid (rank 0 for the run).
    auto: bool = True
    # Disk budget on the remote tier: total checkpoint bytes, and free space to keep on its
    # file system (where that can be known). None: no limit.
    max_bytes: _ByteSize | None = None
    min_free_bytes: _ByteSize | None = None

    @property
    def budgeted(self) -> bool:
        """Whether a disk budget applies (every rank can tell, pruner or not)."""
        return self.max_bytes is not None or self.min_free_bytes is not None

    @model_validator(mode="after")
    def _check_scores(self) -> Self:
        if self.important_score > self.critical_score:
            raise _KeyedError(
                "important_score",
                f"important_score ({self.important_score}) is above critical_score "
                f"({self.critical_score})",
            )
        return self


class ObservabilityPolicy(_Section):
    """Decision log (JSON lines) and TensorBoard scalars."""

    tensorboard: bool = True
    decision_log: bool = True


class AsyncPolicy(_Section):
    """Background save pipeline; ``max_pending`` saves in flight before the training blocks.

    ``background_priority``: ``nice`` runs the background work (hashing, encoding, writing,
    TensorBoard) at nice 10; ``idle`` under ``SCHED_IDLE``, so it takes no time slice from
    training, but only runs when nothing else on the machine wants a core: on training that
    keeps every core busy a save then waits until it is lifted (``ckptpilot.background``),
    and the newest recovery point lags. Opt in where training leaves cores free (GPU jobs).
    """

    max_pending: int = Field(2, ge=1, le=_MAX_PENDING)
    background_priority: Literal["nice", "idle"] = "nice"


_OS_SIGNAL_RE = re.compile(r"SIG[A-Z0-9]{1,12}")
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def _check_signal_name(value: object) -> object:
    if isinstance(value, str) and (not _OS_SIGNAL_RE.fullmatch(value)
                                   or not isinstance(getattr(signal, value, None), signal.Signals)
                                   or value in _UNCATCHABLE):
        raise ValueError(
            f"{_brief(value)} is not a signal this platform lets a process catch; write a "
            "name such as SIGTERM, SIGUSR1 or SIGINT")
    return value


class PreemptionPolicy(_Section):
    """A preemption notice (docs/operations/preemption-and-hangs.md): any of ``signals``
    makes the pilot save an emergency organ at the next step boundary, wait up to
    ``grace_seconds`` from the notice for it to be durable and valid, and exit with
    ``ExitStatus.PREEMPTED`` (75), or ``PREEMPTED_UNSAVED`` (76) when it was not in time.
    Handlers are installed only by a pilot built on the main thread."""

    enabled: bool = True
    signals: Annotated[
        tuple[Annotated[str, AfterValidator(_check_signal_name)], ...],
        BeforeValidator(_list_to_tuple), Field(min_length=1, max_length=8)
    ] = ("SIGTERM", "SIGUSR1")
    grace_seconds: _Seconds = 25.0

    @model_validator(mode="after")
    def _check_unique(self) -> Self:
        if len(set(self.signals)) != len(self.signals):
            raise _KeyedError("signals", f"lists a signal twice: {list(self.signals)}")
        return self


class WatchdogPolicy(_Section):
    """The hang watchdog (docs/operations/preemption-and-hangs.md): no step boundary for
    ``max(min_seconds, step_time_multiple x the median step time)`` ends the process with
    ``ExitStatus.HANG`` (77) so that the launcher restarts the job. Off by default: a loop
    that legitimately spends long between two ``observe()`` calls (a long evaluation) must
    raise ``min_seconds`` above that first."""

    enabled: bool = False
    step_time_multiple: float = Field(20.0, ge=2, le=_MAX_RATIO)
    min_seconds: _Seconds = 600.0


class Policy(_Section):
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

    run_dir: Annotated[str, AfterValidator(_check_path_text)] = Field(
        "runs/default", min_length=1, max_length=_MAX_PATH_CHARS)
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
        return _resolve(template, source=None)

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


def default_policy_path() -> Path:
    """The reference policy file installed with the package (``configs/default.yaml`` of the
    source tree): every key at its default, each one commented — the file to copy and edit.
    ``load_policy()`` with no path gives the same values."""
    return Path(str(importlib.resources.files("ckptpilot") / "configs" / "default.yaml"))


def load_policy(
    path: str | os.PathLike[str] | None = None,
    *,
    run_dir: str | os.PathLike[str] | None = None,
) -> Policy:
    """Read, validate and resolve a policy file.

    ``path=None`` gives the defaults and an empty file does too. ``run_dir`` overrides the
    file's ``run_dir``; then every ``{run_dir}`` in a string value (at any depth, list items
    included) is replaced by it. Literal braces are written ``{{`` and ``}}``. Relative paths
    stay relative to the working directory, not to the policy file.
    Every problem raises :class:`PolicyError` naming the key (and the file).
    """
    source = None if path is None else os.fspath(path)
    data = {} if source is None else _read_yaml(source)
    if run_dir is not None:
        data["run_dir"] = os.fspath(run_dir)
    template = _validate(data, source).model_dump(mode="json", by_alias=True)
    return _resolve(template, source)


def _read_yaml(source: str) -> dict[Any, Any]:
    try:
        with Path(source).open("rb") as file:
            raw = file.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError as exc:
        raise PolicyError("", f"policy file not found: {source}") from exc
    except IsADirectoryError as exc:
        raise PolicyError("", f"{source} is a directory; pass the policy YAML file") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise PolicyError("", f"cannot read policy file {source}: {exc}") from exc
    if len(raw) > _MAX_FILE_BYTES:
        raise PolicyError(
            "", f"{source} is over {_MAX_FILE_BYTES // 2**20} MiB; a policy file is a few KB"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise PolicyError(
            "",
            f"{source}:{line}: byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8 "
            "(comments included); save the file as UTF-8",
        ) from exc
    try:
        data = yaml.load(text, Loader=_PolicyLoader)  # a SafeLoader: builds no objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise PolicyError("", f"{where}: invalid YAML: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyError("", f"{source}: invalid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise PolicyError("", f"{source}: the top level must be a mapping of keys, got {kind}")
    return data


_PATTERN_TAGS = frozenset(
    f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float", "timestamp")
)
"""Tags whose constructors only work on values that match the resolver's pattern for them."""


class _PolicyLoader(yaml.SafeLoader):
    """SafeLoader that refuses what no policy needs and what would escape as another error.

    Refused: a key repeated in one mapping (YAML would let the last one win silently), nesting
    deeper than ``_MAX_YAML_DEPTH`` (the composer recurses per level), a document whose values,
    with every alias expanded, exceed ``_MAX_YAML_VALUES`` or ``_MAX_YAML_DEPTH`` or contain
    themselves, merge keys, integer literals longer than ``_MAX_INT_CHARS``, and an explicit
    ``!!int`` / ``!!float`` / ``!!bool`` / ``!!timestamp`` on a value not written that way.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self._depth >= _MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"nested deeper than {_MAX_YAML_DEPTH} levels; a policy has at most 5",
                self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's int/float/bool/timestamp constructors trust the resolver's pattern; a tag
        # written out (``!!int x``) skips it and they fail with IndexError, ValueError...
        if (
            isinstance(node, yaml.ScalarNode)
            and node.tag in _PATTERN_TAGS
            and self.resolve(yaml.ScalarNode, node.value, (True, False)) != node.tag
        ):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{reprlib.repr(node.value)} is not a valid !!{node.tag.rpartition(':')[2]}",
                node.start_mark,
            )
        return super().construct_object(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > _MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"integer literal of {len(node.value)} characters; no policy value needs more "
                f"than {_MAX_INT_CHARS}",
                node.start_mark,
            )
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):  # ``!!set 0``: the base class refuses it
            return super().construct_mapping(node, deep=deep)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "merge keys (<<) are not supported; write the keys out",
                    key_node.start_mark,
                )
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # ``!!omap`` as a key: the base class refuses it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {reprlib.repr(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_PolicyLoader.add_constructor("tag:yaml.org,2002:int", _PolicyLoader.construct_yaml_int)


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph that, with its aliases expanded, is too big, too deep or cyclic.

    PyYAML shares one node (and one Python value) between an anchor and its aliases, so nine
    aliases nine levels deep cost nothing to load but expand to 9**9 values for whoever
    prints them, and ``&a [*a]`` contains itself. Sizes and depths are computed once per
    node, bottom up, without recursion: alias chains can be far deeper than the text.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()  # ancestors of the node being visited
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            size[id(node)] = 1 + sum(size[id(child)] for child in children)
            depth[id(node)] = 1 + max((depth[id(child)] for child in children), default=0)
            if size[id(node)] > _MAX_YAML_VALUES:
                problem = f"holds more than {_MAX_YAML_VALUES} values; a policy has about 60"
            elif depth[id(node)] > _MAX_YAML_DEPTH:
                problem = f"is nested deeper than {_MAX_YAML_DEPTH} levels; a policy has 5"
            else:
                continue
            raise yaml.composer.ComposerError(
                None, None, f"with its aliases expanded, this value {problem}", node.start_mark
            )
        if id(node) in size:
            continue
        if id(node) in open_nodes:
            raise yaml.composer.ComposerError(
                None, None, "an alias refers to a value that contains it", node.start_mark
            )
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _resolve(template: dict[str, Any], source: str | None) -> Policy:
    """Validate ``template`` with ``{run_dir}`` substituted; keep the template for later moves."""
    run_dir = template["run_dir"]
    where = "" if source is None else f" [in {source}]"
    if "{run_dir}" in run_dir:
        raise PolicyError("run_dir", f"run_dir cannot refer to itself{where}")
    resolved = {
        key: value if key == "run_dir" else _interpolate(value, run_dir, key, where)
        for key, value in template.items()
    }
    policy = _validate(resolved, source)
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


def _validate(data: Any, source: str | None) -> Policy:
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise _policy_error(exc, source) from exc


_TYPE_MESSAGES = {
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
}


def _policy_error(exc: ValidationError, source: str | None = None) -> PolicyError:
    """The one place where pydantic's errors become a :class:`PolicyError` on a YAML path."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    parts, parent = _yaml_path(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, _KeyedError):
        if cause.key:
            parts.append(cause.key)
        message = cause.message
    elif isinstance(cause, ValueError):
        message = str(cause)
    elif error["type"] == "extra_forbidden":
        message = _unknown_key_message(parts[-1] if parts else "", parent)
    else:
        summary = _TYPE_MESSAGES.get(error["type"], error["msg"])
        message = f"{summary} (got {_brief(error['input'])})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more problem(s) after this one"
    if source is not None:
        message += f" [in {source}]"
    return PolicyError(".".join(parts), message)


def _brief(value: object) -> str:
    """A short repr; a value holding an int past Python's digit limit for ``str()`` (which
    only a model built in Python can hold: YAML integers are bounded) is named by type."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to show>"


def _yaml_path(loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """Map a pydantic ``loc`` to YAML path parts and the model holding the last key.

    Field names become their YAML aliases (``async_`` → ``async``), list indices become
    ``[i]`` suffixes, and the union/validator tags pydantic adds after a leaf are dropped.
    """
    parts: list[str] = []
    model: type[BaseModel] | None = Policy
    parent: type[BaseModel] | None = None
    named = False  # the next item names an entry of a mapping of sections
    for item in loc:
        if model is None:
            if isinstance(item, int) and parts:
                parts[-1] += f"[{item}]"
            continue
        if named:  # ``scheduler.extra_signals.<name>``: the name is the user's key
            parts.append(str(item))
            named = False
            continue
        parent = model
        name, field = _field(model, str(item))
        parts.append(name)
        model = _model_of(field.annotation) if field is not None else None
        named = field is not None and model is not None and get_origin(field.annotation) is dict
    return parts, parent


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds, directly or as ``Model | None``."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _field(model: type[BaseModel], key: str) -> tuple[str, FieldInfo | None]:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field.alias or name, field
    return key, None


def _unknown_key_message(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return "unknown key"
    allowed = [field.alias or name for name, field in model.model_fields.items()]
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}allowed keys: {', '.join(allowed)}"
