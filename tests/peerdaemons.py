"""Real ``ckptpilot peer serve`` processes for the peer tier tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ckptpilot.fit.peers import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]


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
    """One daemon process; ``restart`` brings it back empty on the same port."""

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
