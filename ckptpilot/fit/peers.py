"""fit's own peer daemons: real ``ckptpilot peer serve`` processes on 127.0.0.1.

The peer scenarios kill, stop and revive these, never the daemons a user's policy names.
Each listens on an ephemeral port chosen by the kernel and, once restarted after a kill,
comes back empty on the same port, as a rebooted node does. They share one secret file
(:attr:`PeerCluster.secret_file`), which the scenarios' policies name as
``tiers.peer.secret_file``.

Lifecycle: ``PeerCluster(...)`` starts every daemon (in parallel) and waits until each
listens; ``kill``/``stop`` hurt one; ``revive`` resumes stopped ones and restarts dead ones;
``close`` terminates all. Used from one thread.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckptpilot.tiers.peer.auth import load_secret

LISTENING = "ckptpilot peer listening on "
START_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 10.0
MEM_LIMIT = "256MiB"


class PeerDaemonError(RuntimeError):
    """A daemon did not start; the message holds the end of its log."""


class DaemonProcess:
    """One ``ckptpilot peer serve`` process (``args`` after the host, port and secret file);
    ``spawn`` again after it died brings it back, empty, on the same port. The peer tests use
    it too."""

    def __init__(self, log_path: Path, *args: str, secret_file: Path) -> None:
        self.log_path = log_path
        self.args = args
        self.secret_file = secret_file
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spawn(self) -> None:
        cmd = [sys.executable, "-m", "ckptpilot", "peer", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--secret-file", str(self.secret_file), *self.args]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_listening(self, timeout_seconds: float = START_TIMEOUT_SECONDS) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if line.startswith(LISTENING):
                self.port = int(line.strip().rsplit(":", 1)[1])
                return
            if not line:
                break
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise PeerDaemonError(f"a peer daemon did not start; its log ({self.log_path}) ends: "
                              + " | ".join(tail))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def reap(self) -> None:
        """Wait for a daemon that was killed or told to stop; SIGKILL it if it lingers."""
        if self.proc is None:
            return
        try:
            self.proc.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class PeerCluster:
    def __init__(self, log_dir: Path, count: int) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = log_dir / "peer.secret"
        load_secret(self.secret_file, what="fit's peer secret")  # created before the daemons
        self._daemons = [DaemonProcess(log_dir / f"peer{i}.log", "--mem-limit", MEM_LIMIT,
                                       secret_file=self.secret_file)
                         for i in range(count)]
        self._stopped: set[str] = set()
        try:
            self._start(self._daemons)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _start(daemons: list[DaemonProcess]) -> None:
        for d in daemons:
            d.spawn()
        for d in daemons:
            d.wait_listening()

    @property
    def endpoints(self) -> list[str]:
        return [d.endpoint for d in self._daemons]

    def _find(self, endpoint: str) -> DaemonProcess:
        for d in self._daemons:
            if d.endpoint == endpoint:
                return d
        raise KeyError(f"{endpoint} is not one of fit's peer daemons ({self.endpoints})")

    def kill(self, endpoint: str) -> None:
        """SIGKILL one daemon (a node lost with its memory)."""
        d = self._find(endpoint)
        d.signal(signal.SIGKILL)
        d.reap()

    def stop(self, endpoint: str) -> None:
        """SIGSTOP one daemon: it keeps its sockets and answers nothing (a hung node)."""
        self._find(endpoint).signal(signal.SIGSTOP)
        self._stopped.add(endpoint)

    def revive(self) -> None:
        """Resume the stopped daemons and restart the dead ones (empty, same port)."""
        for endpoint in sorted(self._stopped):
            self._find(endpoint).signal(signal.SIGCONT)
        self._stopped.clear()
        dead = [d for d in self._daemons if not d.alive]
        for d in dead:
            d.reap()
        if dead:
            self._start(dead)

    def close(self) -> None:
        for d in self._daemons:
            d.signal(signal.SIGCONT)
            d.signal(signal.SIGTERM)
        for d in self._daemons:
            d.reap()
