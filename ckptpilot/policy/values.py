"""The policy's value types and bounds, shared by every section of the schema.

Bounds: a policy that loads is one the pilot can run, so every check the tiers and the
scheduler would make later is made at load time. Every number has an upper bound far
beyond what a real run needs (windows of 100,000 probes, timeouts of a day, a PiB of memory)
because the consumers size buffers, thread pools and socket timeouts from these values: an
unbounded window is a multi-GB allocation and a timeout of 1e300 s overflows the socket layer.
Strings and lists are bounded for the same reason (the file itself: ``reader``). The remote
URL's fsspec protocol is checked against the installed backends because it would otherwise
fail only when the pilot starts.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import signal
from fractions import Fraction
from typing import Annotated, Any, Literal

import fsspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

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
MAX_STEPS = 10**9
"""Intervals counted in optimizer steps."""
MAX_SIGNAL_WINDOW = 1000
"""Windows kept sorted on the training thread, per step (the spike detector's baseline)."""
MAX_SIGNAL_SPAN = 1000
"""Spans of the scheduler's signal EWMAs: one that needs longer to follow a change is no
signal (the state is a few floats whatever the span)."""
MAX_EXTRA_SIGNALS = 16
"""Signals beyond the built-in ones: each is measured, and sent to the other ranks, per step."""
MAX_COUNT = 100_000
"""Counts of steps, probes or checkpoints (``organ_every``, ``*_keep``)."""
MAX_SECONDS = 86_400.0
"""Durations and timeouts: one day; socket timeouts overflow long before 1e300 s."""
MAX_RATIO = 1e6
"""Unitless thresholds (sigmas, relative changes, decades per step): far past any signal."""
MAX_BYTES = 2**50
"""Byte sizes and byte rates: 1 PiB (per second)."""
MAX_PEERS = 1024
"""Peer endpoints and shards: the peer protocol's limit on ``shard_count``."""
MAX_THREADS = 1024
MAX_PENDING = 64
"""Saves in flight: each holds a full host copy of the training state."""
MAX_PATH_CHARS = 4096
"""``run_dir`` and ``tiers.remote.url``: Linux's PATH_MAX."""
MAX_NAME_CHARS = 256
MAX_HOST_CHARS = 255
"""A DNS name has at most 253 characters; an IPv6 literal with its brackets far fewer."""

_BYTE_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")

_FACTORY_RE = re.compile(r"[A-Za-z_][\w.]*[:.][A-Za-z_][\w.]*", re.ASCII)
_ENDPOINT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


class KeyedError(ValueError):
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
    if len(match.group(1)) > MAX_HOST_CHARS:
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


def check_path_text(path: str) -> str:
    """A NUL or another control character in a path makes the OS call fail later, far from
    the policy; refuse it here."""
    bad = next((c for c in path if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"contains the control character {bad!r}: {path[:80]!r}")
    return path


def check_url(url: str) -> str:
    """Refuse a protocol fsspec does not know, or whose optional package is not installed.

    ``get_filesystem_class`` imports the backend and nothing more: no connection is made.
    """
    check_path_text(url)
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


def check_nvml(value: object) -> object:
    # Literal[True] alone would also accept the integer 1.
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"expected auto, true or false, got {value!r}")


def list_to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


ByteSize = Annotated[int, BeforeValidator(parse_byte_size), Field(ge=1, le=MAX_BYTES)]
"""A positive byte count; YAML may give an int or a string with a unit (``8GiB``)."""

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
"""A positive duration of at most a day."""

Endpoint = Annotated[str, AfterValidator(_check_endpoint)]
"""A peer address, ``host:port``."""

CodecName = Literal["raw", "zstd", "byteplane", "expplane", "xor_delta", "prefix_index",
                    "auto"]
"""Names accepted by ``ckptpilot.codecs.get_codec`` (SPEC §5)."""


class Section(BaseModel):
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


def check_factory_text(value: object) -> object:
    if isinstance(value, str) and (len(value) > MAX_NAME_CHARS
                                   or not _FACTORY_RE.fullmatch(value)):
        raise ValueError(
            f"{brief(value)} is no import path; write 'package.module:ClassName' (at most "
            f"{MAX_NAME_CHARS} characters)")
    return value


_OS_SIGNAL_RE = re.compile(r"SIG[A-Z0-9]{1,12}")
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def check_signal_name(value: object) -> object:
    if isinstance(value, str) and (not _OS_SIGNAL_RE.fullmatch(value)
                                   or not isinstance(getattr(signal, value, None), signal.Signals)
                                   or value in _UNCATCHABLE):
        raise ValueError(
            f"{brief(value)} is not a signal this platform lets a process catch; write a "
            "name such as SIGTERM, SIGUSR1 or SIGINT")
    return value


def brief(value: object) -> str:
    """A short repr; a value holding an int past Python's digit limit for ``str()`` (which
    only a model built in Python can hold: YAML integers are bounded) is named by type."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to show>"
