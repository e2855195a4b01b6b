"""Peer authentication: the job's shared secret, and the HMAC that binds every frame to it
and to its place on its connection (SPEC §6).

Owns: where the secret comes from, creating a secret file on first use, the connection
handshake's nonces and every tag. Must not: read or write sockets (``calls`` and ``daemon``
do), or decide what to do with a frame that fails (the daemon refuses it with an ERR and
closes; the client raises :class:`PeerAuthError`).

Why. A daemon holds other nodes' checkpoint shards; without a secret, anyone who can reach
its port can replace a run's shards with their own (recomputing every XXH3 digest, which are
no secret), drop them, or answer a client in a daemon's place. With a per-job secret, only
holders of the secret can change or read what a daemon holds for the job, and a client
accepts only replies made with it.

The secret: ``CKPTPILOT_PEER_SECRET`` (the secret itself, for launchers that hand out
secrets through the environment) or else a secret file: the policy's
``tiers.peer.secret_file`` (default ``{run_dir}/peer.secret``) for a trainer,
``--secret-file`` for ``ckptpilot peer serve``. A missing file is created with 32 random
bytes (hex), mode 0600, atomically (whoever comes first writes it; the others read it); a
file that its group or others may read is refused, as ssh refuses such a key. Every trainer
and daemon of one job must have the same secret.

The handshake and the tags. On accept the daemon sends HELLO ``{"nonce": N_d}``, tagged with
the key alone; the client checks it (a daemon with another secret is named at once, before
anything is sent) and sends HELLO ``{"nonce": N_c}``, tagged over ``N_d``. From then on every
frame carries ``HMAC-SHA256(key, N_d | N_c | direction | n | prelude + header)``, ``n``
counting the frames of that direction on the connection. So a request recorded on one
connection is refused on any other and at any other place on its own, and a reply answers
exactly the request it follows. Payloads are bound through the digests the tagged header
carries (``meta_digest``, ``delta_digest``, ``digest``); a PUT's shard digest follows the
shard, so the PUT's trailer carries a tag of its own over the frame's tag and that digest.
What the digests themselves guarantee is in ``digest``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from ckptpilot.errors import CkptPilotError
from ckptpilot.tiers.peer.errors import ProtocolError

SECRET_ENV = "CKPTPILOT_PEER_SECRET"
"""The environment variable that holds the job's peer secret itself (not a path)."""
MIN_SECRET_BYTES = 16
TAG_BYTES = 32
NONCE_BYTES = 16
NO_TAG = bytes(TAG_BYTES)
"""The tag of a frame sent without a key (a daemon refusing a connection before its
handshake): it verifies with no key, so a client takes such a frame only as a refusal."""
_HELLO = b"ckpp3-hello"
_FRAME = b"ckpp3-frame"
_TRAILER = b"ckpp3-trailer"
HOW_TO_SHARE = ("give every trainer and daemon of the job the same secret: the trainers' "
                 f"tiers.peer.secret_file or {SECRET_ENV}, the daemons' `peer serve "
                 f"--secret-file` or {SECRET_ENV}")


class PeerAuthError(ProtocolError):
    """A frame fails its HMAC: the other side does not have this side's secret (or the
    frame was forged, replayed or reordered). The connection is closed."""


class PeerSecretError(CkptPilotError, ValueError):
    """No usable peer secret: none given, a file that cannot be read or created, one that
    others may read, or one too short."""


