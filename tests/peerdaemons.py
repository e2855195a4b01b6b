"""Real ``ckptpilot peer serve`` processes for the peer tier tests.

Every daemon started here and every client of the tests share one secret file,
:data:`SECRET_FILE` (its key :data:`KEY`), as one job's daemons and trainers do.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ckptpilot.fit.peers import DaemonProcess
from ckptpilot.tiers.peer.auth import load_secret
from ckptpilot.tiers.peer.calls import Connection, connect
from ckptpilot.tiers.peer.calls import call as _call
from ckptpilot.tiers.peer.protocol import (
    TRAILER_BYTES,
    Frame,
    Op,
    encode_head,
    read_head,
    read_payload,
)

ROOT = Path(__file__).resolve().parents[1]
_SECRET_DIR = Path(tempfile.mkdtemp(prefix="ckptpilot-test-peer-secret-"))
SECRET_FILE = _SECRET_DIR / "peer.secret"
KEY = load_secret(SECRET_FILE, what="the tests' peer secret")

atexit.register(shutil.rmtree, _SECRET_DIR, ignore_errors=True)


def call(endpoint: str, op: Op, header: dict[str, Any], *args: Any, **kw: Any) -> Frame:
    """``calls.call`` with the tests' key."""
    return _call(endpoint, op, header, *args, key=KEY, **kw)


def terminate(proc: subprocess.Popen[str]) -> int:
    """SIGTERM (SIGKILL after 10 s); closes its stdout; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


class Daemon(DaemonProcess):
    """One daemon process with the tests' secret (or ``secret_file``); ``restart`` brings
    it back empty on the same port."""

    def __init__(self, log_path: Path, *args: str, secret_file: Path = SECRET_FILE) -> None:
        super().__init__(log_path, *args, secret_file=secret_file)

    def wait_listening(self, timeout_seconds: float = 60.0) -> None:
        super().wait_listening(timeout_seconds)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        """SIGKILL, and wait until the port refuses connections."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int | None:
        return None if self.proc is None else terminate(self.proc)


def start(daemons: list[Daemon]) -> list[Daemon]:
    """Spawn every daemon first, then wait for each (they start in parallel)."""
    for d in daemons:
        d.spawn()
    for d in daemons:
        d.wait_listening()
    return daemons


def restart(daemons: list[Daemon]) -> None:
    """Bring the daemons back, empty, on their ports (killing any still running)."""
    for d in daemons:
        d.kill()
        if d.proc is not None and d.proc.stdout is not None:
            d.proc.stdout.close()
    start(daemons)


def revive(daemons: list[Daemon]) -> list[Daemon]:
    """Resume stopped daemons and restart dead ones, so a test finds them all serving."""
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            os.kill(d.proc.pid, signal.SIGCONT)
    dead = [d for d in daemons if d.proc is None or d.proc.poll() is not None]
    if dead:
        restart(dead)
    return daemons


def stop_all(daemons: list[Daemon]) -> None:
    """SIGTERM every daemon first, then wait for each (they stop in parallel)."""
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
            d.proc.send_signal(signal.SIGTERM)
    for d in daemons:
        d.stop()


REGISTRY_LISTENING = "ckptpilot peer registry listening on "


class Registry:
    """One ``ckptpilot peer registry`` process on a free port; ``address`` once listening."""

    def __init__(self, log_path: Path, nodes: int) -> None:
        self.log_path = log_path
        cmd = [sys.executable, "-m", "ckptpilot", "peer", "registry", "--host", "127.0.0.1",
               "--port", "0", "--nodes", str(nodes)]
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                         cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(REGISTRY_LISTENING):
            self.proc.kill()
            raise RuntimeError(f"registry did not start; its log:\n{log_path.read_text()}")
        self.address = line.strip()[len(REGISTRY_LISTENING):]

    def stop(self) -> int:
        return terminate(self.proc)


def session(endpoint: str, timeout_seconds: float = 10.0) -> Connection:
    """An authenticated connection (past its handshake) for tests that write frames by
    hand."""
    return connect(endpoint, KEY, timeout_seconds)


def tagged(conn: Connection, op: Op, header: dict[str, Any], payload: bytes = b"") -> bytes:
    """The bytes of a frame tagged for ``conn``'s session (not a PUT: see :func:`put_frame`)."""
    raw = encode_head(op, header, len(payload))
    return raw + conn.session.sign(raw) + payload


def put_frame(conn: Connection, header: dict[str, Any], meta: bytes, body: bytes,
              digest: bytes) -> bytes:
    """A PUT frame tagged for ``conn``'s session with ``digest`` in its trailer (a real
    sender digests ``body`` into it)."""
    raw = encode_head(Op.PUT, header, len(meta) + len(body) + TRAILER_BYTES)
    tag = conn.session.sign(raw)
    return raw + tag + meta + body + digest + conn.session.trailer_tag(tag, digest)


def reply(conn: Connection) -> Frame | None:
    """The next frame on ``conn``, its tag checked; None at a clean close."""
    head = read_head(conn.sock, max_payload=1 << 20)
    if head is None:
        return None
    conn.session.verify(head.signed, head.tag, f"the {head.op.name} reply")
    return read_payload(conn.sock, head)
