"""The run policy: pydantic models of the policy YAML (SPEC §3) and ``load_policy``.

This module owns the schema of every tunable, its defaults, its validation and the
``{run_dir}`` interpolation. It reads the policy file and nothing else: it never creates or
inspects the run directory, and it holds no behaviour — the scheduler, codecs, tiers and
pilot read these values and decide what to do with them.

Every model is frozen and rejects unknown keys. Whatever goes wrong surfaces as one
:class:`~ckptpilot.errors.PolicyError` whose ``key`` is the dotted path in the YAML
(``scheduler.min_interval``, ``tiers.peer.endpoints[1]``, ``async.max_pending``), so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import os
import re
import reprlib
import string
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
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
    "GradSignalPolicy",
    "HeartbeatPolicy",
    "LevelsPolicy",
    "LossSignalPolicy",
    "MemoryTierPolicy",
    "ObservabilityPolicy",
    "PeerTierPolicy",
    "Policy",
    "RemoteTierPolicy",
    "RetentionPolicy",
    "SchedulerPolicy",
    "SchedulerWeights",
    "SystemSignalPolicy",
    "TiersPolicy",
    "ValidationPolicy",
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
_BYTE_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
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
            f"expected 'host:port' with a port in 1..65535 (IPv6 as '[::1]:port'), got {value!r}"
        )
    return value


def _check_nvml(value: object) -> object:
    # Literal[True] alone would also accept the integer 1.
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"expected auto, true or false, got {value!r}")


def _list_to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


_ByteSize = Annotated[int, BeforeValidator(parse_byte_size), Field(ge=1)]
"""A positive byte count; YAML may give an int or a string with a unit (``8GiB``)."""

_Endpoint = Annotated[str, AfterValidator(_check_endpoint)]
"""A peer address, ``host:port``."""

CodecName = Literal["raw", "zstd", "byteplane", "xor_delta", "prefix_index", "auto"]
"""Names accepted by ``ckptpilot.codecs.get_codec`` (SPEC §5)."""


class _Section(BaseModel):
    # strict: a quoted "100" or a 1 for a boolean is a mistake in a policy file, not a value
    # to coerce; ints are still accepted where a float is expected.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class SchedulerWeights(_Section):
    """Weights of the three signals in the health score; non-negative, summing to 1."""

    loss: float = 0.4
    grad: float = 0.35
    system: float = 0.25

    @model_validator(mode="after")
    def _check_sum(self) -> Self:
        weights = {"loss": self.loss, "grad": self.grad, "system": self.system}
        negative = [name for name, weight in weights.items() if weight < 0]
        if negative:
            raise _KeyedError("", f"weights must not be negative ({', '.join(negative)})")
        total = sum(weights.values())
        if abs(total - 1.0) > 1e-6:
            terms = " + ".join(f"{weight:g}" for weight in weights.values())
            raise _KeyedError(
                "",
                f"loss + grad + system must sum to 1, got {terms} = {total:g} "
                "(a weight left out keeps its default); rescale them",
            )
        return self


class LossSignalPolicy(_Section):
    """Loss-trend signal: EWMA of the log10-loss slope (SPEC §4.1)."""

    ewma_alpha: float = Field(0.2, gt=0, le=1)
    window: int = Field(20, ge=2)
    slope_threshold: float = Field(0.05, gt=0)
    consecutive: int = Field(3, ge=1)


class GradSignalPolicy(_Section):
    """Gradient-activity signal: grad-norm outliers against a rolling window (SPEC §4.2)."""

    probe_every: int = Field(10, ge=1)
    window: int = Field(50, ge=2)
    k_sigma: float = Field(3.0, gt=0)
    min_rel_change: float = Field(0.1, ge=0)
    consecutive: int = Field(2, ge=1)


class SystemSignalPolicy(_Section):
    """System-health signal: NVML errors and IO latency (SPEC §4.3).

    ``nvml``: ``auto`` uses NVML when a GPU and the library are present, ``true`` requires it,
    ``false`` never loads it.
    """

    nvml: Annotated[Literal["auto", True, False], BeforeValidator(_check_nvml)] = "auto"
    io_latency_ms: float = Field(15, gt=0)
    sustained_seconds: float = Field(5, gt=0)


class SchedulerPolicy(_Section):
    """Adaptive checkpoint scheduler (SPEC §4); intervals are in optimizer steps."""

    base_interval: int = Field(100, ge=1)
    min_interval: int = Field(10, ge=1)
    max_interval: int = Field(500, ge=1)
    trigger_threshold: float = Field(0.7, ge=0, le=1)
    weights: SchedulerWeights = Field(default_factory=SchedulerWeights)
    loss: LossSignalPolicy = Field(default_factory=LossSignalPolicy)
    grad: GradSignalPolicy = Field(default_factory=GradSignalPolicy)
    system: SystemSignalPolicy = Field(default_factory=SystemSignalPolicy)
    organ_every: int = Field(10, ge=1)
    young_daly: bool = True

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


class HeartbeatPolicy(_Section):
    """Level-0 heartbeat: written every ``every`` steps, whatever the scheduler decides."""

    every: int = Field(1, ge=1)


class LevelsPolicy(_Section):
    """Checkpoint levels; only the heartbeat has settings of its own."""

    heartbeat: HeartbeatPolicy = Field(default_factory=HeartbeatPolicy)


class CodecsPolicy(_Section):
    """Lossless codecs per tensor family (SPEC §5)."""

    weights: CodecName = "xor_delta"
    optimizer: CodecName = "auto"
    other: CodecName = "auto"
    prefix_bits: int = Field(12, ge=1, le=31)
    zstd_level: int = Field(1, ge=1, le=22)
    threads: int = Field(0, ge=0)


class MemoryTierPolicy(_Section):
    """This process's CPU-memory tier; ``max_bytes`` bounds what it holds."""

    enabled: bool = True
    max_bytes: _ByteSize = 8 * 2**30


