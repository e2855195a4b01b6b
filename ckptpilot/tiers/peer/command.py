"""The ``ckptpilot peer`` CLI commands: ``serve`` (a :class:`~ckptpilot.tiers.peer.daemon.
PeerDaemon` with the job's secret, its connection bounds and timeouts, optionally announced
to a health registry) and ``registry`` (hosts the health registry) (SPEC §6).

Owns: the commands' arguments, their one-line errors, the signal handling that stops them.
Must not: serve frames (``daemon`` does).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from ckptpilot.tiers.peer.auth import PeerSecretError, load_secret
from ckptpilot.tiers.peer.daemon import PeerDaemon
from ckptpilot.tiers.peer.placement import describe_failure

log = logging.getLogger(__name__)

def _byte_size(text: str) -> int:
    from ckptpilot.policy import parse_byte_size

    try:
        value = parse_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def _endpoint(text: str) -> str:
    from ckptpilot.tiers.peer.protocol import parse_endpoint

    try:
        parse_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _format_endpoint(host: str, port: int) -> str:
    """``host:port`` as clients write it (``[::1]:port`` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_peer_parser(subparsers: Any) -> None:
    """Register ``peer serve`` and ``peer registry`` on the ``ckptpilot`` command's
    subparsers."""
    peer = subparsers.add_parser("peer", help="peer-memory tier daemon and health registry")
    sub = peer.add_subparsers(dest="peer_command", metavar="command", required=True,
                              parser_class=type(peer))
    serve = sub.add_parser("serve", help="hold other nodes' checkpoint shards in RAM")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this host only; see "
                       "docs/operations/peers.md, 'On a shared network', before listening on "
                       "others)")
    serve.add_argument("--secret-file", default=None, metavar="PATH",
                       help="the job's peer secret, shared with its trainers "
                       "(tiers.peer.secret_file); created with a random secret, mode 0600, "
                       "when missing. Or set CKPTPILOT_PEER_SECRET")
    serve.add_argument("--max-connections", type=lambda t: _count(t, 1), default=128,
                       help="most connections served at once; beyond it a new one evicts an "
                       "unauthenticated or idle one (default 128)")
    serve.add_argument("--max-per-client", type=lambda t: _count(t, 1), default=64,
                       help="most connections from one client address (default 64)")
    serve.add_argument("--header-timeout-seconds", type=_seconds, default=10.0,
                       help="a handshake and each request's header must arrive within this "
                       "(default 10)")
    serve.add_argument("--idle-timeout-seconds", type=_seconds, default=60.0,
                       help="close a connection idle this long; clients reconnect (default 60)")
    serve.add_argument("--port", type=_port, default=0,
                       help="TCP port (0 = any free port; the chosen one is printed)")
    serve.add_argument("--mem-limit", type=_byte_size, default=8 * 2**30,
                       help="most bytes of shards to hold, e.g. 8GiB (default 8GiB)")
    serve.add_argument("--log-level", default="INFO",
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--lazy-torch", action="store_true",
                       help="do not import torch at start, only for the first xor_delta delta "
                       "to fold (that fold, and a fetch of its shard, then wait seconds for "
                       "it): a daemon then needs tens of MB instead of a few hundred, for "
                       "hosts that run many daemons")
    serve.add_argument("--allow-fault-injection", action="store_true",
                       help="accept CORRUPT requests that damage held shards (tests only)")
    serve.add_argument("--registry", type=_endpoint, default=None, metavar="HOST:PORT",
                       help="health registry (`ckptpilot peer registry`) to announce this "
                       "daemon in; needs --node")
    serve.add_argument("--node", type=lambda t: _count(t, 0), default=None,
                       help="this daemon's node index in the health registry (0..nodes-1)")
    serve.add_argument("--advertise-host", default=None,
                       help="host clients reach this daemon at, published in the registry; "
                       "must match their tiers.peer.endpoints (default: --host)")
    serve.add_argument("--registry-timeout-seconds", type=_seconds, default=10.0,
                       help="how long to wait for the registry at start, and for each of its "
                       "requests (default 10)")
    registry = sub.add_parser("registry", help="host the health registry that peer daemons "
                              "announce themselves in (a torch.distributed TCPStore)")
    registry.add_argument("--host", default="127.0.0.1", help="address to listen on")
    registry.add_argument("--port", type=_port, default=0,
                          help="TCP port (0 = any free port; the chosen one is printed)")
    registry.add_argument("--nodes", type=lambda t: _count(t, 1), required=True,
                          help="how many peer daemons (nodes 0..N-1) the registry holds")
    registry.add_argument("--log-level", default="INFO",
                          choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run_peer_command(args: argparse.Namespace) -> int:
    """``ckptpilot peer serve`` / ``peer registry``: print the listening line, run until
    SIGTERM/SIGINT, exit 0; bad input is one line on stderr and exit 2."""
    logging.getLogger().setLevel(args.log_level)
    if args.peer_command == "registry":
        return _run_registry(args)
    return _run_serve(args)


def _serve_error(message: str) -> int:
    print(f"ckptpilot peer serve: error: {message}", file=sys.stderr)
    return 2


def _run_serve(args: argparse.Namespace) -> int:
    from ckptpilot.tiers.peer.membership import Announcer
    from ckptpilot.tiers.peer.protocol import parse_endpoint
    from ckptpilot.tiers.peer.registry import RegistryError

    if (args.registry is None) != (args.node is None):
        return _serve_error("--registry and --node go together: the registry's address and "
                            "this daemon's node index in it")
    advertised = args.advertise_host or args.host
    if args.registry is not None and advertised in ("0.0.0.0", "::", ""):
        return _serve_error(f"--host {args.host!r} is no address a client can use; give "
                            "--advertise-host (the host in the clients' tiers.peer.endpoints)")
    if args.max_per_client > args.max_connections:
        return _serve_error(f"--max-per-client {args.max_per_client} exceeds --max-connections "
                            f"{args.max_connections}")
    try:
        key = load_secret(args.secret_file, what="--secret-file")
    except PeerSecretError as e:
        return _serve_error(str(e))
    try:
        daemon = PeerDaemon(args.host, args.port, key=key, mem_limit=args.mem_limit,
                            allow_fault_injection=args.allow_fault_injection,
                            header_timeout_seconds=args.header_timeout_seconds,
                            idle_timeout_seconds=args.idle_timeout_seconds,
                            max_connections=args.max_connections,
                            max_per_client=args.max_per_client,
                            lazy_torch=args.lazy_torch)
    except OSError as e:
        return _serve_error(f"cannot listen on {args.host}:{args.port}: {describe_failure(e)}")
    host, port = daemon.address
    announcer = None
    if args.registry is not None:
        endpoint = _format_endpoint(advertised, port)
        try:
            parse_endpoint(endpoint)
            announcer = Announcer(args.registry, node=args.node, endpoint=endpoint,
                                  mem_limit_bytes=args.mem_limit,
                                  mem_used=lambda: daemon.store.mem_used,
                                  timeout_seconds=args.registry_timeout_seconds)
            announcer.start()
        except (RegistryError, ValueError) as e:
            daemon.close()
            return _serve_error(str(e))
    stopped_by: list[str] = []

    def stop(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        log.info("received %s: finishing in-flight requests", name)
        stopped_by.append(name)
        if announcer is not None:
            announcer.drain(f"stopping ({name})")
        threading.Thread(target=daemon.shutdown, name="ckptpilot-peer-stop").start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"ckptpilot peer listening on {host}:{port}", flush=True)
    log.info("peer daemon on %s:%d, mem limit %d bytes%s%s", host, port, args.mem_limit,
             ", fault injection ON" if args.allow_fault_injection else "",
             f", node {args.node} of the registry at {args.registry}" if announcer else "")
    daemon.serve_forever()
    if announcer is not None:
        announcer.close(f"stopped ({stopped_by[0] if stopped_by else 'shut down'})")
    log.info("peer daemon stopped")
    return 0


def _run_registry(args: argparse.Namespace) -> int:
    from ckptpilot.tiers.peer.registry import host_registry

    try:
        store = host_registry(args.host, args.port, num_nodes=args.nodes)
    except RuntimeError as e:  # RegistryError, torch.distributed.DistNetworkError
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"ckptpilot peer registry: error: cannot listen on {args.host}:{args.port}: "
              f"{reason}", file=sys.stderr)
        return 2
    stopped = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        log.info("received %s: stopping the health registry", signal.Signals(signum).name)
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    address = _format_endpoint(args.host, store.port)
    print(f"ckptpilot peer registry listening on {address}", flush=True)
    log.info("health registry of %d nodes on %s", args.nodes, address)
    while not stopped.wait(1.0):
        pass
    del store
    log.info("health registry stopped")
    return 0
