"""A flaky network in front of an HTTP server: a TCP proxy process on 127.0.0.1 that the tests
tell, through a JSON rules file, which requests to break and how.

Run as ``python flakyproxy.py LISTEN_PORT UPSTREAM_PORT RULES_FILE``; it prints ``ready`` once
it listens, then one line per fault it injects (``reset GET /bucket/key``). Each client
connection carries one request: the proxy asks the upstream server to close after its answer
(``Connection: close``), so every request is seen and judged on its own.

The rules file (re-read for every request; replace it atomically) holds a list of rules, the
first that matches a request applies::

    [{"method": "GET", "path": "step_00000006", "action": "reset", "times": 2}]

``path`` is a substring of the request target; ``times`` how many matching requests to break
(absent: all of them); ``action``: ``reset`` (the connection is reset before the request
reaches the server), ``cut`` (the server answers, the client gets ``after_bytes`` bytes of it,
then a reset: a stream broken mid-body) or ``stall`` (nothing comes back; the connection stays
open until the client gives up).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_used: dict[str, int] = {}  # how many requests each rule broke, by its JSON text


def _rules(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text() or "[]"))
    except FileNotFoundError:
        return []


def _judge(path: Path, method: str, target: str) -> dict[str, Any] | None:
    with _lock:
        for rule in _rules(path):
            if rule.get("method", method) != method or rule.get("path", "") not in target:
                continue
            key = json.dumps(rule, sort_keys=True)
            if "times" in rule and _used.get(key, 0) >= int(rule["times"]):
                continue
            _used[key] = _used.get(key, 0) + 1
            print(f"{rule['action']} {method} {target}", flush=True)
            return rule
    return None


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0) rather than a FIN: what a crashed peer or a middlebox
    dropping the flow looks like to the client."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


def _close_after(head: bytes) -> bytes:
    lines = head.split(b"\r\n")
    kept = [line for line in lines[1:] if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([lines[0], b"Connection: close", *kept])


def _pump(src: socket.socket, dst: socket.socket, limit: int | None = None) -> bool:
    """Copy until ``src`` ends (True) or ``limit`` bytes went through (False)."""
    sent = 0
    while limit is None or sent < limit:
        chunk = src.recv(65536 if limit is None else min(65536, limit - sent))
        if not chunk:
            return True
        dst.sendall(chunk)
        sent += len(chunk)
    return False


def _serve(client: socket.socket, upstream_port: int, rules: Path) -> None:
    upstream = None
    try:
        data = _read_head(client)
        if b"\r\n\r\n" not in data:
            client.close()
            return
        head, rest = data.split(b"\r\n\r\n", 1)
        method, target = [*head.split(b"\r\n", 1)[0].decode("latin-1").split(" "), "", ""][:2]
        rule = _judge(rules, method, target)
        if rule is not None and rule["action"] == "reset":
            _reset(client)
            return
        if rule is not None and rule["action"] == "stall":
            while client.recv(65536):
                pass
            client.close()
            return
        upstream = socket.create_connection(("127.0.0.1", upstream_port))
        upstream.sendall(_close_after(head) + b"\r\n\r\n" + rest)
        up = threading.Thread(target=_forward_body, args=(client, upstream), daemon=True)
        up.start()
        if rule is not None and rule["action"] == "cut":
            _pump(upstream, client, int(rule.get("after_bytes", 0)))
            _reset(client)
            return
        _pump(upstream, client)
        client.close()
    except OSError:
        client.close()
    finally:
        if upstream is not None:
            upstream.close()


def _forward_body(client: socket.socket, upstream: socket.socket) -> None:
    with contextlib.suppress(OSError):
        _pump(client, upstream)


def main() -> None:
    listen_port, upstream_port, rules = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", listen_port))
    server.listen(128)
    print("ready", flush=True)
    while True:
        client, _ = server.accept()
        threading.Thread(target=_serve, args=(client, upstream_port, rules), daemon=True).start()


if __name__ == "__main__":
    main()