def load_secret(secret_file: str | Path | None, *, what: str) -> bytes:
    """The job's secret: ``CKPTPILOT_PEER_SECRET`` if set, else the contents of
    ``secret_file`` (created, mode 0600, when missing). ``what`` names the setting
    ``secret_file`` came from, for the error."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return _checked(env.strip().encode(), SECRET_ENV)
    if secret_file is None:
        raise PeerSecretError(f"no peer secret: set {what} (a file, created with a random "
                              f"secret when missing) or {SECRET_ENV}; {HOW_TO_SHARE}")
    path = Path(secret_file)
    try:
        if not path.exists():
            _create(path)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PeerSecretError(f"{path} ({what}): the peer secret may be read by others "
                                  f"(mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`")
        key = path.read_bytes().strip()
    except OSError as e:
        raise PeerSecretError(f"{path} ({what}): cannot read or create the peer secret: "
                              f"{e.strerror or e}") from e
    return _checked(key, f"{path} ({what})")


def _checked(key: bytes, where: str) -> bytes:
    if len(key) < MIN_SECRET_BYTES:
        raise PeerSecretError(f"{where}: a peer secret needs at least {MIN_SECRET_BYTES} "
                              f"bytes, this one has {len(key)}; delete the file to have one "
                              "generated, or write one, e.g. `python -c 'import secrets; "
                              "print(secrets.token_hex(32))'`")
    return key


def _create(path: Path) -> None:
    """Write a fresh secret to ``path`` unless someone else does first: written whole to a
    private temporary file, then linked into place (which fails if the name exists)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process was first: use its
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def hello_tag(key: bytes, head: bytes, daemon_nonce: str | None = None) -> bytes:
    """The tag of a HELLO (``head`` is its prelude + header): the daemon's over its own
    nonce, which is in ``head``; the client's over the daemon's nonce as well."""
    bound = b"" if daemon_nonce is None else bytes.fromhex(daemon_nonce)
    return _mac(key, _HELLO, bound, head)


class Session:
    """The tags of one connection after its handshake, seen from one side.

    Threading: one connection serves one request at a time, and so does its session.
    """

    def __init__(self, key: bytes, daemon_nonce: str, client_nonce: str, *,
                 daemon: bool) -> None:
        self._key = key
        self._context = bytes.fromhex(daemon_nonce) + bytes.fromhex(client_nonce)
        self._out, self._in = (b"r", b"q") if daemon else (b"q", b"r")
        self._sent = 0
        self._received = 0

    def sign(self, head: bytes) -> bytes:
        """The tag of the next frame this side sends (``head``: its prelude + header)."""
        tag = self._tag(self._out, self._sent, head)
        self._sent += 1
        return tag

    def verify(self, head: bytes, tag: bytes, what: str) -> None:
        """Check the tag of the next frame received; :class:`PeerAuthError` if it fails."""
        expected = self._tag(self._in, self._received, head)
        self._received += 1
        if not hmac.compare_digest(expected, tag):
            raise PeerAuthError(f"{what} fails its HMAC check: it was not made with this "
                                f"side's peer secret (or was replayed); {HOW_TO_SHARE}")

    def trailer_tag(self, frame_tag: bytes, digest: bytes) -> bytes:
        return _mac(self._key, _TRAILER, self._context, frame_tag, digest)

    def verify_trailer(self, frame_tag: bytes, digest: bytes, tag: bytes, what: str) -> None:
        if not hmac.compare_digest(self.trailer_tag(frame_tag, digest), tag):
            raise PeerAuthError(f"the digest trailer of {what} fails its HMAC check: the shard "
                                f"was not sent with this side's peer secret; {HOW_TO_SHARE}")

    def _tag(self, direction: bytes, n: int, head: bytes) -> bytes:
        return _mac(self._key, _FRAME, self._context, direction, n.to_bytes(8, "little"), head)


def check_hello(key: bytes, head: bytes, tag: bytes, endpoint: str) -> None:
    """A client's check of the daemon's HELLO."""
    if not hmac.compare_digest(hello_tag(key, head), tag):
        raise PeerAuthError(f"{endpoint}: the daemon's greeting fails its HMAC check: that "
                            f"daemon does not have this client's peer secret; {HOW_TO_SHARE}")


def hello_tag_ok(key: bytes, head: bytes, tag: bytes, daemon_nonce: str) -> bool:
    """A daemon's check of the client's HELLO."""
    return hmac.compare_digest(hello_tag(key, head, daemon_nonce), tag)
