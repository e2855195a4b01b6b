"""Retries of the remote tier's operations against a network that fails and comes back.

An object store is reached over connections that get reset, time out or find the server
restarting; one such error is no reason to give up a checkpoint. ``retrying`` runs one
operation that can be repeated as it is, waits between attempts (doubling, capped) and logs
each retry; after the last one it raises ``RemoteIOError`` naming what it did, where, and the
cause. Which errors count as transient: the ``OSError`` family (resets, broken pipes, refused
connections, timeouts) but not the answers of a server that works (not found, denied), and
the connection errors of botocore and aiohttp — imported only if installed, never required.

``fs_options`` hands the attempts to s3fs and botocore for ``s3://`` URLs, so that their own
retries (of one HTTP request) follow the policy too, unless the user's options set them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from ckptpilot.errors import RemoteIOError

log = logging.getLogger(__name__)

T = TypeVar("T")

# A server that answered: repeating the request gets the same answer.
_ANSWERS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
            NotADirectoryError)
_inside = threading.local()  # an operation made of retried ones is retried as one


class Retries(Protocol):
    """``tiers.remote.retries`` of the policy (``RemoteRetriesPolicy``)."""

    attempts: int
    backoff_seconds: float
    max_backoff_seconds: float


class _Once:
    attempts = 1
    backoff_seconds = 0.0
    max_backoff_seconds = 0.0


NO_RETRIES: Retries = _Once()


@functools.cache
def _network_errors() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = []
    try:
        from botocore import exceptions as boto
    except ImportError:
        pass
    else:  # EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, …
        found += [boto.ConnectionError, boto.HTTPClientError]
    try:
        import aiohttp
    except ImportError:
        pass
    else:
        found.append(aiohttp.ClientError)
    return tuple(found)


def transient(error: BaseException) -> bool:
    """Whether ``error`` may be gone on the next attempt (the network, not the answer)."""
    if isinstance(error, RemoteIOError):
        return False  # retried already
    if isinstance(error, OSError):
        return not isinstance(error, _ANSWERS)
    return isinstance(error, _network_errors())


def inside_retry() -> bool:
    """Whether this thread runs inside ``retrying`` (which turns errors into
    ``RemoteIOError`` itself, after its attempts)."""
    return bool(getattr(_inside, "depth", 0))


def gave_up(what: str, attempts: int, error: BaseException) -> RemoteIOError:
    return RemoteIOError(f"cannot {what} after {attempts} attempt(s) (tiers.remote.retries): "
                         f"{type(error).__name__}: {error}")


def retrying(retries: Retries, what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, tried up to ``retries.attempts`` times while it fails transiently; then
    ``RemoteIOError`` naming ``what`` (the operation and its URL) and the last cause."""
    if inside_retry():
        return fn(*args)
    attempts = max(1, int(retries.attempts))
    wait = float(retries.backoff_seconds)
    _inside.depth = 1
    try:
        for attempt in range(1, attempts + 1):
            try:
                return fn(*args)
            except Exception as e:
                if not transient(e):
                    raise
                cause = f"{type(e).__name__}: {e}"
                if attempt == attempts:
                    raise gave_up(what, attempts, e) from e
                log.warning("%s failed (%s); retry %d of %d in %.2fs", what, cause, attempt,
                            attempts - 1, wait)
                time.sleep(wait)
                wait = min(wait * 2, float(retries.max_backoff_seconds))
    finally:
        _inside.depth = 0
    raise AssertionError("unreachable")


def fs_options(url: str, storage_options: Mapping[str, Any] | None,
               retries: Retries) -> tuple[dict[str, Any], int | None]:
    """The fsspec options for ``url`` and, for S3, the attempts of s3fs (its ``retries``
    attribute: s3fs takes no such argument): the user's ``retries`` and botocore
    ``config_kwargs.retries`` where they set them, else ``retries.attempts`` (botocore in its
    standard mode; ``total_max_attempts`` counts the first try, as ``attempts`` does)."""
    options = dict(storage_options or {})
    if not url.startswith(("s3://", "s3a://")):
        return options, None
    library = options.pop("retries", None)
    if retries is NO_RETRIES:
        return options, None if library is None else int(library)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": int(retries.attempts),
                                  "mode": "standard"})
    options["config_kwargs"] = config
    return options, int(retries.attempts if library is None else library)