class PeerTierPolicy(_Section):
    """Peer-memory tier: ``data_shards`` shards plus an optional XOR parity shard (SPEC §6).

    The number of endpoints is not checked against ``data_shards`` here: how many peers are
    needed and which are alive is the peer tier's decision at save time.
    """

    enabled: bool = False
    endpoints: Annotated[tuple[_Endpoint, ...], BeforeValidator(_list_to_tuple)] = ()
    data_shards: int = Field(3, ge=1)
    parity: bool = True
    lease_seconds: float = Field(600.0, gt=0)
    timeout_seconds: float = Field(10.0, gt=0)
    probe_interval: float = Field(1.0, gt=0)
    registry: _Endpoint | None = None
    deltas: Literal["auto", "always", "never"] = "auto"


class RemoteTierPolicy(_Section):
    """Remote persistent tier: an fsspec URL or a local path."""

    url: str = Field("{run_dir}/checkpoints", min_length=1)
    bandwidth: _ByteSize = 2 * 10**9


class TiersPolicy(_Section):
    """Where checkpoints live (SPEC §6)."""

    memory: MemoryTierPolicy = Field(default_factory=MemoryTierPolicy)
    peer: PeerTierPolicy = Field(default_factory=PeerTierPolicy)
    remote: RemoteTierPolicy = Field(default_factory=RemoteTierPolicy)


class ValidationPolicy(_Section):
    """Checks run before a checkpoint is published (SPEC §7).

    ``load_test``: ``subprocess`` decodes every checkpoint in a separate process; ``none``
    skips it (the word ``off`` would be read by YAML as the boolean false).
    """

    sha256: bool = True
    load_test: Literal["subprocess", "none"] = "subprocess"
    consistency: bool = True


class BestMetricPolicy(_Section):
    """Never prune the ``keep`` best checkpoints by a metric the user reports
    (``pilot.report_metric(metric, value)``); ``mode`` says whether lower or higher is better."""

    metric: str = Field(min_length=1)
    mode: Literal["min", "max"] = "min"
    keep: int = Field(3, ge=1)


class RetentionPolicy(_Section):
    """Retention classes from the health score at save time (SPEC §4, §8)."""

    critical_score: float = Field(0.8, ge=0, le=1)
    important_score: float = Field(0.5, ge=0, le=1)
    important_keep: int = Field(3, ge=1)
    routine_keep: int = Field(1, ge=1)
    best: BestMetricPolicy | None = None

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
    """Background save pipeline; ``max_pending`` saves in flight before the training blocks."""

    max_pending: int = Field(2, ge=1)


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

    run_dir: str = Field("runs/default", min_length=1)
    scheduler: SchedulerPolicy = Field(default_factory=SchedulerPolicy)
    levels: LevelsPolicy = Field(default_factory=LevelsPolicy)
    codecs: CodecsPolicy = Field(default_factory=CodecsPolicy)
    tiers: TiersPolicy = Field(default_factory=TiersPolicy)
    validation: ValidationPolicy = Field(default_factory=ValidationPolicy)
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)
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
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise PolicyError("", f"policy file not found: {source}") from exc
    except OSError as exc:
        raise PolicyError("", f"cannot read policy file {source}: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds no objects
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping, which YAML would let win silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


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
        message = f"{summary} (got {reprlib.repr(error['input'])})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more problem(s) after this one"
    if source is not None:
        message += f" [in {source}]"
    return PolicyError(".".join(parts), message)


def _yaml_path(loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """Map a pydantic ``loc`` to YAML path parts and the model holding the last key.

    Field names become their YAML aliases (``async_`` → ``async``), list indices become
    ``[i]`` suffixes, and the union/validator tags pydantic adds after a leaf are dropped.
    """
    parts: list[str] = []
    model: type[BaseModel] | None = Policy
    parent: type[BaseModel] | None = None
    for item in loc:
        if model is None:
            if isinstance(item, int) and parts:
                parts[-1] += f"[{item}]"
            continue
        parent = model
        name, field = _field(model, str(item))
        parts.append(name)
        annotation = field.annotation if field is not None else None
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation if is_model else None
    return parts, parent


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
